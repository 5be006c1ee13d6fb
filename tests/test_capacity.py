"""The capacity search on a fake engine whose service rate is known, and its verdict logic on real statistics."""

from __future__ import annotations

import os

import pytest

from tests.fake_engine import FakeEngine
from tuner.measure.capacity import CapacityOptions, CapacitySearch, certain_miss, judge
from tuner.measure.loadgen import run_load
from tuner.measure.metrics import RequestResult
from tuner.measure.workload import Request
from tuner.slo import SLO, build_slo, parse_slo
from tuner.stats import min_samples_to_meet

# The searches below run their fake engines SCALE times faster than the figures in their comments, with every
# duration of their SLOs and budgets divided by as much: queueing, utilisations, request counts and verdicts are the
# same in units of the service time (a 90 ms request judged on 200 ms is a 30 ms one judged on 66.7 ms), in a third of
# the wall time. Their chunks are paced (tests.fake_engine). What does not scale is the host: a thread that waits
# tens of ms for a CPU is a larger share of a faster request. On this 2-core host at load 6-12, unpaced sleeps at 4x
# measured 0.94-0.97 of the steady engine's service rate and, in 3 of 10 searches, a capacity below 0.8 of it; paced
# at 4x 0.99-1.00, but 2 of ~20 searches at load 9-12 saw a probe at 0.84 of it miss; at 8x a paced canary moved
# +1500% once. 3x keeps a third more room. The one measurement of a steady engine on a quiet host
# (`measure_capacity`: measured once, the host's CPU accounting in 10 ms ticks saying quiet) and the neighbour's keep
# real time: their shortest steps (the warm-up, the last canary, ~0.1 s) would last a few ticks.
SCALE = 3.0


def fast(s: float) -> float:
    """A duration in a comment's figures, as the scaled fake engines and budgets run it."""
    return s / SCALE


def ms(limit_ms: float) -> str:
    """An SLO limit in a comment's figures (ms), as the scaled searches judge it."""
    return f"{limit_ms / SCALE:g}ms"


def fake(servers: int, prefill_s: float, token_s: float, **kw) -> FakeEngine:
    """A fake engine of a comment's figures, scaled, its chunks paced (due at their offsets from the request's start,
    so a late wake-up does not lengthen the request)."""
    return FakeEngine(servers=servers, prefill_s=fast(prefill_s), token_s=fast(token_s), paced=True, **kw)


def pool(n, max_tokens=8):
    return [Request(i, "x", (1, 2, 3), max_tokens, None) for i in range(n)]


def search(engine, slo, **kw):
    engine.start()
    try:
        def run(reqs, concurrency, timeout_s, should_stop):
            return run_load(engine, reqs, concurrency, timeout_s, should_stop, progress=False)

        opts = CapacityOptions(slo=slo, **{"probe_requests": (30, 60), "arrival": "constant", **kw})
        return CapacitySearch(run, pool(80), engine.servers, opts).search()
    finally:
        engine.stop(drain=False)


@pytest.fixture(scope="module")
def steady_search():
    """One capacity search of a steady engine of known service rate, judged on E2E p90 < 200 ms, that two tests
    read (one search of ~12 s at real time, ~4 s scaled, instead of two alike)."""
    return search(fake(2, prefill_s=0.02, token_s=0.01), SLO(tuple(parse_slo(f"e2e:p90<{ms(200)}"))))


def test_finds_a_known_service_rate_within_tolerance(steady_search):
    # 2 servers x (20 ms + 7 x 10 ms) = 0.09 s per request -> 22.2 req/s; with constant arrivals nothing queues
    # below that rate (E2E = 90 ms) and the queue grows above it, so E2E p90 < 200 ms holds up to ~the service rate
    mu = 2 / fast(0.02 + 7 * 0.01)
    cap = steady_search
    assert cap["verdict"] == "meets"
    assert cap["saturation"]["requests_per_s"] == pytest.approx(mu, rel=0.15)
    lo, hi = cap["requests_per_s_ci"]
    # nothing above the capacity was shown to miss: the interval runs to the saturation rate's upper bound (its
    # completions counted over its steady window), and the rates between are named (too close to saturation for a
    # 60-request probe to span its queue's relaxation times)
    sat = cap["saturation"]
    assert lo == cap["requests_per_s"] and hi == sat["requests_per_s_upper"] > sat["requests_per_s"]
    assert any("not probed" in n for n in cap["notes"]) or any(p["verdict"] != "meets" for p in cap["probes"])
    assert mu * 0.8 <= cap["requests_per_s"] <= mu * 1.05
    assert all(p["verdict"] == "meets" for p in cap["probes"] if p["rate_rps"] <= cap["requests_per_s"])
    assert cap["cost"]["requests"] <= 600 and cap["cost"]["probes"] <= 6
    assert cap["warmup"]["n"] == 2 and cap["warmup"]["failed"] == 0


def test_a_wide_batch_cap_still_gets_its_rate_probes():
    """vLLM's default 128 sequences: the warm-up (128) and the saturation probe (beyond 128 in flight) alone exceed a
    small request budget; the budget caps the rate probes, so the search still brackets a capacity."""
    cap = search(FakeEngine(servers=32, prefill_s=0.002, token_s=0.001), SLO(tuple(parse_slo("e2e:p90<500ms"))),
                 max_requests=60, max_probes=2, saturation_requests=96)
    assert cap["warmup"]["n"] == 32 and cap["saturation"]["n"] == 96
    assert cap["cost"]["probes"] >= 1 and cap["verdict"] == "meets" and cap["requests_per_s"] > 0


def test_a_tight_ttft_bound_lowers_capacity():
    # a TTFT below two prefills means no request may wait behind another: capacity well under the service rate
    loose = search(fake(1, prefill_s=0.03, token_s=0.005), SLO(tuple(parse_slo(f"ttft:p90<{ms(500)}"))))
    tight = search(fake(1, prefill_s=0.03, token_s=0.005),
                   SLO(tuple(parse_slo(f"ttft:p50<{ms(40)}"))), arrival="poisson", max_probes=3)
    assert loose["verdict"] == "meets"
    assert tight["requests_per_s"] < loose["requests_per_s"]


def test_attainment_below_target_misses_at_every_rate():
    # every 4th request is 10x slower: 75% of requests meet e2e < 150 ms whatever the rate
    slow = fake(2, prefill_s=0.01, token_s=0.005, slow=lambda n: 10.0 if n % 4 == 3 else 1.0)
    _, slo = build_slo(None, "ttft:p99", f"e2e<{ms(150)}", attainment=0.95)
    cap = search(slow, slo, max_probes=2)
    assert cap["verdict"] == "misses" and cap["requests_per_s"] == 0
    assert all(p["verdict"] == "misses" for p in cap["probes"])
    assert all(p["attainment"] < 0.9 for p in cap["probes"])


def test_p99_beyond_the_probe_budget_is_said_plainly():
    cap = search(FakeEngine(servers=2, prefill_s=0.005, token_s=0.002), SLO(tuple(parse_slo("ttft:p99<1s"))),
                 max_probes=1)
    # 299 at one look; the search spends its alpha over 5 probes x 2 looks, each end of the interval at half of it
    look = CapacityOptions(slo=SLO(tuple(parse_slo("ttft:p99<1s"))), max_probes=1).look_confidence()
    assert look == pytest.approx(1 - 0.05 / 4)
    assert cap["min_requests_to_meet"] == min_samples_to_meet(0.99, look) == 437
    assert any("needs at least 437 requests" in n for n in cap["notes"])
    assert cap["verdict"] == "indeterminate"  # never a coin flip: p99 of 60 requests cannot be shown to hold


def ok(i, ttft):
    return RequestResult(index=i, prompt_tokens=3, output_tokens=4, ttft_ms=ttft, e2e_ms=ttft + 30.0)


def test_judge_decides_only_with_evidence():
    slo = SLO(tuple(parse_slo("ttft:p90<100ms")))
    assert judge([ok(i, 50.0) for i in range(40)], slo)["verdict"] == "meets"  # 40 >= 29 all within
    assert judge([ok(i, 50.0) for i in range(10)], slo)["verdict"] == "indeterminate"  # too few to show p90
    assert judge([ok(i, 500.0) for i in range(10)], slo)["verdict"] == "misses"
    failed = [RequestResult(index=i, error="boom") for i in range(10)]
    assert judge(failed, slo)["verdict"] == "misses"  # a failed request is never within the SLO


def test_early_stop_only_when_the_miss_is_certain():
    slo = SLO(tuple(parse_slo("ttft:p50<100ms")))
    stop = certain_miss(slo, ramp=0)
    # 5 of 40 finished, all late: the 35 still running could still make p50 hold -> go on
    assert stop([ok(i, 900.0) for i in range(5)], 40) is None
    # 25 of 40 finished late: with 15 perfect ones, 15/40 within is not yet below 50% with 95% confidence
    assert stop([ok(i, 900.0) for i in range(25)], 40) is None
    # 30 of 40 late: 10/40 within is (binomial P <= 0.002): stop
    assert "ttft:p50<100ms missed with confidence" in stop([ok(i, 900.0) for i in range(30)], 40)


def test_a_pool_shorter_than_the_budget_repeats_prompts_and_says_so():
    engine = FakeEngine(servers=2, prefill_s=0.002, token_s=0.001)
    engine.start()
    sent: list[int] = []
    canary: list[int] = []
    try:
        def run(reqs, concurrency, timeout_s, should_stop):  # 3 copies of one prompt: only the canary
            one = len(reqs) == 3 and len({r.prompt_ids for r in reqs}) == 1
            (canary if one else sent).extend(r.prompt_ids[0] for r in reqs)
            return run_load(engine, reqs, concurrency, timeout_s, should_stop, progress=False)

        opts = CapacityOptions(slo=SLO(tuple(parse_slo("e2e:p90<500ms"))), probe_requests=(8, 8), max_probes=2,
                               saturation_requests=8)
        short = [Request(i, "x", (i, 2, 3), 4, None) for i in range(12)]
        cap = CapacitySearch(run, short, 2, opts).search()
    finally:
        engine.stop(drain=False)
    assert len(sent) > 12 and len(set(sent[:12])) == 12  # each prompt once before any repeats
    # the canary repeats the warm-up's first prompt on purpose: the same request at the start and after every step
    assert canary == [0] * 3 * (2 + len(cap["probes"]))
    assert sum("repeat prompts" in n for n in cap["notes"]) == 1


def test_an_engine_that_slowed_during_the_measurement_is_said(steady_search):
    """The canary (one fixed prompt, 3 copies at the batch cap of 2, before the saturation probe, after it and after
    every rate probe): an engine whose every request from the 6th on runs 1.5x slower (warm-up 2 + first canary 3,
    then the slowdown, as a neighbour arriving on the host) gives a drift of +50% (the start ran 1.5x as fast as the
    measurement's median) and a note; a steady engine, neither.
    A neighbour there only during the saturation probe (gone before the first rate probe) is seen too."""
    slo = SLO(tuple(parse_slo(f"e2e:p90<{ms(200)}")))
    steady = steady_search  # fake(2, prefill_s=0.02, token_s=0.01) judged on `slo`
    # each canary: 3 copies x 7 gaps between their 8 tokens
    assert steady["canary"]["n"] == [3 * 7] * (2 + len(steady["probes"])) and abs(steady["canary"]["drift"]) < 0.1
    assert steady["canary"]["at"][:2] == ["start", "after the saturation probe"]
    assert not any("engine's speed moved" in n for n in steady["notes"])
    slowed = search(fake(2, prefill_s=0.02, token_s=0.01, slow=lambda n: 1.5 if n >= 5 else 1.0), slo)
    assert slowed["canary"]["drift"] == pytest.approx(0.5, abs=0.12)  # the start ran 1.5x the typical speed
    assert sum("engine's speed moved +" in n and "ms start" in n for n in slowed["notes"]) == 1
    # requests 5..(5 + 3 + the saturation's): the second canary follows the saturation probe, then the engine is
    # steady again, as at the start
    sat_n = CapacityOptions(slo=slo).saturation_count(2)
    passing = search(fake(2, prefill_s=0.02, token_s=0.01, slow=lambda n: 1.5 if 5 <= n < 5 + sat_n + 3 else 1.0),
                     slo, saturation_requests=sat_n)
    itl = passing["canary"]["itl_ms"]
    assert passing["canary"]["drift"] == pytest.approx(-1 / 3, abs=0.08)  # slower than typical, then
    assert itl[0] == pytest.approx(itl[-1], rel=0.1)  # the first and the last alone would have seen nothing


def test_an_engine_that_moved_under_the_measurement_is_measured_again():
    """`measure_capacity`: a neighbour slows every request 1.5x from the end of the first canary to the end of the
    first measurement (its last canary), then leaves. The first measurement's canary moved ~50%; the budget holds
    a second one, on fresh prompts, whose engine held steady: it is the figure reported, near the engine's real
    service rate and above the first's. A steady engine is measured once (at real time: see SCALE); a budget too
    short for a second says so."""
    from tuner.measure.capacity import measure_capacity

    mu = 2 / fast(0.02 + 7 * 0.01)  # the steady engine's service rate (test_finds_a_known_service_rate_within_...)

    def measure(neighbour: bool, scale: float = SCALE, **kw):
        warmups = [0]  # a measurement starts with its warm-up: 2 requests at the batch cap of 2 (a canary sends
        # CANARY_RUNS = 3, the saturation 3 in flight, the probes open loop)
        engine = FakeEngine(servers=2, prefill_s=0.02 / scale, token_s=0.01 / scale, paced=True,
                            slow=lambda n: 1.5 if neighbour and n >= 5 and warmups[0] < 2 else 1.0)
        slo = SLO(tuple(parse_slo(f"e2e:p90<{200 / scale:g}ms")))
        engine.start()
        try:
            def run(reqs, concurrency, timeout_s, should_stop):
                load = run_load(engine, reqs, concurrency, timeout_s, should_stop, progress=False)
                warmups[0] += concurrency == 2 and len(reqs) == 2
                return load

            opts = CapacityOptions(slo=slo, **{"probe_requests": (30, 60), "arrival": "constant", **kw})
            return measure_capacity(run, pool(opts.pool_size(2, measurements=2)), 2, opts), warmups[0]
        finally:
            engine.stop(drain=False)

    cap, measurements = measure(neighbour=True)
    assert measurements == 2 and cap["remeasured"]["kept"] == 1
    first, second = cap["remeasured"]["attempts"]
    assert first["canary"]["drift"] == pytest.approx(0.5, abs=0.12) and abs(second["canary"]["drift"]) < 0.1
    assert cap["requests_per_s"] == second["requests_per_s"] > first["requests_per_s"]
    assert mu * 0.8 <= cap["requests_per_s"] <= mu * 1.05
    assert cap["notes"][0].startswith("measured twice: the engine's speed moved +")
    assert cap["cost"]["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    assert not any("repeat" in n for n in cap["notes"] + first["notes"])  # the second sent fresh prompts

    steady, measurements = measure(neighbour=False, scale=1.0)
    assert measurements == 1 and "remeasured" not in steady and abs(steady["canary"]["drift"]) < 0.1
    short, measurements = measure(neighbour=True, max_wall_s=first["wall_s"] * 1.5)
    assert measurements == 1 and "remeasured" not in short
    assert any(n.startswith("not re-measured") for n in short["notes"])


def test_a_neighbour_present_throughout_the_measurement_is_seen_and_measured_again():
    """A neighbour process outside this process's tree spins a quarter of the host's CPUs from before the first
    measurement to its end, then leaves (stopped when `measure_capacity` says it measures again). The fake engine's
    speed does not change, so its canary cannot see the neighbour (as one present from start to end); the host's CPU
    accounting does: the first measurement says the host was busy, a second one is measured and reported, its host
    quiet."""
    from tests.neighbour import neighbour, spinners
    from tuner.measure.capacity import measure_capacity
    from tuner.measure.host import HOST_BUSY, busy_share

    slo = SLO(tuple(parse_slo("e2e:p90<200ms")))
    engine = FakeEngine(servers=2, prefill_s=0.02, token_s=0.01)
    engine.start()
    try:
        def run(reqs, concurrency, timeout_s, should_stop):
            return run_load(engine, reqs, concurrency, timeout_s, should_stop, progress=False)

        opts = CapacityOptions(slo=slo, probe_requests=(30, 60), arrival="constant")
        with neighbour() as stop:
            cap = measure_capacity(run, pool(opts.pool_size(2, measurements=2)), 2, opts,
                                   log=lambda line: stop() if "measuring again" in line else None)
    finally:
        engine.stop(drain=False)
    first, second = cap["remeasured"]["attempts"]
    assert first["host"]["others_share"] > 0.7 * spinners() / os.cpu_count()  # the whole measurement
    assert busy_share(first["host"]["busiest"]) > HOST_BUSY
    # the neighbour gone: the second's busiest step far below what it took (not below HOST_BUSY: the shared host's
    # other tenants can take 11% of a short step, as in one run of the suite, 2026-12-06)
    assert busy_share(second["host"]["busiest"]) < first["host"]["others_share"] / 2
    assert cap["remeasured"]["kept"] == 1 and cap["host"] == second["host"]
    assert cap["notes"][0].startswith("measured twice: ")
    assert any(n.startswith("the host was busy during") for n in first["notes"])


def test_a_slow_engine_leaves_budget_for_the_rate_probes():
    """~5 req/s at batch cap 1 with a 12 s budget (at real time; run at SCALE): the saturation's own steady window
    (32 completions over 10 s at least) would take most of the budget and leave no rate probe (fp32 at cap 1 in
    `make demo`); the saturation probe stops with 8 or more once the first probe (and the canaries after each step)
    would no longer fit after it, and that probe runs."""
    import scipy.stats  # noqa: F401 -- its first import (~0.6 s) lands in the search's budget: at real time, not scaled

    from tuner.measure.capacity import MIN_STEADY

    cap = search(fake(1, prefill_s=0.05, token_s=0.02), SLO(tuple(parse_slo(f"e2e:p50<{ms(2000)}"))),
                 max_wall_s=fast(12.0), steady_s=fast(10.0), probe_requests=(10, 10))
    steady = cap["saturation"]["steady"]
    assert steady["completions"] >= MIN_STEADY and steady["seconds"] < fast(10.0)  # CapacityOptions.steady_s
    assert cap["cost"]["probes"] >= 1 and cap["requests_per_s"] > 0


def test_an_indeterminate_rate_ends_the_bracket_but_not_the_interval():
    """The search's steps are faked (a harness test): saturation at 2 req/s, rates below 1.0 meet, 1.0 to 1.4 stay
    indeterminate, 1.4 and above miss. The bracket closes in below the indeterminate rates, but the capacity's
    interval runs to the lowest rate shown to miss (1.5, the first probe): an undecided rate is no upper bound."""

    class Scripted(CapacitySearch):
        def warm_up(self):
            return {"n": 2, "concurrency": 2, "failed": 0, "errors": [], "duration_s": 0.0}

        def canary(self, at):
            self.canaries.append({"at": at, "itl_ms": 10.0, "n": 21, "duration_s": 0.0})

        def saturate(self):
            return {"concurrency": 3, "n": 40, "requests_per_s": 2.0, "completed": 40, "errors": []}

        def probe(self, rate, lead):
            verdict = "meets" if rate < 1.0 else "indeterminate" if rate < 1.4 else "misses"
            p = {"rate_rps": rate, "n": 30, "verdict": verdict, "output_tokens_per_s": 8.0 * rate}
            self.probes.append(p)
            return p

    opts = CapacityOptions(slo=SLO(tuple(parse_slo("e2e:p90<200ms"))), probe_requests=(30, 120))
    cap = Scripted(lambda *a, **k: None, pool(10), 2, opts).search()
    rates = {p["rate_rps"]: p["verdict"] for p in cap["probes"]}
    assert rates[1.5] == "misses" and any(v == "indeterminate" for v in rates.values())
    assert cap["requests_per_s"] == max(r for r, v in rates.items() if v == "meets")
    assert cap["requests_per_s_ci"] == [cap["requests_per_s"], 1.5]
