"""The load generator against a fake engine with known timing (in the style of vLLM's serve-metrics tests):
sends at their scheduled times, TTFT from the scheduled arrival (engine queueing and dispatch lag counted), the
closed loop's in-flight cap, one ITL gap per chunk, frozen results on a time-out, pruned runs."""

from __future__ import annotations

import threading

import pytest

from tests.fake_engine import FakeEngine
from tuner.measure.loadgen import run_load
from tuner.measure.workload import Request


def reqs(n, rate=None, max_tokens=4, arrivals=None):
    out = []
    for i in range(n):
        t = arrivals[i] if arrivals is not None else (i / rate if rate else None)
        out.append(Request(i, "x", (1, 2, 3), max_tokens, t))
    return out


def serve(engine, requests, **kw):
    engine.start()
    try:
        return run_load(engine, requests, progress=False, **kw)
    finally:
        engine.stop(drain=False)


def test_sends_happen_at_their_scheduled_times():
    arrivals = [0.0, 0.05, 0.1, 0.3, 0.35]
    load = serve(FakeEngine(servers=4), reqs(5, arrivals=arrivals))
    for r, a in zip(load.results, arrivals):
        assert r.send_s == pytest.approx(a, abs=1e-9)  # recorded as scheduled
        assert 0 <= r.dispatch_lag_ms < 30  # and actually handed over close to it
    assert all(r.ok for r in load.results)


def test_ttft_counts_engine_queueing():
    # one server, 0.1 s per request, three requests arriving together: the third waits for two services
    e = FakeEngine(servers=1, prefill_s=0.1, token_s=0.0)
    load = serve(e, reqs(3, arrivals=[0.0, 0.0, 0.0], max_tokens=1))
    ttft = [r.ttft_ms for r in load.results]
    assert ttft[0] == pytest.approx(100, abs=40)
    assert ttft[2] == pytest.approx(300, abs=60)
    assert ttft[2] > ttft[1] > ttft[0]


def test_ttft_counts_dispatch_lag_from_the_scheduled_arrival():
    # submit() blocks 0.15 s: the second request, scheduled at 0.0, is handed over late; its TTFT includes that
    e = FakeEngine(servers=2, prefill_s=0.01, submit_delay_s=0.15)
    load = serve(e, reqs(2, arrivals=[0.0, 0.0], max_tokens=1))
    second = load.results[1]
    assert second.dispatch_lag_ms >= 140
    assert second.ttft_ms >= second.dispatch_lag_ms + 5


def test_closed_loop_never_exceeds_concurrency():
    e = FakeEngine(servers=8, prefill_s=0.01, token_s=0.002)
    load = serve(e, reqs(20, max_tokens=5), concurrency=3)
    assert e.max_in_flight == 3  # never more, and the loop keeps it full
    assert sum(r.ok for r in load.results) == 20


def test_batch_cap_of_the_fake_engine_bounds_running():
    e = FakeEngine(servers=2, prefill_s=0.02)
    serve(e, reqs(6, arrivals=[0.0] * 6, max_tokens=2))
    assert e.max_running == 2


def test_itl_is_one_gap_per_chunk():
    # 7 tokens: 1 (first) + 3 chunks of 2, a chunk every 2 * 20 ms
    e = FakeEngine(servers=1, prefill_s=0.01, token_s=0.02, chunk=2)
    load = serve(e, reqs(1, arrivals=[0.0], max_tokens=7))
    r = load.results[0]
    assert r.output_tokens == 7 and r.chunks == 4
    assert len(r.itl_ms) == 3  # not 6 gaps padded with zeros
    assert all(x == pytest.approx(40, abs=20) for x in r.itl_ms)
    assert r.e2e_ms == pytest.approx(r.ttft_ms + sum(r.itl_ms), abs=1.0)  # E2E ends at the last token


def test_timeout_freezes_results():
    e = FakeEngine(servers=1, prefill_s=0.01, token_s=0.1)
    e.start()
    load = run_load(e, reqs(2, arrivals=[0.0, 0.0], max_tokens=10), timeout_s=0.3, progress=False)
    before = [(r.error, r.output_tokens, list(r.itl_ms)) for r in load.results]
    e.stop(drain=True)  # the engine finishes both requests after run_load returned
    after = [(r.error, r.output_tokens, list(r.itl_ms)) for r in load.results]
    assert before == after
    assert all(r.error and "timed out" in r.error for r in load.results)
    assert not any(r.ok for r in load.results)


def test_pruned_run_returns_only_finished_requests_and_decides_off_the_engine_thread():
    threads = []

    def stop_after_two(finished, total):
        threads.append(threading.current_thread())
        return "enough" if len(finished) >= 2 else None

    e = FakeEngine(servers=1, prefill_s=0.02, token_s=0.0)
    load = serve(e, reqs(8, arrivals=[0.0] * 8, max_tokens=1), should_stop=stop_after_two)
    assert load.stopped_reason == "enough"
    assert 2 <= len(load.results) < 8 and all(r.ok for r in load.results)
    assert threads and all(t is threading.main_thread() for t in threads)


def test_a_settling_run_stopped_early_returns_with_the_engine_idle_so_the_next_run_is_not_slowed():
    e = FakeEngine(servers=2, prefill_s=0.0, token_s=0.01)
    e.start()
    try:
        load = run_load(e, reqs(8, arrivals=[0.0] * 8, max_tokens=20), progress=False, settle=True,
                        should_stop=lambda finished, total: "enough" if finished else None)
        assert load.stopped_reason == "enough" and len(load.results) < 8 and load.sent == 8
        assert e.in_flight == 0  # the requests it had handed over have ended: nothing runs under the next run
        nxt = run_load(e, reqs(2, arrivals=[0.0, 0.0], max_tokens=20), progress=False)
        assert all(r.ttft_ms < 50 for r in nxt.results)  # served at once, not queued behind the stopped run's
        # without settle (`tuner bench --stop-if`, which abandons what is in flight) it returns at the stop
        load = run_load(e, reqs(8, arrivals=[0.0] * 8, max_tokens=20), progress=False,
                        should_stop=lambda finished, total: "enough" if finished else None)
        assert load.stopped_reason == "enough" and e.in_flight > 0
    finally:
        e.stop(drain=False)
