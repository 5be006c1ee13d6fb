"""Prediction from a profile: a profile taken (by the real protocol) on a simulated engine with a known step model
predicts the capacity that the real capacity search finds on that engine; out-of-range configurations say so."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from tuner.config import TrialConfig
from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import Request
from tuner.predict import waves
from tuner.predict.estimate import predict, simulated_capacity
from tuner.predict.fit import fit_step_model
from tuner.predict.simulate import SimulatedEngine, StepModel
from tuner.slo import SLO, parse_slo

TRUTH = StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, decode_per_context_token_s=2e-6,
                  prefill_base_s=0.003, prefill_per_token_s=1e-4, noise_sigma=0.15)


def llamacpp(batch_cap: int) -> TrialConfig:
    """A llama.cpp configuration at `batch_cap` (its scheduler limits: llama-server's 2048-token step, no KV limit)."""
    return TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", batch_cap=batch_cap)


@pytest.fixture(scope="module")
def profiled() -> dict[str, Any]:
    engine = SimulatedEngine(TRUTH, 4, seed=5)
    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 4,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0))
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"id": "simulated", "key": {"host": {}, "build": {}}, "fit": fit, "samples": s, "notes": [],
            "ranges": {"max_seqs": 4, "max_context_per_seq": max(waves.DECODE_PROMPTS) + waves.DECODE_TOKENS,
                       "max_prompt_tokens": max(waves.PREFILL_TOKENS)}}


def workload(options: CapacityOptions, cap: int) -> list[Request]:
    rng = random.Random(1)
    return [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(32, 64), None)
            for i in range(options.pool_size(cap, 2))]


def test_the_prediction_matches_the_search_on_the_profiled_engine(profiled: dict[str, Any]) -> None:
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    got = predict(profiled, llamacpp(4), pool, options, replicates=4)
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
    inside = predict(profiled, llamacpp(4), pool, options, replicates=2)
    beyond = predict(profiled, llamacpp(8), pool, options, replicates=2)
    assert any(n.startswith("extrapolated: 8 sequences, the profile measured up to 4") for n in beyond["notes"])
    width = [c["capacity"]["band"][1] - c["capacity"]["band"][0] for c in (inside, beyond)]
    assert width[1] >= width[0] + beyond["capacity"]["requests_per_s"] * 0.9  # widened by (8/4 - 1) x the rate


def test_a_batch_past_the_long_prompts_of_its_profile_says_its_slope_is_held_and_is_not_extrapolated() -> None:
    """A profile that sent long prompts up to 4 sequences of its 8 (vLLM's version-12 protocol does so above 16): a
    prediction at 8 says the context's cost there is the one fitted at 4, without calling itself extrapolated (the
    batch and the context were each measured); at 4, nothing said."""
    protocol = waves.Protocol(prefill_repeats=2, one_wave_from=2, long_waves_to=4)
    engine = SimulatedEngine(TRUTH, 8, seed=5)
    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 8,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0), protocol=protocol)
    assert max(d["seqs"] for d in s["decode"] if d["prompt_tokens"] == max(waves.DECODE_PROMPTS)) == 4
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    profile = {"id": "simulated", "key": {"host": {}, "build": {}}, "fit": fit, "samples": s, "notes": [],
               "batch_cap": 8, "protocol": protocol.__dict__,
               "ranges": {"max_seqs": 8, "max_context_per_seq": max(waves.DECODE_PROMPTS) + waves.DECODE_TOKENS,
                          "max_prompt_tokens": max(waves.PREFILL_TOKENS)}}
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 8)
    held = "above 4 sequences a step's cost per context token is the one fitted at 4"
    wide, narrow = (predict(profile, llamacpp(cap), pool, options, replicates=1) for cap in (8, 4))
    assert any(n.startswith(held) for n in wide["notes"]) and wide["capacity"]["extrapolated"] == []
    assert not any(n.startswith(held) for n in narrow["notes"])


def test_the_band_covers_the_engine_running_slower_than_its_profile(profiled: dict[str, Any]) -> None:
    """The profiled engine, 18% slower by the time it serves (what a shared host's engine moved in a test run): its
    real capacity falls below a band of the fit's uncertainty alone, and inside the band that carries the engine's
    speed (each within the capacity search's own resolution)."""
    from tuner.predict.estimate import SPEED_DRIFT, scaled

    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    slower = statistics.median(simulated_capacity(scaled(TRUTH, 1.18), 4, pool, options, 2048, seed)["requests_per_s"]
                               for seed in range(100, 103))
    fit_only = predict(profiled, llamacpp(4), pool, options, replicates=2, speed_drift=0)
    carried = predict(profiled, llamacpp(4), pool, options, replicates=2)
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
    before = predict(profiled, llamacpp(4), pool, options, replicates=2,
                     history=calibration.read_history("simulated"))
    assert before["calibration"]["history"]["n"] == 0
    rec = calibration.compare(dict(before, config=config, workload={"input_len": [64, 200]}), bench)
    assert rec["within_band"] is False and rec["error"] > 0.2  # predicted well above what was measured
    assert rec["contradicts"] == (rec["measured_ci"][1] < rec["band"][0])
    calibration.record("simulated", rec)
    after = predict(profiled, llamacpp(4), pool, options, replicates=2,
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


def test_an_extrapolations_error_widens_the_bands_past_the_profile_only(profiled: dict[str, Any]) -> None:
    """A record of a configuration measured past its profile's sequences (cap 8 from a profile at 4, the engine
    serving a third of the prediction there) widens the next predictions past the profile, not those within: the
    band at cap 4 is the band without any history, until a record within is kept."""
    from tuner.predict import calibration

    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 8)

    def rec(cap: int, ratio: float) -> dict[str, Any]:
        config = {"model": "m", "engine": "llamacpp", "quant": "Q8_0", "batch_cap": cap}
        return calibration.entry("simulated", config, ["ttft:p90<300ms"], {}, 3.0, [2.7, 3.3],
                                 {"requests_per_s": 3.0 * ratio, "requests_per_s_ci": [3.0 * ratio] * 2}, "test")

    past = [rec(8, 1 / 3)]
    clean = predict(profiled, llamacpp(4), pool, options, replicates=2)
    within = predict(profiled, llamacpp(4), pool, options, replicates=2, history=past)
    assert within["calibration"]["history"]["n"] == 0
    assert within["capacity"]["band"] == clean["capacity"]["band"]
    beyond = predict(profiled, llamacpp(8), pool, options, replicates=2, history=past)
    assert beyond["calibration"]["history"]["n"] == 1
    assert beyond["capacity"]["band"][0] <= beyond["capacity"]["requests_per_s"] / 3
    kept = predict(profiled, llamacpp(4), pool, options, replicates=2, history=past + [rec(4, 0.5)])
    assert kept["calibration"]["history"]["n"] == 1
    assert kept["capacity"]["band"][0] == pytest.approx(0.5 * kept["capacity"]["requests_per_s"])
    assert kept["capacity"]["band"][0] < clean["capacity"]["band"][0]


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
        got = predict(profiled, llamacpp(4), pool, options, replicates=1)
        texts.append((got, format_prediction(dict(got, config=config, predict_s=0.1, predict_cpu_s=0.1))))
    (beyond, text), (inside, plain) = texts
    said = beyond["capacity"]["extrapolated"]
    assert said and "context per sequence (prompt + output tokens; outputs up to 200)" in said[0]
    assert "the profile measured up to 352" in said[0]
    assert "EXTRAPOLATED past the profile" in text and said[0] in text
    assert inside["capacity"]["extrapolated"] == [] and "EXTRAPOLATED" not in plain


def test_a_repeated_search_is_a_copy_and_another_pool_is_simulated_anew(monkeypatch) -> None:
    """The search strategy simulates each point, then its band with the point again: the second is the first's
    figures (nothing simulated), a copy the caller may change; a pool differing in one output length is simulated."""
    from tuner.predict import estimate

    made: list[int] = []

    class Counted(SimulatedEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(estimate, "SimulatedEngine", Counted)
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 2)
    first = simulated_capacity(TRUTH, 2, pool, options, 2048, 7)
    first["notes"].append("changed by the caller")
    again = simulated_capacity(TRUTH, 2, pool, options, 2048, 7)
    assert len(made) == 1 and "changed by the caller" not in again["notes"]
    assert again["requests_per_s"] == first["requests_per_s"] and again["probes"] == first["probes"]
    other = list(pool)
    other[5] = Request(other[5].index, "", other[5].prompt_ids, other[5].max_tokens + 1, None)
    simulated_capacity(TRUTH, 2, other, options, 2048, 7)
    simulated_capacity(TRUTH, 2, pool, options, 2048, 8)  # another noise seed
    assert len(made) == 3
    pool[5] = Request(pool[5].index, "", pool[5].prompt_ids, pool[5].max_tokens + 2, None)  # changed in place
    simulated_capacity(TRUTH, 2, pool, options, 2048, 7)
    assert len(made) == 4


def test_the_band_without_the_curve_is_the_band_with_it(profiled: dict[str, Any]) -> None:
    """The search strategy reads the capacity and its band only: `curve=False` leaves the latency-load curve out and
    changes neither."""
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    pool = workload(options, 4)
    config = llamacpp(4)
    with_curve = predict(profiled, config, pool, options, replicates=2)
    without = predict(profiled, config, pool, options, replicates=2, curve=False)
    assert without["curve"] == [] and len(with_curve["curve"]) == 5
    assert without["capacity"] == with_curve["capacity"]


def test_the_capacity_pool_has_the_bench_prompts_token_ids_without_their_text() -> None:
    """`tuner predict` and the search strategy simulate the pool `tuner bench --capacity` sends: the same requests
    (token ids, output lengths, order) with the text left out (the simulated engine never reads it)."""
    from tuner.cli.predict import capacity_pool
    from tuner.config import TrialConfig
    from tuner.measure.bench import bench_prompts
    from tuner.measure.workload import WorkloadSpec

    class Chars:  # a tokenizer of characters: enough to build prompts from the corpus
        def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

        def decode(self, ids: Any, **_: Any) -> str:
            return "".join(chr(i) for i in ids)

    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", batch_cap=4)
    spec = WorkloadSpec(requests=40, input_len=(16, 64), output_len=(8, 16), seed=3)
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<300ms"))))
    sent = bench_prompts(config, spec, Chars(), options)[0]
    pool = capacity_pool(config, spec, options, Chars())
    assert [(r.prompt_ids, r.max_tokens) for r in pool] == [(r.prompt_ids, r.max_tokens) for r in sent]
    assert len(pool) == options.pool_size(4, 2) and all(r.prompt == "" for r in pool)
    assert all(r.prompt for r in sent)
