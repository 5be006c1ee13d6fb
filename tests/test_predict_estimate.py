"""Prediction from a profile: a profile taken (by the real protocol) on a simulated engine with a known step model
predicts the capacity that the real capacity search finds on that engine; out-of-range configurations say so."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace
from typing import Any

import pytest

from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import Request
from tuner.predict import profile as prof
from tuner.predict.estimate import predict, simulated_capacity
from tuner.predict.fit import fit_step_model
from tuner.predict.simulate import SimulatedEngine, StepModel
from tuner.slo import SLO, parse_slo

TRUTH = StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, decode_per_context_token_s=2e-6,
                  prefill_base_s=0.003, prefill_per_token_s=1e-4, noise_sigma=0.15)


@pytest.fixture(scope="module")
def profiled() -> dict[str, Any]:
    engine = SimulatedEngine(TRUTH, 4, seed=5)
    s = prof.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 4,
                             list(prof.PREFILL_TOKENS), list(prof.DECODE_PROMPTS), random.Random(0))
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"id": "simulated", "key": {"host": {}, "build": {}}, "fit": fit, "samples": s, "notes": [],
            "ranges": {"max_seqs": 4, "max_context_per_seq": max(prof.DECODE_PROMPTS) + prof.DECODE_TOKENS,
                       "max_prompt_tokens": max(prof.PREFILL_TOKENS)}}


def workload(options: CapacityOptions, cap: int) -> list[Request]:
    rng = random.Random(1)
    return [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(32, 64), None)
            for i in range(options.pool_size(cap, 2))]


def test_the_prediction_matches_the_search_on_the_profiled_engine(profiled: dict[str, Any]) -> None:
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    got = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=4)
    measured = statistics.median(simulated_capacity(TRUTH, 4, pool, options, 2048, seed)["requests_per_s"]
                                 for seed in range(100, 105))
    cap = got["capacity"]
    assert got["predicted"] is True and cap["verdict"] == "meets"
    assert cap["requests_per_s"] == pytest.approx(measured, rel=options.tolerance)  # the search's own resolution
    lo, hi = cap["band"]
    assert lo <= cap["requests_per_s"] <= hi and lo <= measured * (1 + options.tolerance)
    assert hi >= measured * (1 - options.tolerance)
    assert not [n for n in got["notes"] if n.startswith("extrapolated")]  # inside the profiled ranges
    rates = [p["rate_rps"] for p in got["curve"]]
    p90 = [p["ttft_ms"]["p90"] for p in got["curve"]]
    assert rates == sorted(rates) and p90[-1] > p90[0]  # latency grows with load


def test_a_batch_cap_past_the_profile_is_extrapolated_with_a_wider_band(profiled: dict[str, Any]) -> None:
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 8)
    inside = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=2)
    beyond = predict(profiled, SimpleNamespace(batch_cap=8, ubatch=0), pool, options, replicates=2)
    assert any(n.startswith("extrapolated: 8 sequences, the profile measured up to 4") for n in beyond["notes"])
    width = [c["capacity"]["band"][1] - c["capacity"]["band"][0] for c in (inside, beyond)]
    assert width[1] >= width[0] + beyond["capacity"]["requests_per_s"] * 0.9  # widened by (8/4 - 1) x the rate


def test_the_band_covers_the_engine_running_slower_than_its_profile(profiled: dict[str, Any]) -> None:
    """The profiled engine, 18% slower by the time it serves (what a shared host's engine moved in a test run): its
    real capacity falls below a band of the fit's uncertainty alone, and inside the band that carries the engine's
    speed (each within the capacity search's own resolution)."""
    from tuner.predict.estimate import SPEED_DRIFT, scaled

    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    slower = statistics.median(simulated_capacity(scaled(TRUTH, 1.18), 4, pool, options, 2048, seed)["requests_per_s"]
                               for seed in range(100, 103))
    fit_only = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=2, speed_drift=0)
    carried = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=2)
    assert carried["calibration"]["speed_drift"] == SPEED_DRIFT >= 0.15
    assert fit_only["capacity"]["band"][0] > slower * (1 + options.tolerance)  # missed without the speed term
    lo, hi = carried["capacity"]["band"]
    assert lo <= slower * (1 + options.tolerance) and slower <= hi


def test_a_measured_capacity_outside_the_band_is_recorded_and_later_bands_carry_it(profiled: dict[str, Any],
                                                                                   monkeypatch, tmp_path) -> None:
    """The engine measured 1.6x slower than its profile (past the speed drift the band carries): the comparison
    says the measured capacity fell outside the band and records it; the next prediction from this profile carries
    that error (its band holds the measured capacity) and says how many measured capacities fell outside."""
    from tuner.predict import calibration

    monkeypatch.setattr(calibration, "history_path", lambda pid: tmp_path / f"{pid}.calibration.jsonl")
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    from tuner.predict.estimate import scaled

    config = {"model": "m", "engine": "llamacpp", "quant": "Q8_0", "batch_cap": 4}
    measured = simulated_capacity(scaled(TRUTH, 1.6), 4, pool, options, 2048, 100)  # a real search's record
    bench = {"config": config, "workload": {"input_len": [64, 200]}, "metrics": {"capacity": measured}}
    before = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=2,
                     history=calibration.read_history("simulated"))
    assert before["calibration"]["history"]["n"] == 0
    rec = calibration.compare(dict(before, config=config, workload={"input_len": [64, 200]}), bench)
    assert rec["within_band"] is False and rec["error"] > 0.2  # predicted well above what was measured
    assert rec["contradicts"] == (rec["measured_ci"][1] < rec["band"][0])
    calibration.record("simulated", rec)
    after = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=2,
                    history=calibration.read_history("simulated"))
    lo, hi = after["capacity"]["band"]
    assert lo <= measured["requests_per_s"] <= hi
    assert before["capacity"]["band"][0] > measured["requests_per_s"]
    assert after["calibration"]["history"]["n"] == 1
    assert any(n.startswith("1 of 1 capacities measured for predictions from this profile fell outside their band")
               for n in after["notes"])
    with pytest.raises(Exception, match="the bench measured quant='Q4_0'"):
        calibration.compare(dict(before, config=dict(config), workload={}),
                            dict(bench, config=dict(config, quant="Q4_0")))


def test_an_output_longer_than_profiled_is_extrapolated_in_the_json_and_the_text(profiled: dict[str, Any]) -> None:
    """Outputs of 150-200 tokens on prompts of up to 200: contexts past the 352 per sequence the profile measured.
    `tuner predict`'s JSON lists it under capacity.extrapolated and its text says EXTRAPOLATED; inside, neither."""
    from tuner.cli.predict import format_prediction

    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    rng = random.Random(1)
    long_out = [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(150, 200), None)
                for i in range(options.pool_size(4, 2))]
    config = {"model": "m", "engine": "llamacpp", "quant": "Q8_0", "batch_cap": 4}
    texts = []
    for pool in (long_out, workload(options, 4)):
        got = predict(profiled, SimpleNamespace(batch_cap=4, ubatch=0), pool, options, replicates=1)
        texts.append((got, format_prediction(dict(got, config=config, predict_s=0.1, predict_cpu_s=0.1))))
    (beyond, text), (inside, plain) = texts
    said = beyond["capacity"]["extrapolated"]
    assert said and "context per sequence (prompt + output tokens; outputs up to 200)" in said[0]
    assert "the profile measured up to 352" in said[0]
    assert "EXTRAPOLATED past the profile" in text and said[0] in text
    assert inside["capacity"]["extrapolated"] == [] and "EXTRAPOLATED" not in plain
