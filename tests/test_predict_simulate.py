"""The virtual-time engine simulator against queueing closed forms, and driven end to end by the real capacity search."""

from __future__ import annotations

import math
import statistics
import time

import pytest

from tuner.errors import TunerError
from tuner.measure.capacity import CapacityOptions, CapacitySearch
from tuner.measure.workload import Request, with_arrivals
from tuner.predict.simulate import SimulatedEngine, StepModel
from tuner.slo import SLO, parse_slo


def requests(n: int, prompt_tokens: int = 32, max_tokens: int = 4) -> list[Request]:
    return [Request(i, "x", tuple(range(prompt_tokens)), max_tokens, None) for i in range(n)]


def batch_means(xs: list[float], batches: int) -> tuple[float, float]:
    """Mean and its standard error from `batches` consecutive batch means (the waiting times of a queue are
    correlated; batch means of long batches are nearly independent)."""
    size = len(xs) // batches
    means = [statistics.fmean(xs[i * size:(i + 1) * size]) for i in range(batches)]
    return statistics.fmean(means), statistics.stdev(means) / math.sqrt(batches)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_slot_constant_service_poisson_arrivals_waits_as_md1(rho: float) -> None:
    # one slot, every step 10 ms, 4 tokens per request (a prompt step then 3 decodes): service S = 40 ms, constant
    step_s, tokens = 0.010, 4
    service_s = step_s * tokens
    rate = rho / service_s
    engine = SimulatedEngine(StepModel(decode_base_s=step_s), batch_cap=1)
    load = engine.run(with_arrivals(requests(30_000, max_tokens=tokens), rate, "poisson", 7))
    assert all(r.ok for r in load.results)
    # waiting time in the queue: from the scheduled arrival to the start of service (its first token came one step in)
    waits = [r.ttft_ms / 1e3 - step_s for r in load.results[1000:]]  # the first 1000 from an empty queue left out
    mean, se = batch_means(waits, 29)
    pollaczek_khinchine = rho * service_s / (2 * (1 - rho))  # M/D/1: Wq = rho S / (2 (1 - rho))
    assert abs(mean - pollaczek_khinchine) <= 4 * se, (mean, pollaczek_khinchine, se)
    assert se < 0.1 * pollaczek_khinchine  # the tolerance is tight enough to tell a wrong queue apart


@pytest.mark.parametrize("cap,in_flight", [(1, 1), (4, 4), (4, 6), (8, 10)])
def test_closed_loop_saturates_at_cap_over_step_times_output(cap: int, in_flight: int) -> None:
    step_s, tokens = 0.02, 16
    engine = SimulatedEngine(StepModel(decode_base_s=step_s), batch_cap=cap)
    load = engine.run(requests(40 * cap, max_tokens=tokens), concurrency=in_flight)
    ends = sorted(r.send_s + r.e2e_ms / 1e3 for r in load.results)
    a, b = ends[cap - 1], ends[-in_flight - 1]  # past the first fill, before the drain
    rate = sum(a < e <= b for e in ends) / (b - a)  # completions per second between two completions
    assert rate == pytest.approx(cap / (step_s * tokens), rel=1e-6)
    # every request's gaps are one step each (the batch never waits on anything else)
    assert all(g == pytest.approx(step_s * 1e3) for r in load.results for g in r.itl_ms)


def test_capacity_search_end_to_end_finds_a_capacity_below_saturation() -> None:
    cap, step_s, tokens = 4, 0.02, 16
    saturation = cap / (step_s * tokens)  # 12.5 req/s
    engine = SimulatedEngine(StepModel(decode_base_s=step_s), batch_cap=cap)
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<200ms"))), seed=3)
    pool = requests(options.pool_size(cap), max_tokens=tokens)
    t = time.perf_counter()
    result = CapacitySearch(engine.run, pool, cap, options, clock=engine.clock).search()
    real_s = time.perf_counter() - t
    # the search's own saturation estimate (completions over a window that starts at a completion: lockstep groups
    # of `cap` finishing together make it coarse) lands near the closed form
    assert result["saturation"]["requests_per_s"] == pytest.approx(saturation, rel=0.1)
    assert result["verdict"] == "meets"
    assert 0 < result["requests_per_s"] < saturation
    lo, hi = result["requests_per_s_ci"]
    assert lo == result["requests_per_s"] and lo < hi <= result["saturation"]["requests_per_s"]
    assert result["cost"]["wall_s"] == pytest.approx(engine.clock())  # the search ran on the virtual clock
    assert result["cost"]["wall_s"] > 10 * real_s  # and in much less real time than it simulated


def test_a_seed_decides_a_noisy_run() -> None:
    model = StepModel(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_context_token_s=1e-6,
                      prefill_base_s=0.002, prefill_per_token_s=1e-4, noise_sigma=0.3)

    def serve(seed: int) -> list[float]:
        engine = SimulatedEngine(model, batch_cap=4, seed=seed)
        load = engine.run(with_arrivals(requests(200, max_tokens=8), 20.0, "poisson", 0))
        return [g for r in load.results for g in r.itl_ms]

    assert serve(1) == serve(1)
    assert serve(1) != serve(2)
    gaps = serve(1)
    assert statistics.pstdev(gaps) > 0.1 * statistics.fmean(gaps)  # the noise spreads the step times


def test_should_stop_returns_the_finished_only_and_the_engine_drains() -> None:
    engine = SimulatedEngine(StepModel(decode_base_s=0.01), batch_cap=2)
    seen: list[int] = []

    def stop(finished: list, total: int) -> str | None:
        seen.append(len(finished))
        return "enough" if len(finished) >= 5 else None

    load = engine.run(requests(50, max_tokens=10), concurrency=4, should_stop=stop)
    assert load.stopped_reason == "enough"
    assert len(load.results) == 6 and all(r.ok for r in load.results)  # two finish in the same step as the 5th
    assert load.sent == 8  # 4 at the start, 2 more as each pair finished before the stop
    # the 2 requests still running when it stopped ran on: the next run starts on an idle engine
    stopped_at = max(r.send_s + r.e2e_ms / 1e3 for r in load.results)
    assert engine.clock() > stopped_at
    after = engine.run(requests(1, max_tokens=10), concurrency=1)
    assert after.results[0].ttft_ms == pytest.approx(10.0)  # no queue in front of it


def test_kv_capacity_admits_what_fits_and_fails_what_never_can() -> None:
    # room for one request (32 prompt + 8 out) at a time: a cap-4 engine serves as a cap-1 one
    engine = SimulatedEngine(StepModel(decode_base_s=0.01), batch_cap=4, kv_tokens=50)
    load = engine.run(requests(20, max_tokens=8), concurrency=4)
    ends = sorted(r.send_s + r.e2e_ms / 1e3 for r in load.results)
    assert (ends[-1] - ends[0]) / (len(ends) - 1) == pytest.approx(8 * 0.01)
    too_big = engine.run(requests(2, prompt_tokens=60, max_tokens=8), concurrency=1)
    assert [r.ok for r in too_big.results] == [False, False]
    assert "exceed the KV capacity (50 tokens)" in (too_big.results[0].error or "")


def test_token_budget_chunks_a_long_prompt() -> None:
    model = StepModel(decode_base_s=0.01, prefill_per_token_s=0.001)
    whole = SimulatedEngine(model, batch_cap=2).run(requests(1, prompt_tokens=100), concurrency=1)
    chunked = SimulatedEngine(model, batch_cap=2, token_budget=30).run(requests(1, prompt_tokens=100), concurrency=1)
    assert whole.results[0].ttft_ms == pytest.approx(10 + 100)  # one step: 10 ms + 100 tokens x 1 ms
    assert chunked.results[0].ttft_ms == pytest.approx(4 * 10 + 100)  # four steps of 30, 30, 30, 10 tokens


def test_timeout_fails_what_did_not_finish() -> None:
    engine = SimulatedEngine(StepModel(decode_base_s=0.1), batch_cap=1)
    load = engine.run(with_arrivals(requests(10, max_tokens=4), 1.0, "constant", 0), timeout_s=3.0)
    errors = [r.error for r in load.results]
    assert errors[0] is None and errors[1] is None  # 0.4 s each, sent at 0 and 1 s
    assert any(e and e.startswith("timed out") for e in errors)
    assert errors[-1] == "not sent: run timed out"
    assert engine.clock() == pytest.approx(3.0)


@pytest.mark.parametrize("kwargs", [{"batch_cap": 0}, {"batch_cap": 4, "token_budget": 2},
                                    {"batch_cap": 1, "kv_tokens": 0}])
def test_bad_engine_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(TunerError):
        SimulatedEngine(StepModel(decode_base_s=0.01), **kwargs)


def test_bad_step_model_is_refused() -> None:
    with pytest.raises(TunerError, match="prefill_per_token_s"):
        StepModel(decode_base_s=0.01, prefill_per_token_s=-1.0)


def test_a_per_batch_table_sets_the_step_time() -> None:
    # measured steps of 7, 27 and 54 ms at 1, 2 and 4 sequences (not a line): 3 sequences take their midpoint
    model = StepModel(decode_base_s=0.0, decode_by_batch_s=((4, 0.054), (1, 0.007), (2, 0.027)))
    engine = SimulatedEngine(model, batch_cap=4)
    for k, step_ms in ((1, 7.0), (2, 27.0), (3, 40.5), (4, 54.0)):
        load = engine.run(requests(k, max_tokens=6), concurrency=k)
        assert all(g == pytest.approx(step_ms) for r in load.results for g in r.itl_ms), k
    with pytest.raises(TunerError, match="decode_by_batch_s"):
        StepModel(decode_base_s=0.0, decode_by_batch_s=((1, 0.01), (1, 0.02)))
