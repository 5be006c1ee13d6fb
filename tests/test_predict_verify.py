"""`--strategy predict` verifies a tail SLO with one long probe at the predicted capacity (the real capacity search
on a simulated engine, virtual time), carries its plan to the trial's bench job, and its answer says what the model
got wrong, what was verified at which n, what was extrapolated, and the closest configuration when none meets."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.test_predict_strategy import RAW, SPACE, SimulatedProfiles, context, fixed, pool
from tuner.measure.capacity import CapacityOptions, probe_requests_for
from tuner.measure.workload import Request
from tuner.predict import choose
from tuner.predict import strategy as st
from tuner.predict.estimate import simulated_capacity
from tuner.predict.simulate import StepModel
from tuner.predict.verify import verification_plan
from tuner.search.space import load_space
from tuner.slo import SLO, parse_slo

TRUTH = StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, decode_per_context_token_s=2e-6,
                  prefill_base_s=0.003, prefill_per_token_s=1e-4, noise_sigma=0.15)
P99 = SLO(bounds=tuple(parse_slo("ttft:p99<300ms")))


def pool_of(n: int, out: tuple[int, int] = (32, 64)) -> list[Request]:
    rng = random.Random(1)
    return [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(*out), None) for i in range(n)]


def planned(plan: dict[str, Any]) -> CapacityOptions:
    return CapacityOptions(slo=P99, **{k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()})


def test_a_p99_slo_is_verified_by_one_long_probe_at_the_predicted_capacity_and_one_above() -> None:
    """The blind bracket (5 probes sized for p99 over 5 probes, an unlimited budget) finds the capacity after
    thousands of requests; started at that capacity, the verification meets there in one probe of at least 299
    requests (505: p99 at 95% over 2 probes x 2 looks) and misses in the one above, at a fraction of the cost."""
    blind = CapacityOptions(slo=P99, probe_requests=probe_requests_for(P99, 5, None), max_requests=10_000,
                            max_wall_s=10_000.0)
    pool = pool_of(blind.pool_size(4, 1))
    found = simulated_capacity(TRUTH, 4, pool, blind, 2048, 100)
    assert found["verdict"] == "meets" and found["cost"]["probes"] >= 4
    plan, note = verification_plan(P99, found["requests_per_s"], 600.0, 10_000.0)
    assert note is None and plan["max_probes"] == 2 and plan["probe_requests"][0] >= 299
    got = simulated_capacity(TRUTH, 4, pool, planned(plan), 2048, 100)
    probes = [(p["rate_rps"], p["n"], p["verdict"]) for p in got["probes"]]
    assert probes[0][0] == found["requests_per_s"] and probes[0][2] == "meets"  # at the prediction ...
    assert probes[0][1] >= plan["probe_requests"][0] >= 299  # ... one long probe (505, pooled to 1010 if undecided)
    assert len(probes) == 2 and probes[1][0] > probes[0][0] and probes[1][2] == "misses"  # and one above it
    assert got["requests_per_s"] == found["requests_per_s"] and got["method"]["start_rps"] == plan["start_rps"]
    assert got["cost"]["requests"] < found["cost"]["requests"] / 3
    assert got["cost"]["wall_s"] < found["cost"]["wall_s"] / 3


def test_a_verification_that_the_trial_timeout_cannot_hold_says_so() -> None:
    plan, note = verification_plan(P99, 0.5, 600.0, 900.0)
    assert plan["max_wall_s"] == pytest.approx(720.0)  # within 80% of the trial's time limit
    assert note and "--trial-timeout 900 s allows 720" in note
    need_s = float(note.split("needs about ")[1].split(" s ")[0])
    assert need_s >= 2 * 505 / 0.5  # two probes' first passes arriving at 0.5 req/s, at the least
    assert verification_plan(SLO(bounds=tuple(parse_slo("ttft:p50<300ms"))), 0.5, 600.0, 900.0) == (None, None)
    assert verification_plan(P99, 0.0, 600.0, 900.0) == (None, None)  # nothing predicted to meet: the blind bracket


def test_the_plan_reaches_the_trials_bench_job(tmp_path: Path) -> None:
    """The trial's `capacity_plan` (JSON in Optuna's storage: lists) becomes the bench job's capacity settings, and
    survives the job file the child reads."""
    from tuner.config import TrialConfig
    from tuner.job import read_job
    from tuner.search.objective import bench_job

    ctx = context(load_space(SPACE))
    plan, _ = verification_plan(P99, 0.7, 600.0, 3600.0)
    plan = json.loads(json.dumps(plan))
    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q4_1")
    job = bench_job(config, ctx, tmp_path / "b.json", tmp_path / "s.log", plan)
    from tuner.job import write_job

    write_job(tmp_path / "job.json", job)
    cap = read_job(tmp_path / "job.json").capacity
    assert (cap.start_rps, cap.max_probes, cap.probe_requests) == (0.7, 2, tuple(plan["probe_requests"]))
    assert cap.max_wall_s == plan["max_wall_s"] and cap.slo == ctx.slo  # the study's own SLO, untouched
    assert bench_job(config, ctx, tmp_path / "b.json", tmp_path / "s.log").capacity.start_rps is None


def drive(strategy: st.PredictStrategy, truth: dict[tuple[str, int], float], ttft_p99_ms: float,
          trials: int = 3) -> Any:
    """Trials recorded as tuner.search.objective records them: each capacity a tail verification would measure
    (its planned first probe at the planned rate, n = the plan's first pass; `truth` the capacity found, 0 when the
    SLO is missed with ttft p99 `ttft_p99_ms`)."""
    import optuna

    from tuner.search.space import suggest_config

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = load_space(SPACE)
    study = optuna.create_study(directions=["maximize", "maximize"])

    def objective(trial: Any) -> tuple[float, float]:
        c = suggest_config(trial, space, "smollm2-135m", "cpu").to_dict()
        plan = trial.user_attrs["capacity_plan"]
        rps = truth[(c["quant"], c["batch_cap"])]
        verdict = "meets" if rps else "misses"
        probes = [{"rate_rps": plan["start_rps"], "n": plan["probe_requests"][0], "verdict": verdict,
                   "ttft_ms": {"p99": ttft_p99_ms * (1 + c["batch_cap"] / 10)}}]
        trial.set_user_attr("config", c)
        trial.set_user_attr("capacity", {"requests_per_s": rps, "requests_per_s_ci": [rps, rps], "verdict": verdict,
                                         "probes": probes})
        trial.set_user_attr("constraints", [0.0 if rps else 1.0])
        return rps, 0.0

    for _ in range(trials):
        if not strategy.enqueue_next(study, space):
            break
        study.optimize(objective, n_trials=1)
    return study


def tail_strategy(slo: SLO) -> st.PredictStrategy:
    strategy = st.PredictStrategy(lambda c, o: [])
    strategy.predictions = fixed(load_space(SPACE), RAW)
    strategy.slo, strategy.timeouts_s = slo, (600.0, 7200.0)
    return strategy


def test_the_answer_says_what_was_verified_at_which_n_and_where_the_model_was_off(monkeypatch, tmp_path) -> None:
    """The engine serves half of every prediction: the baseline's measured capacity falls outside its band and the
    answer says by how much; every trial starts its long probe at its calibrated prediction, and the answer says
    at which rate and n it was verified."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    strategy = tail_strategy(P99)
    study = drive(strategy, {k: v / 2 for k, v in RAW.items()}, 200.0)
    first, second = study.trials[0].user_attrs, study.trials[1].user_attrs
    assert first["capacity_plan"]["start_rps"] == RAW[("Q4_1", 1)]  # nothing measured yet: the raw prediction
    assert second["capacity_plan"]["start_rps"] == pytest.approx(second["predicted_calibrated_requests_per_s"])
    report = strategy.report(study)
    notes = report["notes"]
    off = [n for n in notes if n.startswith("trial 0: the model was off by +100%, outside its band")]
    assert off and "predicted 1 req/s, band [0.95, 1.05]; measured 0.5 req/s" in off[0]
    said = next(n for n in notes if n.startswith("trial 0: ttft:p99<300ms verified on the real engine"))
    assert "n=505 at 1 req/s (the predicted capacity): meets" in said
    assert report["measured"][0]["within_band"] is False
    assert report["measured"][0]["verification"]["probes"] == [{"rate_rps": 1.0, "n": 505, "verdict": "meets"}]
    assert not [n for n in notes if n.startswith("no configuration meets")]
    from tuner.cli.search import predict_lines

    assert f"  note: {off[0]}" in predict_lines(report)  # the CLI prints every one


def test_when_no_configuration_meets_the_answer_names_the_closest(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    strategy = tail_strategy(P99)
    study = drive(strategy, {k: 0.0 for k in RAW}, 400.0)
    notes = strategy.report(study)["notes"]
    closest = [n for n in notes if n.startswith("no configuration meets ttft:p99<300ms here")]
    assert closest and "(none of the 3 measured was shown to)" in closest[0]
    # the baseline, batch cap 1, has the lowest ttft p99 of the three (400 x 1.1)
    assert "the closest is trial 0 (quant=Q4_1 batch_cap=1 kv_type=auto) at 440 ms (ttft:p99 at 1 req/s" in closest[0]
    assert "n=505" in closest[0]


def test_a_p50_slo_keeps_the_blind_bracket() -> None:
    strategy = tail_strategy(SLO(bounds=tuple(parse_slo("ttft:p50<300ms"))))
    study = optuna_study_with_one_enqueued(strategy)
    assert "capacity_plan" not in study.trials[0].user_attrs


def optuna_study_with_one_enqueued(strategy: st.PredictStrategy) -> Any:
    import optuna

    study = optuna.create_study(directions=["maximize", "maximize"])
    strategy.enqueue_next(study, load_space(SPACE))
    return study


def long_output_pool(config: Any, options: Any) -> list[Any]:
    return pool_of(options.pool_size(config.batch_cap, 2), out=(150, 200))


def test_configurations_past_the_profile_are_extrapolated_in_the_strategys_answer() -> None:
    """Outputs of up to 200 tokens on prompts of up to 200: contexts past the profile's 352 per sequence. Every
    prediction says so, the answer's top predictions carry it, and a note counts them (the default workload, inside
    the profile, says nothing of it: test_predict_strategy)."""
    space = load_space(SPACE)
    strategy = SimulatedProfiles(long_output_pool)
    strategy.prepare(context(space), time_left_s=0.0)
    assert strategy.predictions and all(p.extrapolated for p in strategy.predictions)
    said = strategy.predictions[0].extrapolated[0]
    assert "context per sequence (prompt + output tokens; outputs up to 200), the profile measured up to 352" in said
    report = strategy.report_prediction()
    assert all(t["predicted_extrapolated"] for t in report["top_predicted"])
    assert any(n.startswith("3 configuration(s) predicted past what their profile measured") for n in report["notes"])


class ShortContextProfiles(SimulatedProfiles):
    """Profiles that measured contexts of up to 120 tokens per sequence (as a profile with short prompts would)."""

    def measure(self, members: list[choose.Prediction], cap: int) -> dict[str, Any]:
        prof = super().measure(members, cap)
        return {**prof, "ranges": {**prof["ranges"], "max_context_per_seq": 120}}


def test_a_configuration_twice_past_its_profile_is_ranked_as_its_computed_band_ranks_it() -> None:
    """Contexts of up to 264 tokens on profiles that measured 120: 2.2x past them, so every band is widened by more
    than its rate and surely reaches 0. The choosing rule ranks such a configuration without computing its band,
    and its chance is the one its computed band then gives, to the last bit."""
    strategy = ShortContextProfiles(pool)
    strategy.prepare(context(load_space(SPACE)), time_left_s=None)
    waiting = [p for p in strategy.predictions if not p.banded]
    assert waiting and all(p.extrapolated for p in waiting)
    best = 0.9 * max(p.rps for p in strategy.predictions)
    ranked = {id(p): c for c, p in choose.ranking(waiting, set(), 1.0, choose.PRIOR_SIGMA, best, None, strategy.assumed_band)}
    strategy.band(waiting)
    assert all(p.band[0] == 0.0 for p in waiting)
    assert {id(p): choose.chance_to_beat(p, 1.0, choose.PRIOR_SIGMA, best) for p in waiting} == ranked


def test_the_strategys_bands_carry_the_profiles_calibration_history(monkeypatch, tmp_path) -> None:
    """A profile whose earlier search measured half its prediction: the next search's bands reach down to it (the
    fit and the engine's speed drift alone reach 1 / 1.2 of it: test_predict_estimate)."""
    from tuner.predict import calibration

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    calibration.record("sim-Q4_1", {"ratio": 0.5, "error": 1.0, "within_band": False, "contradicts": True})
    later = SimulatedProfiles(lambda c, o: pool_of(o.pool_size(c.batch_cap, 2)))
    later.prepare(context(load_space(SPACE)), time_left_s=0.0)
    banded = [p for p in later.predictions if p.banded]  # the engine default's (the rest: when they could be chosen)
    assert banded and all(p.band[0] <= 0.5 * p.rps for p in banded)
    assert all(later.assumed_band(p)[0] <= 0.5 * p.rps for p in later.predictions if not p.banded)
    assert any("1 of 1 capacities measured for predictions from this profile fell outside their band" in n
               for n in later.notes)


class ProfiledElsewhere(SimulatedProfiles):
    """The profile measured now says why (another host's profile of this format was not reused)."""

    def measure(self, members: list[choose.Prediction], cap: int) -> dict[str, Any]:
        got = super().measure(members, cap)
        return dict(got, notes=["a profile of this model and format from another host (x.json, measured then) is "
                                "not reused here: measured again"])


def test_a_profile_measured_again_says_why_in_the_strategys_answer() -> None:
    strategy = ProfiledElsewhere(lambda c, o: pool_of(o.pool_size(c.batch_cap, 2)))
    strategy.prepare(context(load_space(SPACE)), time_left_s=0.0)
    notes = strategy.report_prediction()["notes"]
    assert any(n.startswith("profile of quant=Q4_1") and "from another host" in n and "measured again" in n
               for n in notes)


def test_a_tail_slo_is_predicted_without_the_capacity_budget() -> None:
    """ttft:p99 at the study's settings (probes sized for 5 probes: 597 first, within 600 requests and 600 s): the
    simulated blind bracket stops after one probe and predicts nothing meets; the strategy's simulations lift the
    budget (virtual time) and predict the capacity the same rules find, which the verification then starts at."""
    strategy = st.PredictStrategy(lambda c, o: [])
    study = CapacityOptions(slo=P99, probe_requests=probe_requests_for(P99, 5, None))
    lifted = strategy.simulated(study)
    assert (lifted.probe_requests, lifted.max_probes, lifted.slo) == (study.probe_requests, 5, P99)
    pool = pool_of(study.pool_size(4, 1))
    cut = simulated_capacity(TRUTH, 4, pool, study, 2048, 100)
    free = simulated_capacity(TRUTH, 4, pool, lifted, 2048, 100)
    assert cut["requests_per_s"] == 0 and len(cut["probes"]) == 1
    assert free["verdict"] == "meets" and free["requests_per_s"] > 0 and len(free["probes"]) > 1
    p50 = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p50<300ms"))))
    assert strategy.simulated(p50) is p50  # a median: the study's own budget


def test_the_pick_of_a_tail_slo_is_confirmed_at_its_figure_the_way_its_trial_was_verified(monkeypatch, tmp_path):
    """--confirm re-measures the pick the way its trial was measured: a tail verification, now started at the
    trial's measured capacity (the child `tuner bench` replaced: only the settings it is given are checked)."""
    import optuna

    import tuner.search.confirm as C

    plan, _ = verification_plan(P99, 0.9, 600.0, 7200.0)
    cap = {"requests_per_s": 0.8, "requests_per_s_ci": [0.8, 1.2], "verdict": "meets", "probes": []}
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.add_trial(optuna.trial.create_trial(
        values=[0.8, 0.0], state=optuna.trial.TrialState.COMPLETE,
        user_attrs={"config": {"model": "smollm2-135m", "engine": "llamacpp", "quant": "Q4_1", "batch_cap": 4},
                    "capacity": cap, "constraints": [-0.1, 0.0], "capacity_plan": plan}))
    given = []

    def measure(config, ctx, trial_dir, plan=None):
        given.append(plan)
        return {"status": "ok", "metrics": {"capacity": cap}}

    monkeypatch.setattr(C, "measure", measure)
    ctx = context(load_space(SPACE))
    ctx.study_dir = tmp_path
    C.confirm_best(study, ctx, 1, log=lambda s: None)
    assert given == [dict(plan, start_rps=0.8)]
