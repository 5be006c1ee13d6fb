"""The search's sampler on a finite space: TPE that never spends a trial re-measuring a configuration."""

from __future__ import annotations

import warnings

import optuna
import pytest

from tuner.search.loop import DIRECTIONS
from tuner.search.samplers import make_sampler
from tuner.search.space import all_measured, config_key, load_space, suggest_config

GRID = """
knobs:
  quant: {choices: [fp32, bf16, bnb-nf4, torchao-int8wo]}
  batch_cap: {choices: [1, 2, 4, 8, 16]}
  draft: {choices: [none, "ngram:3"], when: {batch_cap: [1]}}
  kv_fraction: {choices: [0.02], when: {draft: [none]}}
baseline: {quant: fp32, batch_cap: 1, draft: none, kv_fraction: 0.02}
"""
SPEED = {"fp32": 1.0, "bf16": 1.6, "bnb-nf4": 0.5, "torchao-int8wo": 1.2}


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def grid_space(tmp_path, text=GRID):
    p = tmp_path / "grid.yaml"
    p.write_text(text)
    return load_space(p)


def run(space, sampler, n):
    """n trials of the search's sampler on a capacity-like surface (the format's speed x a batch-cap curve that
    peaks at 8); returns the configurations in the order measured."""
    study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
    study.enqueue_trial(dict(space.baseline))
    order = []

    def objective(trial):
        c = suggest_config(trial, space, "m", "cpu")
        order.append(config_key(space, trial.params))
        gain = {1: 1.0, 2: 1.8, 4: 3.0, 8: 4.0, 16: 3.6}[c.batch_cap] * (1.3 if c.draft != "none" else 1.0)
        return SPEED[c.quant] * gain, {"bnb-nf4": 0.3}.get(c.quant, 0.5)

    study.optimize(objective, n_trials=n)
    return order


def test_config_key_ignores_knobs_switched_off_and_open_knobs_are_never_exhausted(tmp_path):
    space = grid_space(tmp_path)

    def key(**params):
        return config_key(space, params)

    # draft only applies at batch cap 1: at 8 a stray draft parameter does not make a new configuration
    assert key(quant="bf16", batch_cap=8, kv_fraction=0.02) == \
        key(quant="bf16", batch_cap=8, draft="ngram:3", kv_fraction=0.02) == \
        (("quant", "bf16"), ("batch_cap", 8), ("kv_fraction", 0.02))
    assert key(quant="bf16", batch_cap=1, draft="ngram:3") != key(quant="bf16", batch_cap=1, draft="none",
                                                                  kv_fraction=0.02)
    assert key(quant="bf16") is None  # the batch cap is missing
    seen = {key(quant="bf16", batch_cap=1, draft=d, kv_fraction=0.02) for d in ("none", "ngram:3")}
    assert all_measured(space, {"quant": "bf16", "batch_cap": 1}, seen)  # both drafts measured
    assert not all_measured(space, {"quant": "bf16"}, seen)  # bf16 at other caps is not
    open_kv = grid_space(tmp_path, GRID.replace("{choices: [0.02], when", "{low: 0.01, high: 0.05, when"))
    seen = {config_key(open_kv, {"quant": "bf16", "batch_cap": 8, "kv_fraction": 0.02})}
    assert not all_measured(open_kv, {"quant": "bf16", "batch_cap": 8}, seen)  # kv is open


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_trial_measures_a_new_configuration_until_the_grid_is_exhausted(tmp_path, seed):
    space = grid_space(tmp_path)
    n = 4 * 5 + 4  # the grid: 4 formats x 5 caps, plus the 4 drafts at cap 1
    order = run(space, make_sampler(seed, space), n)
    assert len(set(order)) == n  # the whole grid, each configuration once
    plain = run(space, make_sampler(seed), n)  # the control: TPE without the space repeats itself
    assert len(set(plain)) < n
    more = run(space, make_sampler(seed, space), n + 3)  # nothing new left: it repeats, it does not fail
    assert len(set(more)) == n


def test_a_new_study_measures_the_default_then_every_format_at_the_top_batch_cap(tmp_path):
    from tuner.search.loop import enqueue_start

    space = grid_space(tmp_path, GRID.replace("batch_cap: {choices: [1, 2, 4, 8, 16]}",
                                              "batch_cap: {choices: [1, 2, 4, 8, 16], increasing: true}"))
    orders = []
    for seed in (0, 1):
        study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(seed, space))
        enqueue_start(study, space, seed, 12)
        study.optimize(lambda t: (suggest_config(t, space, "m", "cpu").batch_cap, 0.5), n_trials=6)
        orders.append([(t.params["quant"], t.params["batch_cap"]) for t in study.trials])
    for order in orders:
        assert order[0] == ("fp32", 1)  # the engine default first
        assert sorted(order[1:5]) == sorted((q, 16) for q in SPEED)  # each format once, at the top cap
    assert orders[0][1:5] != orders[1][1:5]  # in the seed's order
    # a small budget: the 4-format sweep does not fit in half of the 8 trials after the default: no sweep at all
    for budget, waiting in ((9, 1 + 4), (8, 1)):
        study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(0, space))
        enqueue_start(study, space, 0, budget)
        assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == waiting


def test_the_sweep_uses_the_listed_top_not_a_baseline_beyond_it_and_takes_turns_across_engines(tmp_path):
    from tuner.search.space import combine_spaces, startup_sweep

    vllm_like = grid_space(tmp_path, GRID.replace("batch_cap: {choices: [1, 2, 4, 8, 16]}",
                                                  "batch_cap: {choices: [2, 4, 8], increasing: true}")
                           .replace("batch_cap: 1,", "batch_cap: 128,"))
    assert 128 in vllm_like.knobs["batch_cap"].choices  # the default is a point of the space ...
    sweep = startup_sweep(vllm_like, 0, 10)
    assert {p["batch_cap"] for p in sweep} == {8}  # ... but the sweep stays at the top the file lists
    assert sorted(p["quant"] for p in sweep) == sorted(SPEED)
    lp = tmp_path / "llamacpp.yaml"
    lp.write_text("engine: llamacpp\nknobs:\n  quant: {choices: [F16, Q8_0, Q4_0]}\n"
                  "  batch_cap: {choices: [1, 4], increasing: true}\nbaseline: {quant: F16, batch_cap: 4}\n")
    both, _ = combine_spaces([vllm_like, load_space(lp)])
    sweep = startup_sweep(both, 0, 5)
    assert [p["engine"] for p in sweep] == ["transformers", "llamacpp", "transformers", "llamacpp", "transformers"]
    assert all(p["llamacpp.batch_cap"] == 4 and p["llamacpp.quant"] != "F16"  # F16 at 4 is llama.cpp's default
               for p in sweep if p["engine"] == "llamacpp")


@pytest.mark.parametrize("knob, value, says", [("quant", "true", "only a numeric knob"),
                                                ("batch_cap", "3", "expected true or false")])
def test_increasing_on_a_knob_it_cannot_apply_to_is_one_line_naming_the_key(tmp_path, knob, value, says):
    from tuner.errors import TunerError

    text = GRID.replace(f"  {knob}: {{choices:", f"  {knob}: {{increasing: {value}, choices:")
    with pytest.raises(TunerError) as e:
        grid_space(tmp_path, text)
    assert f"knobs.{knob}.increasing" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_configuration_that_failed_is_never_proposed_again(tmp_path, seed):
    """Every configuration at batch cap 16 runs out of memory (a failed trial, as the search records it: FAIL with
    a reason). On the 24-configuration grid, 24 trials of the search's sampler measure each configuration once, the
    failed ones included: a configuration that failed is not proposed again while anything new is left."""
    from tuner.search.objective import TrialFailed

    space = grid_space(tmp_path)
    study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(seed, space))
    study.enqueue_trial(dict(space.baseline))
    order = []

    def objective(trial):
        c = suggest_config(trial, space, "m", "cpu")
        order.append(config_key(space, trial.params))
        if c.batch_cap == 16:
            trial.set_user_attr("reason", "out of memory (trial memory limit 4.0 GB): CUDA out of memory")
            raise TrialFailed("out of memory")
        return SPEED[c.quant] * c.batch_cap, 0.5

    study.optimize(objective, n_trials=24, catch=(TrialFailed,))
    assert len(order) == 24 and len(set(order)) == 24
    assert sum(t.state == optuna.trial.TrialState.FAIL for t in study.trials) == 4  # each format once at 16


def test_an_interrupted_trial_leaves_its_configuration_to_be_measured(tmp_path):
    """A trial failed from outside (its worker died) said nothing about its configuration: with the only other one
    measured, the next trial takes it; the same configuration failed by itself (out of memory) is not taken again
    (the grid is then exhausted: the next trial repeats the one measured)."""
    space = grid_space(tmp_path, "knobs:\n  quant: {choices: [fp32, bf16]}\n  batch_cap: {choices: [1]}\n"
                                 "baseline: {quant: fp32, batch_cap: 1}\n")
    outcomes = {}
    for reason in ("interrupted: its worker host:1:2 died during the trial (process gone)",
                   "out of memory (trial memory limit 4.0 GB): killed"):
        study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(0, space))
        dists = {"quant": optuna.distributions.CategoricalDistribution(["fp32", "bf16"]),
                 "batch_cap": optuna.distributions.CategoricalDistribution([1])}
        study.add_trial(optuna.trial.create_trial(params={"quant": "fp32", "batch_cap": 1}, distributions=dists,
                                                  values=[1.0, 0.5]))
        study.add_trial(optuna.trial.create_trial(params={"quant": "bf16", "batch_cap": 1}, distributions=dists,
                                                  state=optuna.trial.TrialState.FAIL, user_attrs={"reason": reason}))
        picks = []
        for _ in range(3):
            trial = study.ask()
            picks.append(suggest_config(trial, space, "m", "cpu").quant)
            study.tell(trial, [1.0, 0.5])
        outcomes[reason.split(":")[0]] = picks
    assert outcomes["interrupted"][0] == "bf16"
    assert outcomes["out of memory (trial memory limit 4.0 GB)"][0] == "fp32"


@pytest.mark.parametrize("seed", [0, 1])
def test_tpe_takes_the_candidate_the_acquisition_hook_leaves(seed):
    """The contract with Optuna's internals (tuner.search.optuna_private.with_acquisition_hooks): TPE's own sampling
    of a relative group runs inside `sample_group`, and the candidate it returns is the one with the best acquisition
    after `mask_acquisition`. Here the mask leaves only the candidate with the smallest x (every other one -inf): each
    trial after the start-up takes exactly that value -- which fails if Optuna stops calling either private step
    (a renamed `_sample` or `_compute_acquisition_func` would leave TPE's own choice)."""
    import numpy as np

    from tuner.search.optuna_private import with_acquisition_hooks

    groups, kept = [], []

    class Masked(with_acquisition_hooks(optuna.samplers.TPESampler)):
        def sample_group(self, study, trial, search_space, sample):
            groups.append(trial.number)
            return sample()

        def mask_acquisition(self, samples, values):
            x = np.asarray(samples["x"])
            keep = int(np.argmin(x))
            values[np.arange(len(values)) != keep] = -np.inf
            kept.append(float(x[keep]))
            return values

    sampler = Masked(seed=seed, n_startup_trials=2, multivariate=True, n_ei_candidates=24)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: (t.suggest_float("x", 0.0, 10.0) - 7.0) ** 2 + t.suggest_float("y", 0.0, 1.0), n_trials=8)
    after_startup = study.trials[2:]
    assert groups == [t.number for t in after_startup]  # one relative group per trial past the start-up
    assert len(kept) == len(after_startup)
    assert [t.params["x"] for t in after_startup] == pytest.approx(kept)
