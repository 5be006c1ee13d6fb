"""The search's sampler on a finite space: TPE that never spends a trial re-measuring a configuration."""

from __future__ import annotations

import warnings

import optuna
import pytest

from tuner.search import DIRECTIONS, make_sampler
from tuner.space import all_measured, config_key, load_space, suggest_config

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
    order = run(space, make_sampler(seed, n, space), n)
    assert len(set(order)) == n  # the whole grid, each configuration once
    plain = run(space, make_sampler(seed, n), n)  # the control: TPE without the space repeats itself
    assert len(set(plain)) < n
    more = run(space, make_sampler(seed, n + 3, space), n + 3)  # nothing new left: it repeats, it does not fail
    assert len(set(more)) == n
