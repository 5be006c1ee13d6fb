"""`tuner search --strategy predict`: the choosing rule on fixed predictions driven through a real Optuna study, the
enumeration and profile budget on simulated engines (unit), and one real search on llama-server (search tier)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner
from tuner.predict import choose
from tuner.predict import strategy as st
from tuner.search.space import load_space

SPACE = REPO / "tests" / "data" / "tiny_predict_space.yaml"


def fixed(space: Any, rps: dict[tuple[str, int], float], rel_band: float = 0.05) -> list[choose.Prediction]:
    """Predictions of every (quant, batch cap) of `space` with the given capacities and a narrow band."""
    from optuna.trial import FixedTrial

    from tuner.search.space import config_key, suggest_config

    out = []
    for params in st.enumerate_space(space):
        c = suggest_config(FixedTrial(params), space, "smollm2-135m", "cpu").to_dict()
        r = rps[(c["quant"], c["batch_cap"])]
        out.append(choose.Prediction(params, c, config_key(space, params), r, (r * (1 - rel_band), r * (1 + rel_band)),
                                 "fixed", banded=True))
    return out


def drive(space: Any, strategy: st.PredictStrategy, truth: dict[tuple[str, int], float], trials: int = 20,
          exceeds: tuple[str, ...] = ()) -> Any:
    """The search loop's use of the strategy (tuner.search.loop.run_search) on an in-memory study, each trial's capacity
    `truth`'s value for its configuration, recorded as tuner.search.objective records it; a weight type in `exceeds` fails
    the quality gate (pruned before its capacity is measured, as tuner.search.objective.apply_quality does)."""
    import optuna

    from tuner.search.space import suggest_config

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(directions=["maximize", "maximize"])

    def objective(trial: Any) -> tuple[float, float]:
        c = suggest_config(trial, space, "smollm2-135m", "cpu").to_dict()
        rps = truth[(c["quant"], c["batch_cap"])]
        trial.set_user_attr("config", c)
        if c["quant"] in exceeds:
            trial.set_user_attr("quality", {"gate": {"verdict": "exceeds"}})
            trial.set_user_attr("reason", f"quality: {c['quant']} drops 5 pp > budget 1 pp with confidence")
            raise optuna.TrialPruned()
        trial.set_user_attr("capacity", {"requests_per_s": rps, "requests_per_s_ci": [rps, rps], "verdict": "meets"})
        trial.set_user_attr("constraints", [0.0])
        return rps, 0.0

    for _ in range(trials):
        if not strategy.enqueue_next(study, space):
            break
        study.optimize(objective, n_trials=1)
    return study


def measured_configs(study: Any) -> list[tuple[str, int]]:
    return [(t.user_attrs["config"]["quant"], t.user_attrs["config"]["batch_cap"]) for t in study.trials]


RAW = {("Q4_1", 1): 1.0, ("Q4_1", 2): 1.8, ("Q4_1", 4): 2.4, ("Q8_0", 1): 0.8, ("Q8_0", 2): 1.4, ("Q8_0", 4): 3.0}


def test_a_model_off_by_a_constant_factor_is_recalibrated_and_the_search_stops_early(monkeypatch, tmp_path) -> None:
    """The engine serves half of every prediction. After the baseline the predictions are scaled by the measured
    ratio: the configuration the raw model puts above the best measured (Q4_1 cap 2: 1.8 predicted > 1.5 measured)
    is never measured, nor one whose calibrated band's top is below the best; the search stops with 3 of 6."""
    space = load_space(SPACE)
    strategy = st.PredictStrategy(lambda c, o: [])
    strategy.predictions = fixed(space, RAW)
    truth = {k: v / 2 for k, v in RAW.items()}
    study = drive(space, strategy, truth)
    got = measured_configs(study)
    assert got == [("Q4_1", 1), ("Q8_0", 4), ("Q4_1", 4)]  # the baseline first, then by the chance to beat the best
    assert study.trials[0].user_attrs["baseline"] is True
    assert ("Q4_1", 2) not in got and ("Q8_0", 1) not in got
    assert strategy.stopped and "has a chance of 2.3%" in strategy.stopped
    second = study.trials[1].user_attrs
    assert second["predicted_requests_per_s"] == 3.0  # the raw model's figure is what the trial records
    assert second["predicted_calibrated_requests_per_s"] == pytest.approx(1.5)  # x measured/predicted of trial 0
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))  # the profiles' calibration histories
    report = strategy.report(study)
    assert (report["strategy"], report["n_predicted"], report["n_measured"]) == ("predict", 6, 3)
    assert [m["signed_error"] for m in report["measured"]] == pytest.approx([1.0, 1.0, 1.0])  # +100%: 2x high
    assert report["model_error"]["median_abs"] == pytest.approx(1.0)
    # each measured trial went into its profile's calibration history, once over repeated answers (a resume)
    from tuner.predict.calibration import read_history

    strategy.report(study)
    history = read_history(study.trials[0].user_attrs["predicted_profile"])
    assert [h["ratio"] for h in history] == pytest.approx([0.5, 0.5, 0.5])
    assert all(h["within_band"] is False and h["source"].startswith("tuner search --strategy predict")
               for h in history)


def test_an_accurate_model_measures_only_what_can_still_win() -> None:
    """The model is right: after the baseline the best predicted is measured, and every configuration whose band's
    top (calibrated, 2 spreads up) is below it stays unmeasured."""
    space = load_space(SPACE)
    strategy = st.PredictStrategy(lambda c, o: [])
    strategy.predictions = fixed(space, RAW)
    study = drive(space, strategy, RAW)
    got = measured_configs(study)
    assert got[:2] == [("Q4_1", 1), ("Q8_0", 4)] and len(got) < len(RAW)
    for t in study.trials[1:]:  # each chosen one's band reached above the best measured when it was chosen
        assert t.user_attrs["predicted_calibrated_band"][1] > t.user_attrs["best_measured_before_rps"]
    ratio, sigma = choose.calibration([(RAW[k], RAW[k]) for k in got])
    left = [p for p in strategy.predictions if (p.config["quant"], p.config["batch_cap"]) not in got]
    assert left and all(choose.calibrated_band(p, ratio, sigma)[1] < 3.0 for p in left)  # why it stopped


def test_a_configuration_sharing_a_measured_ones_simulation_is_not_measured(monkeypatch, tmp_path) -> None:
    """Q8_0 at caps 2 and 4 given one shared prediction key (as configurations differing only in prefix caching or
    a KV fraction whose KV holds every request alike get), the engine serving both at 3.0: once one is measured, the
    other is not (its chance to beat the best would be a coin flip on measurement noise), and the answer says
    which trial it shares its prediction with. Without the shared key the same search measures it."""
    space = load_space(SPACE)
    rps = {**RAW, ("Q8_0", 2): 3.0}
    runs = {}
    for shared in (False, True):
        strategy = st.PredictStrategy(lambda c, o: [])
        strategy.predictions = fixed(space, rps)
        for p in strategy.predictions:
            if shared and p.config["quant"] == "Q8_0" and p.config["batch_cap"] in (2, 4):
                p.shared = ("fixed", "Q8_0 at 2 and 4")
        runs[shared] = (strategy, drive(space, strategy, rps))
    assert ("Q8_0", 2) in measured_configs(runs[False][1])
    strategy, study = runs[True]
    got = measured_configs(study)
    twins = [i for i, c in enumerate(got) if c in (("Q8_0", 2), ("Q8_0", 4))]
    assert got[0] == ("Q4_1", 1) and twins == [1]  # the first chosen after the baseline, its twin never
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    strategy.space = space  # as prepare sets it
    report = strategy.report(study)
    assert report["n_shared_with_measured"] == 1
    assert any(n.startswith("1 configuration(s) not measured: each shares its prediction") and "(trials 1)" in n
               for n in report["notes"])


def test_a_weight_type_out_of_the_quality_budget_takes_its_configurations_out() -> None:
    space = load_space(SPACE)
    strategy = st.PredictStrategy(lambda c, o: [])
    strategy.predictions = fixed(space, RAW)
    study = drive(space, strategy, RAW, exceeds=("Q8_0",))
    tried = [(t.params.get("quant") or t.user_attrs["config"]["quant"], t.state.name) for t in study.trials]
    assert tried[:2] == [("Q4_1", "COMPLETE"), ("Q8_0", "PRUNED")]  # Q8_0 cap 4, the best predicted, is tried once
    assert [q for q, _ in tried].count("Q8_0") == 1 and tried[2] == ("Q4_1", "COMPLETE")


def test_the_band_counts_not_the_point_alone() -> None:
    """Against a best of 2.0: a prediction of 2.2 with a narrow band is more likely to beat it than one of 2.3 whose
    band spans 0.5..5 (the wide one is as likely below as above); the narrow one is chosen."""
    space = load_space(SPACE)
    preds = fixed(space, RAW)
    narrow, wide = preds[1], preds[2]
    narrow.rps, narrow.band = 2.2, (2.15, 2.25)
    wide.rps, wide.band = 2.3, (0.5, 5.0)
    chosen, chance = choose.next_candidate([narrow, wide], set(), 1.0, choose.PRIOR_SIGMA, 2.0)
    assert chosen is narrow and 0.5 < chance < 1
    assert choose.next_candidate([wide], set(), 1.0, choose.PRIOR_SIGMA, 2.0)[1] < chance
    # far below the best: no chance left, nothing chosen
    narrow.rps, narrow.band = 1.0, (0.95, 1.05)
    assert choose.next_candidate([narrow], set(), 1.0, choose.PRIOR_SIGMA, 2.0)[0] is None


def test_calibration_is_the_measured_ratio_and_its_spread_shrinks_with_agreeing_measurements() -> None:
    ratio, sigma = choose.calibration([(2.0, 1.0), (4.0, 2.0), (1.0, 0.5)])
    assert ratio == pytest.approx(0.5) and sigma < choose.PRIOR_SIGMA
    assert choose.calibration([]) == (1.0, choose.PRIOR_SIGMA)
    assert choose.calibration([(2.0, 0.0)]) == (1.0, choose.PRIOR_SIGMA)  # a zero capacity carries no ratio
    assert choose.calibration([(1.0, 2.0), (1.0, 0.5)])[1] > choose.PRIOR_SIGMA  # disagreeing: wider than the prior


def test_the_space_is_enumerated_with_a_few_values_of_each_continuous_knob() -> None:
    from tuner.search.space import config_key

    space = load_space(REPO / "tests" / "data" / "tiny_llamacpp_space.yaml")
    grid = st.enumerate_space(space)
    # Q4_1 (baseline) + 2 weight types, batch caps 1 (baseline) + 2, 4, KV types auto, q8_0, and the KV fraction
    # at 0.002, its log-middle and 0.01 (= the baseline's)
    assert len(grid) == 3 * 3 * 2 * 3
    assert sorted({p["kv_fraction"] for p in grid}) == pytest.approx([0.002, 0.002 ** 0.5 * 0.01 ** 0.5, 0.01])
    assert len({config_key(space, p) for p in grid}) == len(grid)
    assert config_key(space, dict(space.baseline)) in {config_key(space, p) for p in grid}


def test_the_baseline_format_is_profiled_first_then_the_closest() -> None:
    base = ("Q4_1", "auto", 0, 0)
    formats = [("Q8_0", "q8_0", 1, 0), ("Q8_0", "auto", 0, 0), base, ("Q4_0", "auto", 0, 0)]
    order = st.profile_order(formats, base, seed=0)
    assert order[0] == base and set(order[1:3]) == {("Q8_0", "auto", 0, 0), ("Q4_0", "auto", 0, 0)}
    assert order[3] == ("Q8_0", "q8_0", 1, 0)


# ------------------------------------------------------------------ prepare, on simulated profiles --- #
def simulated_profile(truth: Any, cap: int, name: str) -> dict[str, Any]:
    """A profile taken by the real protocol (tuner.predict.waves.collect_samples) on a simulated engine."""
    from tuner.predict import waves
    from tuner.predict.fit import fit_step_model
    from tuner.predict.simulate import SimulatedEngine

    engine = SimulatedEngine(truth, cap, seed=5)
    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), cap,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0))
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"id": name, "key": {"host": {}, "build": {}}, "fit": fit, "samples": s, "notes": [], "batch_cap": cap,
            "ranges": {"max_seqs": cap, "max_context_per_seq": max(waves.DECODE_PROMPTS) + waves.DECODE_TOKENS,
                       "max_prompt_tokens": max(waves.PREFILL_TOKENS)}}


class SimulatedProfiles(st.PredictStrategy):
    """The strategy with the llama-server profile replaced by one taken on a simulated engine (per weight type)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profiled: list[str] = []
        self.caps: list[int] = []  # the batch cap each profile was taken at

    def cached(self, members: list[choose.Prediction], cap: int) -> None:
        return None

    def measure(self, members: list[choose.Prediction], cap: int) -> dict[str, Any]:
        from tuner.predict.simulate import StepModel

        quant = members[0].config["quant"]
        self.profiled.append(quant)
        self.caps.append(cap)
        per_seq = {"Q4_1": 0.002, "Q8_0": 0.001}[quant]
        return simulated_profile(StepModel(decode_base_s=0.010, decode_per_seq_s=per_seq, prefill_base_s=0.003,
                                           prefill_per_token_s=1e-4, noise_sigma=0.1), cap, f"sim-{quant}")


def context(space: Any) -> Any:
    from tuner.measure.workload import WorkloadSpec
    from tuner.search.objective import SearchContext
    from tuner.slo import SLO, parse_slo

    slo = SLO(bounds=tuple(parse_slo("e2e:p50<5s")))
    return SearchContext(model="smollm2-135m", device="cpu", space=space, primary=slo.bounds[0], slo=slo,
                         max_quality_drop=1.0, workload=WorkloadSpec(requests=24, input_len=(64, 200),
                                                                     output_len=(32, 64)),
                         quality_tasks=("arc_easy",), quality_limit=20, score_quality=False,
                         probe_requests=(12, 30), max_probes=3)


def pool(config: Any, options: Any) -> list[Any]:
    from tuner.measure.workload import Request

    rng = random.Random(1)
    return [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(32, 64), None)
            for i in range(options.pool_size(config.batch_cap, 2))]


def test_a_short_timeout_profiles_the_baseline_format_only_and_says_what_was_left_out() -> None:
    space = load_space(SPACE)
    strategy = SimulatedProfiles(pool)
    # no time left: the baseline's format is profiled all the same (it is measured first), the other is left out
    strategy.prepare(context(space), time_left_s=0.0)
    assert strategy.profiled == ["Q4_1"]
    report = strategy.report_prediction()
    assert report["n_predicted"] == 3 and report["n_configurations"] == 6
    assert report["left_out"] == [{"configurations": 3, "why": report["left_out"][0]["why"]}]
    assert "quant=Q8_0" in report["left_out"][0]["why"] and "time budget" in report["left_out"][0]["why"]
    caps = {p.config["batch_cap"]: p for p in strategy.predictions}
    assert caps[4].rps > caps[1].rps > 0  # a continuous-batching engine serves more at a higher cap
    # the engine default's band at the start (it is measured first); the others' when the choosing rule needs them
    assert [p.config["batch_cap"] for p in strategy.predictions if p.banded] == [1]
    assert all(p.band[0] <= p.rps <= p.band[1] for p in strategy.predictions if p.banded)
    assert not any(p.extrapolated for p in strategy.predictions)  # the workload lies within the profile's ranges
    assert report["prediction_cost"]["simulations"] == 3 + (st.BAND_REPLICATES + 2)  # 3 points, 1 band
    assert report["prediction_cost"]["s_per_configuration"] > 0 and report["n_banded"] == 1


def test_without_a_timeout_every_format_within_the_profile_cap_is_predicted() -> None:
    space = load_space(SPACE)
    strategy = SimulatedProfiles(pool)
    strategy.prepare(context(space), time_left_s=None)
    assert strategy.profiled == ["Q4_1", "Q8_0"] and not strategy.left_out
    best = max(strategy.predictions, key=lambda p: p.rps)
    assert (best.config["quant"], best.config["batch_cap"]) == ("Q8_0", 4)  # the faster steps, the most slots


def test_a_default_cap_above_the_listed_ones_is_extrapolated_and_calibrated_apart(tmp_path, monkeypatch) -> None:
    """The vllm-cpu space's shape: batch caps 1-4 listed, the engine default at 8 (added to the choices by the
    loader). Each format is profiled at 4, the configurations at 8 are predicted as extrapolations. The engine
    serves a quarter of the prediction at 8, the prediction within: the default, measured first, calibrates the
    other format's cap 8 (x 0.25) but not the predictions within their profile (x 1), so the search does not chase
    the other extrapolation; the answer reports the default's error and says where it calibrates."""
    path = tmp_path / "space.yaml"
    path.write_text(SPACE.read_text().replace("batch_cap: {choices: [1, 2, 4]}",
                                              "batch_cap: {choices: [1, 2, 4], increasing: true}")
                    .replace("batch_cap: 1,", "batch_cap: 8,"))
    space = load_space(path)
    assert space.baseline["batch_cap"] == 8 and space.knobs["batch_cap"].top == 4
    strategy = SimulatedProfiles(pool)
    strategy.prepare(context(space), time_left_s=None)
    assert strategy.profiled == ["Q4_1", "Q8_0"] and strategy.caps == [4, 4]
    assert {p.config["batch_cap"] for p in strategy.predictions if p.extrapolated} == {8}
    assert all(p.rps for p in strategy.predictions) and len(strategy.predictions) == 8
    truth = {(p.config["quant"], p.config["batch_cap"]): p.rps * (0.25 if p.config["batch_cap"] == 8 else 1.0)
             for p in strategy.predictions}
    study = drive(space, strategy, truth)
    first = study.trials[0].user_attrs
    assert first["baseline"] and first["predicted_calibrates"] is False and first["predicted_extrapolated"]
    assert measured_configs(study)[0] == ("Q4_1", 8) and len(study.trials) < len(strategy.predictions)
    assert [c for _, c in measured_configs(study)[1:]].count(8) == 0  # Q8_0 at 8 was predicted 2x a Q4_1 at 4
    for t in study.trials[1:]:  # within: scaled by the measured ratio within (1), not by the default's 0.25
        assert t.user_attrs["predicted_calibrates"] is True
        assert t.user_attrs["predicted_calibrated_requests_per_s"] == pytest.approx(
            t.user_attrs["predicted_requests_per_s"])
    other8 = next(p for p in strategy.predictions if p.config == {**first["config"], "quant": "Q8_0"})
    assert other8.rps > max(p.rps for p in strategy.predictions if p.config["batch_cap"] < 8)  # chased if uncalibrated
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    report = strategy.report(study)
    assert [m["calibrates"] for m in report["measured"]] == [False] + [True] * (len(study.trials) - 1)
    assert report["measured"][0]["signed_error"] == pytest.approx(3.0)  # reported: predicted 4x the measured
    assert any(n.startswith("trial(s) 0: predicted past the sequences their profile measured") for n in report["notes"])


@pytest.mark.parametrize("band_every", [False, True])
def test_the_simulations_run_in_worker_processes_predict_what_the_serial_run_does(monkeypatch, band_every) -> None:
    """prepare with its simulations prefetched in 2 worker processes (tuner.predict.estimate.prefetch) predicts
    each configuration, band, note and left-out entry as the serial run does, to the last bit; and the prefetch
    ran every search predict_group and band then made (none left for the serial code): every point and the engine
    default's band, or with `band_every` every band."""
    import tuner.predict.estimate as est

    space = load_space(SPACE)
    runs = []
    for workers in (1, 2):
        monkeypatch.setattr(est, "workers_available", lambda w=workers: w)
        est._SEARCHES.clear()
        strategy = SimulatedProfiles(pool, band_every=band_every)
        strategy.prepare(context(space), time_left_s=None)
        runs.append((strategy, len(est._SEARCHES)))
    (serial, _), (parallel, kept) = runs
    assert "prefetch" not in serial.timing
    bands = 6 if band_every else 1
    assert parallel.timing["prefetch"]["simulations"] == kept == 6 + bands * (st.BAND_REPLICATES + 2)
    assert ([(p.key, p.rps, p.band, p.notes, p.extrapolated, p.profile) for p in parallel.predictions]
            == [(p.key, p.rps, p.band, p.notes, p.extrapolated, p.profile) for p in serial.predictions])
    assert (parallel.left_out, parallel.notes) == (serial.left_out, serial.notes)
    assert sum(p.banded for p in parallel.predictions) == bands


def test_bands_computed_as_the_choosing_rule_needs_them_choose_what_every_band_computed_would(monkeypatch) -> None:
    """The same search twice on simulated profiles, the engine serving each configuration at its prediction: every
    band computed at the start, or each when the choosing rule could pick its configuration (one at a time here).
    Both measure the same configurations in the same order; the lazy one computed fewer bands, every configuration it
    measured carried its band, and none it computed was wider than it had assumed."""
    monkeypatch.setattr(st, "BAND_BATCH", 1)
    space = load_space(SPACE)
    runs = []
    for every in (True, False):
        strategy = SimulatedProfiles(pool, band_every=every)
        strategy.prepare(context(space), time_left_s=None)
        truth = {(p.config["quant"], p.config["batch_cap"]): p.rps for p in strategy.predictions}
        study = drive(space, strategy, truth)
        runs.append((measured_configs(study), strategy, study))
    (eager_order, eager, _), (lazy_order, lazy, study) = runs
    assert lazy_order == eager_order and len(lazy_order) < 6
    assert lazy.report_prediction()["n_banded"] < eager.report_prediction()["n_banded"] == 6
    assert all(t.user_attrs["predicted_band"] for t in study.trials)
    assert lazy.report_prediction()["bands"]["wider_than_assumed"] == []
    stored = study.user_attrs[st.PREDICTIONS]["configurations"]  # the study keeps the bands the choices computed
    assert sum(c["predicted_band"] is not None for c in stored) == lazy.report_prediction()["n_banded"]


class OneFormatTooSlow(SimulatedProfiles):
    """Q8_0's profile so slow (30 s a decode step) that no simulated request ends within the request timeout."""

    def measure(self, members: list[choose.Prediction], cap: int) -> dict[str, Any]:
        from tuner.predict.simulate import StepModel

        if members[0].config["quant"] != "Q8_0":
            return super().measure(members, cap)
        self.profiled.append("Q8_0")
        return simulated_profile(StepModel(decode_base_s=30.0, decode_per_seq_s=1.0, prefill_base_s=0.003,
                                           prefill_per_token_s=1e-4, noise_sigma=0.1), cap, "sim-slow")


def test_a_format_whose_simulation_fails_is_left_out_said_and_the_rest_predicted() -> None:
    """A simulation that cannot run (every simulated warm-up request times out) does not end the search: that
    format's configurations are not predicted, not measured, with the reason; the others are predicted."""
    strategy = OneFormatTooSlow(pool)
    strategy.prepare(context(load_space(SPACE)), time_left_s=None)
    assert strategy.profiled == ["Q4_1", "Q8_0"]
    assert {p.config["quant"] for p in strategy.predictions} == {"Q4_1"} and len(strategy.predictions) == 3
    assert [e["configurations"] for e in strategy.left_out] == [1, 1, 1]
    assert all("quant=Q8_0" in e["why"] and "its simulation failed (RuntimeError: every warm-up request failed" in e["why"]
               for e in strategy.left_out)


class SimulatedAcrossEngines(SimulatedProfiles):
    """Profiles on simulated engines for every (engine, weight type) of the tiny spaces: transformers' steps slower."""

    def measure(self, members: list[choose.Prediction], cap: int) -> dict[str, Any]:
        from tuner.predict.simulate import StepModel

        c = members[0].config
        self.profiled.append((c["engine"], c["quant"]))
        base = {"transformers": 0.030, "llamacpp": 0.010}[c["engine"]]
        per_seq = {"fp32": 0.004, "bf16": 0.003, "Q4_1": 0.002, "Q8_0": 0.001}[c["quant"]]
        return simulated_profile(StepModel(decode_base_s=base, decode_per_seq_s=per_seq, prefill_base_s=0.003,
                                           prefill_per_token_s=1e-4, noise_sigma=0.1), cap,
                                 f"sim-{c['engine']}-{c['quant']}")


def test_across_engines_every_engine_is_predicted_its_default_measured_first_and_drafts_are_listed(
        monkeypatch, tmp_path) -> None:
    """--engine transformers,llamacpp (the tiny spaces combined): every configuration of both engines predicted
    except those with a draft (no profile of speculative decoding), which are listed as not predicted, not measured;
    each engine's default format is profiled even with no time left, each engine's default measured first (the
    first engine's as the baseline), then the choosing rule with each engine's own calibration."""
    from tuner.search.space import combine_spaces

    space, _ = combine_spaces([load_space(REPO / "tests" / "data" / "tiny_space.yaml"), load_space(SPACE)])
    grid = st.enumerate_space(space)
    assert len(grid) == len(st.enumerate_space(space.engines[0])) + len(st.enumerate_space(space.engines[1]))
    short = SimulatedAcrossEngines(pool)
    short.prepare(context(space), time_left_s=0.0)
    assert sorted(short.profiled) == [("llamacpp", "Q4_1"), ("transformers", "fp32")]  # both engine defaults
    strategy = SimulatedAcrossEngines(pool)
    strategy.prepare(context(space), time_left_s=None)
    drafts = [p for p in grid if p.get("transformers.draft", "none") != "none"]
    assert drafts and strategy.left_out == [{"why": "draft ngram:3: speculative decoding is not profiled yet",
                                             "configurations": len(drafts)}]
    assert len(strategy.predictions) == len(grid) - len(drafts)
    assert {p.config["engine"] for p in strategy.predictions} == {"transformers", "llamacpp"}
    # the real engines serve 0.6x (transformers) and 1.2x (llamacpp) of the model's figure
    scale = {"transformers": 0.6, "llamacpp": 1.2}
    truth = {(p.config["quant"], p.config["batch_cap"]): p.rps * scale[p.config["engine"]]
             for p in strategy.predictions}
    study = drive(space, strategy, truth, trials=6)
    first, second = study.trials[0].user_attrs, study.trials[1].user_attrs
    assert first["baseline"] and first["config"]["engine"] == "transformers" and first["config"]["quant"] == "fp32"
    assert second["engine_default"] and (second["config"]["engine"], second["config"]["quant"]) == ("llamacpp", "Q4_1")
    for t in study.trials[2:]:  # calibrated by its own engine's measured ratio
        e = t.user_attrs["config"]["engine"]
        assert t.user_attrs["predicted_calibrated_requests_per_s"] == pytest.approx(
            t.user_attrs["predicted_requests_per_s"] * scale[e], rel=1e-6)
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))  # the simulated profiles' calibration histories
    report = strategy.report(study)
    assert report["n_not_predicted_not_measured"] == len(drafts) and report["left_out"][0]["measured"] == 0
    assert report["strategy_why"] == "--strategy predict"


def test_kv_fractions_the_model_sees_no_effect_of_are_measured_once(monkeypatch, tmp_path) -> None:
    """tests/data/tiny_space.yaml on simulated profiles: every KV fraction of a (weight type, batch cap) admits every
    request, so each is predicted the same capacity. The engine serving each at its prediction, the search measures
    no (weight type, batch cap) twice -- its twins' chance to beat the best would be a coin flip on noise -- and the
    answer counts the twins of every measured one."""
    space = load_space(REPO / "tests" / "data" / "tiny_space.yaml")
    strategy = SimulatedAcrossEngines(pool)
    strategy.prepare(context(space), time_left_s=None)
    by_kind: dict[tuple[str, int], set[float]] = {}
    for p in strategy.predictions:
        by_kind.setdefault((p.config["quant"], p.config["batch_cap"]), set()).add(p.rps)
    assert all(len(rates) == 1 for rates in by_kind.values()) and len(strategy.predictions) > len(by_kind)
    truth = {k: next(iter(rates)) for k, rates in by_kind.items()}
    study = drive(space, strategy, truth)
    got = measured_configs(study)
    assert len(got) == len(set(got)) >= 2
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    report = strategy.report(study)
    assert report["n_shared_with_measured"] == sum(
        (p.config["quant"], p.config["batch_cap"]) in got for p in strategy.predictions) - len(got)


UNPROFILED = "endpoint"  # a server tuner did not launch: nothing to profile (its server knobs are out of reach)


@pytest.fixture(scope="module")
def endpoint_url(tmp_path_factory):
    """A real llama-server (one slot) that the endpoint engine reaches over its OpenAI API: the engine without an
    engine profile, now that every launched engine has one."""
    from tests.conftest import start_llama_server, stop_server

    proc, url = start_llama_server(tmp_path_factory.mktemp("llama") / "server.log", slots=1)
    yield url
    stop_server(proc)


def test_auto_predicts_when_every_engine_is_profiled_and_measures_otherwise_saying_why() -> None:
    from tuner.cli.search import STRATEGIES, choose_strategy
    from tuner.engines.registry import names
    from tuner.errors import TunerError

    assert UNPROFILED in names(profiled=False)
    assert STRATEGIES[0] == "auto"
    profiled, other = names(profiled=True)[0], UNPROFILED
    ran, why = choose_strategy("auto", [profiled])
    assert ran == "predict" and why.startswith("--strategy auto: every engine of the space") and profiled in why
    ran, why = choose_strategy("auto", [other])
    assert ran == "measure" and f"engine {other} has no engine profile yet" in why
    ran, why = choose_strategy("auto", [profiled, other])  # across engines: predicted only when all are profiled
    assert ran == "measure" and f"engine {other} has" in why and f"{profiled} has" not in why
    assert choose_strategy("measure", [profiled]) == ("measure", "--strategy measure")
    assert choose_strategy("predict", [profiled]) == ("predict", "--strategy predict")
    with pytest.raises(TunerError, match=f"--strategy predict with engine {profiled},{other}: predictions need"):
        choose_strategy("predict", [profiled, other])


def test_predict_strategy_on_another_engine_is_one_line(endpoint_url, tmp_path) -> None:
    engine = UNPROFILED
    proc = run_tuner("search", "--model", "smollm2-135m", "--strategy", "predict", "--latency-target", "1s",
                     "--no-quality", "--space", str(REPO / "search_spaces" / "endpoint.yaml"), "--endpoint",
                     endpoint_url, "--results-dir", str(tmp_path / "r"))
    from tuner.engines.registry import names, spoken

    assert_one_line_error(proc, f"--strategy predict with engine {engine}",
                          f"expected --engine {spoken(names(profiled=True))}")
    assert not (tmp_path / "r").exists()


def test_auto_on_an_engine_without_a_profile_measures_and_the_answer_says_why(endpoint_url, tmp_path) -> None:
    """No --strategy on an engine without a profile: the measure loop runs (its engine default enqueued by the
    measure loop's start-up; --timeout ends it before a trial starts), the CLI says so when it starts and in the
    answer, and recommendation.json keeps it."""
    engine = UNPROFILED
    proc = run_tuner("search", "--model", "smollm2-135m", "--latency-target", "1s", "--no-quality", "--quiet",
                     "--space", str(REPO / "search_spaces" / "endpoint.yaml"), "--endpoint", endpoint_url,
                     "--timeout", "0.01s",
                     "--results-dir", str(tmp_path), "--study", "auto")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads((tmp_path / "auto" / "recommendation.json").read_text())
    assert rec["strategy"] == "measure" and "n_predicted" not in rec
    assert rec["strategy_why"].startswith(f"--strategy auto: engine {engine} has no engine profile yet")
    assert proc.stdout.splitlines().count(f"strategy: measure ({rec['strategy_why']})") == 2  # at the start, answer


# ------------------------------------------------------------------------------ a real search --- #
def test_llamacpp_predict_search_measures_fewer_than_it_predicts(tmp_path) -> None:
    """A real `tuner search` on llama-server, no --strategy: auto predicts (llama.cpp has an engine profile) and says
    so; every configuration of the space predicted from this host's profiles, the engine default measured first,
    fewer measured than predicted, the pick a measured one, each measured configuration's predicted capacity
    recorded beside its measured one. Two trials: the engine default and the first prediction-chosen one (a third
    only repeated the second's path)."""
    import optuna

    proc = run_tuner("search", "--model", "smollm2-135m", "--engine", "llamacpp", "--space", str(SPACE),
                     "--results-dir", str(tmp_path), "--study", "pred", "--seed", "0",
                     "--quiet", "--probe-requests", "8:12", "--max-probes", "2", "--latency-target", "60s",
                     "--latency-metric", "e2e:p50", "--trials", "2", "--no-quality", "--confirm", "0",
                     timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "pred" / "recommendation.json").read_text())
    assert rec["strategy"] == "predict" and rec["n_predicted"] == 6 and 1 <= rec["n_measured"] < rec["n_predicted"]
    assert rec["strategy_why"].startswith("--strategy auto: every engine of the space (llamacpp) has an engine profile")
    assert f"strategy: predict ({rec['strategy_why']})" in proc.stdout.splitlines()
    study = optuna.load_study(study_name="pred", storage=f"sqlite:///{tmp_path / 'tuner.db'}")
    first = study.trials[0].user_attrs
    assert first["baseline"] and (first["config"]["quant"], first["config"]["batch_cap"]) == ("Q4_1", 1)
    by_trial = {m["trial"]: m for m in rec["measured"]}
    for t in study.trials:
        if t.state.name == "COMPLETE":
            m = by_trial[t.number]
            assert m["predicted_requests_per_s"] == t.user_attrs["predicted_requests_per_s"] > 0
            assert m["requests_per_s"] == t.user_attrs["capacity"]["requests_per_s"]
    r = rec["recommendation"]
    assert r["trial"] in by_trial and r["predicted_requests_per_s"] == by_trial[r["trial"]]["predicted_requests_per_s"]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("predicted "))
    assert f"predicted 6 configurations, measured {rec['n_measured']}; model error over this search" in line
    for m in rec["measured"]:  # one line per measured configuration, each figure labelled
        said = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"  trial {m['trial']} "))
        assert f"predicted {m['predicted_requests_per_s']:.3g} req/s" in said
        assert f"measured {m['requests_per_s']:.3g} req/s" in said
    print(line, rec["prediction_cost"], [(m["trial"], m["predicted_requests_per_s"], m["requests_per_s"],
                                          m["signed_error"]) for m in rec["measured"]])


def test_a_format_is_described_by_its_own_engine_fields() -> None:
    """A vLLM or transformers format names no llama.cpp knob it does not have (kv_type, threads, ubatch at their
    defaults); llama.cpp's name its format fields always; any field away from its default is named."""
    assert st.describe_format(st.format_of({"engine": "vllm", "quant": "bf16"})) == "quant=bf16 on vllm"
    assert st.describe_format(st.format_of({"engine": "transformers", "quant": "fp32"})) == "quant=fp32 on transformers"
    assert (st.describe_format(st.format_of({"engine": "vllm", "quant": "bf16", "batched_tokens": 512}))
            == "quant=bf16 batched_tokens=512 on vllm")
    assert (st.describe_format(st.format_of({"engine": "llamacpp", "quant": "Q8_0", "threads": 1}))
            == "quant=Q8_0 kv_type=auto threads=1 ubatch=0 on llamacpp")
