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


# ------------------------------------------------------------------------------------------- fast paths --- #
def plain_run(engine: SimulatedEngine, reqs: list[Request], rng, concurrency: int | None = None,
              timeout_s: float = 3600.0, should_stop=None) -> dict:
    """The simulation as it was before its decodes were counted instead of visited (commit 7cfb10c's
    SimulatedEngine.run, condensed): every running request an object updated in every step, its gaps appended one
    by one, one step at a time, each step's noise drawn from the standard library (`rng`, a
    random.Random("simulated-engine-<seed>") kept across runs: the engine's own block noise is not used). Driven on
    `engine`'s clock and settings; returns what a LoadResult holds."""
    from collections import deque

    from tuner.measure.metrics import RequestResult

    t0 = t = engine.now
    n, deadline = len(reqs), engine.now + timeout_s
    sent, waiting, running, done = [], deque(), [], []
    by_index: list = [None] * n
    free_at = deque([t0] * concurrency) if concurrency else deque()
    kv_used = ctx_decoding = cursor = finished_count = 0
    reason = None

    def send_due() -> None:
        nonlocal cursor
        while cursor < n:
            if concurrency:
                if not free_at:
                    return
                scheduled = free_at.popleft()
            else:
                scheduled = t0 + (reqs[cursor].arrival_s or 0.0)
                if scheduled > t:
                    return
            r = reqs[cursor]
            s = {"req": r, "scheduled": scheduled, "left": max(1, len(r.prompt_ids)), "ctx": 0, "out": 0,
                 "last": scheduled, "need": max(1, len(r.prompt_ids)) + r.max_tokens, "ended": None,
                 "res": RequestResult(index=r.index, prompt_tokens=len(r.prompt_ids), send_s=scheduled - t0,
                                      dispatch_lag_ms=0.0)}
            by_index[cursor] = s
            sent.append(s)
            waiting.append(s)
            cursor += 1

    def finish(s: dict, error: str | None) -> None:
        r = s["res"]
        r.output_tokens, r.chunks, r.error = s["out"], s["out"], error
        r.e2e_ms = (s["last"] - s["scheduled"]) * 1e3 if error is None else None
        s["ended"] = t
        done.append(s)
        if concurrency:
            free_at.append(t)

    while True:
        if reason is None:
            send_due()
        while waiting and len(running) < engine.cap:
            head = waiting[0]
            if engine.kv_tokens is not None:
                if head["need"] > engine.kv_tokens:
                    waiting.popleft()
                    finish(head, f"prompt + max_tokens = {head['need']} tokens exceed the KV capacity "
                                 f"({engine.kv_tokens} tokens)")
                    if reason is None:
                        send_due()
                    continue
                if kv_used + head["need"] > engine.kv_tokens:
                    break
                kv_used += head["need"]
            running.append(waiting.popleft())
        if not running:
            if waiting:
                continue
            if reason is not None or cursor >= n or concurrency:
                break
            t_next = t0 + (reqs[cursor].arrival_s or 0.0)
            if t_next > deadline:
                t = deadline
                break
            t = engine.now = max(t, t_next)
            continue
        budget = engine.token_budget if engine.token_budget is not None else math.inf
        decoding = [s for s in running if s["left"] == 0]
        budget -= len(decoding)
        chunks, prompt_tokens, prompt_sq = [], 0, 0
        for s in running:
            if s["left"] and budget > 0:
                take = int(min(s["left"], budget))
                chunks.append((s, take))
                prompt_tokens += take
                before = max(1, len(s["req"].prompt_ids)) - s["left"]  # its prompt tokens already processed
                prompt_sq += (before + take) ** 2 - before ** 2
                budget -= take
        dt = engine.model.step_s(len(decoding), ctx_decoding, prompt_tokens, prompt_sq)
        sigma = engine.model.noise_sigma
        if sigma > 0:
            dt *= rng.lognormvariate(-sigma * sigma / 2.0, sigma)
        engine.steps += 1
        if t + dt > deadline:
            t = deadline
            break
        t += dt
        engine.now = t
        for s in decoding:
            s["res"].itl_ms.append((t - s["last"]) * 1e3)
            s["last"], s["out"], s["ctx"] = t, s["out"] + 1, s["ctx"] + 1
        ctx_decoding += len(decoding)
        for s, take in chunks:
            s["left"] -= take
            if s["left"] == 0:
                s["res"].ttft_ms = (t - s["scheduled"]) * 1e3
                s["last"], s["out"], s["ctx"] = t, 1, len(s["req"].prompt_ids) + 1
                ctx_decoding += s["ctx"]
        ended = [s for s in running if s["out"] >= s["req"].max_tokens]
        if ended:
            running = [s for s in running if s["out"] < s["req"].max_tokens]
            for s in ended:
                kv_used -= s["need"] if engine.kv_tokens is not None else 0
                ctx_decoding -= s["ctx"]
                finish(s, None)
            if should_stop is not None and reason is None:
                reason = should_stop([d["res"] for d in done], n)
                if reason is not None:
                    finished_count = len(done)
    engine.now = t
    finished = done[:finished_count] if reason is not None else done
    ids = {id(s) for s in finished}
    if reason is not None:
        results = [s["res"] for s in sent if id(s) in ids]
    else:
        results = []
        for i, r in enumerate(reqs):
            s = by_index[i]
            if s is None:
                results.append(RequestResult(index=r.index, prompt_tokens=len(r.prompt_ids),
                                             error="not sent: run timed out"))
                continue
            if id(s) not in ids:
                s["res"].output_tokens = s["res"].chunks = s["out"]
                s["res"].error = f"timed out after {timeout_s:g}s"
            results.append(s["res"])
    end = max((s["ended"] for s in finished), default=t0)
    return {"results": results, "duration_s": end - min((s["scheduled"] for s in sent), default=t0),
            "stopped_reason": reason, "sent": len(sent),
            "last_send_s": None if not sent else max(s["scheduled"] for s in sent) - t0}


def test_the_counted_engine_serves_exactly_as_the_per_request_simulation() -> None:
    """Open and closed loops, noise, per-batch tables (step bases and context slopes), KV limits (rejections and blocking), token budgets that chunk
    prompts (and price their chunks' attention pairs), mixed steps, early stops and time-outs, runs back to back on one engine: every request's figures (TTFT, E2E, each
    gap, tokens, errors), the run's duration, the clock and the step count are the old per-request simulation's, to
    the last bit (same steps in the same order, same noise draws)."""
    import dataclasses
    import random

    for case in range(60):
        rng = random.Random(case)
        model = StepModel(decode_base_s=rng.choice([0.0, 0.01]), decode_per_seq_s=0.002,
                          decode_per_context_token_s=rng.choice([0.0, 2e-6]), prefill_base_s=0.003,
                          prefill_per_token_s=1e-4, noise_sigma=rng.choice([0.0, 0.2]),
                          decode_by_batch_s=rng.choice([(), ((1, 0.005), (2, 0.012), (4, 0.03))]),
                          prefill_per_token_sq_s=rng.choice([0.0, 3e-7]), mixed=rng.choice([False, True]),
                          mixed_base_s=0.001, mixed_per_token_s=5e-5, mixed_per_token_sq_s=rng.choice([0.0, 1e-7]),
                          decode_ctx_by_batch_s=rng.choice([(), ((1, 1e-6), (2, 9e-6), (4, 3e-6))]))
        cap = rng.choice([1, 2, 4, 8])
        settings = {"kv_tokens": rng.choice([None, 400, 2000]), "token_budget": rng.choice([None, 2048, 64, cap])}
        fast, plain = (SimulatedEngine(model, cap, seed=case, **settings) for _ in range(2))
        noise = random.Random(f"simulated-engine-{case}")
        for k in range(3):
            reqs = [Request(i, "", tuple(range(rng.randint(0, 300))), rng.randint(1, 40), None)
                    for i in range(rng.randint(1, 150))]
            closed = rng.random() < 0.5
            kw = {"concurrency": rng.randint(1, 6) if closed else None, "timeout_s": rng.choice([3600.0, 2.0])}
            stop_at = rng.choice([None, 5, 40])
            if stop_at:
                kw["should_stop"] = lambda f, total, at=stop_at: f"{len(f)} finished" if len(f) >= at else None
            reqs = with_arrivals(reqs, None if closed else rng.uniform(1, 50), "poisson", k)
            got, want = fast.run(reqs, **kw), plain_run(plain, reqs, noise, **kw)
            assert [dataclasses.asdict(r) for r in got.results] == [dataclasses.asdict(r) for r in want["results"]]
            assert (got.duration_s, got.stopped_reason, got.sent, got.last_send_s) == (
                want["duration_s"], want["stopped_reason"], want["sent"], want["last_send_s"]), case
            assert (fast.now, fast.steps) == (plain.now, plain.steps), case


def test_the_counted_early_stop_decides_as_the_padded_recount() -> None:
    """certain_miss counts the finished requests as they come; its decision after every completion is the one
    recounted from scratch over the padded list (bound_verdict / attainment_verdict on the finished steady
    requests plus a perfect request for each still to finish), including when the list it gets is not the one it
    counted before (started afresh)."""
    import random

    from tuner.measure.capacity import certain_miss
    from tuner.measure.metrics import RequestResult, meets_slo
    from tuner.slo import parse_slo_terms
    from tuner.stats import MISSES, attainment_verdict, bound_verdict

    def recount(slo: SLO, ramp: int, conf: float, finished: list, total: int) -> bool:
        steady = [r for r in finished if r.index >= ramp]
        if len(steady) < 4:
            return False
        best = RequestResult(index=-1, prompt_tokens=1, output_tokens=2, ttft_ms=0.0, e2e_ms=0.0)
        padded = steady + [best] * max(0, total - ramp - len(steady))
        for b in slo.bounds:
            if b.stat == "mean" or b.metric == "itl":
                continue
            values = [math.inf if not r.ok else (r.tpot_ms if b.metric == "tpot" else getattr(r, f"{b.metric}_ms"))
                      for r in padded]
            if bound_verdict([v for v in values if v is not None], b.stat, b.limit_ms, conf) == MISSES:
                return True
        if slo.targets_ms:
            good = sum(meets_slo(r, slo.targets) for r in padded)
            return attainment_verdict(good, len(padded), slo.attainment, conf) == MISSES
        return False

    decided = 0
    for case in range(40):
        rng = random.Random(case)
        bounds, targets = parse_slo_terms(rng.choice(["ttft:p99<300ms", "ttft:p90<300ms;tpot:p50<20ms",
                                                      "e2e:p95<2s;itl:p90<50ms", "ttft<300ms;tpot<30ms"]))
        slo = SLO(tuple(bounds), tuple(targets.items()), 0.9 if targets else None)
        ramp, total, conf = rng.randint(0, 20), rng.randint(30, 300), rng.choice([0.95, 0.999])
        stop = certain_miss(slo, ramp, conf)
        late, finished = rng.random() * 0.3, []
        for i in rng.sample(range(total), total):
            ok = rng.random() > 0.02
            ttft = rng.uniform(0, 280) if rng.random() > late else rng.uniform(300, 900)
            finished.append(RequestResult(index=i, prompt_tokens=5, output_tokens=rng.choice([1, 2, 30]) if ok else 0,
                                          ttft_ms=ttft if ok else None, e2e_ms=ttft + rng.uniform(0, 2500) if ok
                                          else None, error=None if ok else "failed"))
            if rng.random() < 0.03:
                finished = finished[: len(finished) // 2]  # another list: counted afresh
            said = stop(list(finished), total)
            assert (said is not None) == recount(slo, ramp, conf, finished, total), (case, len(finished))
            decided += said is not None
    assert decided > 100  # the cases reach the stop often, not only the waits before it


def test_the_block_noise_is_the_standard_librarys_lognormal_stream() -> None:
    """LognormalStream gives random.Random(seed).lognormvariate(mu, sigma)'s values, each to the last bit and in
    order, one at a time and in blocks mixed, across block refills, for the engine's seeds and a range of sigmas
    (the rejection loop's acceptance rate moves with none of them: the uniforms it consumes must line up)."""
    import random

    from tuner.predict.noise import LognormalStream

    for seed in ("simulated-engine-0", "simulated-engine-41", 7):
        for sigma in (0.01, 0.043, 0.2, 1.5):
            mu = -sigma * sigma / 2.0
            stream, reference = LognormalStream(seed, mu, sigma), random.Random(seed)
            got = [stream.next() for _ in range(3000)] + stream.peek(7) + stream.take(9000).tolist()
            got += [stream.next() for _ in range(5)]
            values = [reference.lognormvariate(mu, sigma) for _ in range(12005)]
            want = values[:3000] + values[3000:3007] + values[3000:12000] + values[12000:]  # peeked, then taken
            assert got == want, (seed, sigma)


# llama-server -t 1 Q8_0 of smollm2-135m on this project's 2-core host (profile 7508b04e6e69, version 2): the step
# model `tuner profile` fitted, as the whole-space benchmark predicts with it
MEASURED = StepModel(decode_base_s=0.0, decode_per_context_token_s=3.868370376302503e-06,
                     prefill_base_s=0.007710653199272961, prefill_per_token_s=0.0018455505714419739,
                     noise_sigma=0.04316216711647216,
                     decode_by_batch_s=((1, 0.006732546218689153), (2, 0.02346169143318618),
                                        (4, 0.038652222459096754), (8, 0.06184029148068756),
                                        (16, 0.054737546740721385)))


def test_a_tail_slo_capacity_search_on_a_measured_profile_is_the_per_request_simulations() -> None:
    """The real capacity search at ttft:p99 (probes of 597+ requests, canaries, saturation, bisection) driven on
    the engine as it runs now (decode-only stretches computed together, block noise) and on the per-request
    simulation with the standard library's noise, on a step model fitted to a real llama-server profile and the
    llama.cpp space's workload (64:192 prompt tokens, 24:48 out): the same search to the last bit (every probe's
    figures, the capacity, its interval, the clock)."""
    import random

    from tuner.measure.capacity import CapacityOptions, CapacitySearch, probe_requests_for
    from tuner.slo import SLO, parse_slo

    slo = SLO(bounds=tuple(parse_slo("ttft:p99<2s")))
    options = CapacityOptions(slo=slo, probe_requests=probe_requests_for(slo, 3, None), max_probes=3,
                              max_wall_s=1e6, max_requests=3 * 3 * probe_requests_for(slo, 3, None)[1])
    rng = random.Random(3)
    pool = [Request(i, "", tuple(range(rng.randint(64, 192))), rng.randint(24, 48), None)
            for i in range(options.pool_size(4))]

    class Plain:
        def __init__(self) -> None:
            self.engine = SimulatedEngine(MEASURED, 2, seed=11)
            self.noise = random.Random("simulated-engine-11")

        def run(self, reqs, concurrency=None, timeout_s=3600.0, should_stop=None, **_):
            from tuner.measure.loadgen import LoadResult

            got = plain_run(self.engine, reqs, self.noise, concurrency=concurrency, timeout_s=timeout_s,
                            should_stop=should_stop)
            return LoadResult(results=got["results"], duration_s=got["duration_s"], token_ids=[[] for _ in reqs],
                              stopped_reason=got["stopped_reason"], sent=got["sent"], last_send_s=got["last_send_s"])

    fast, plain = SimulatedEngine(MEASURED, 2, seed=11), Plain()
    got = CapacitySearch(fast.run, pool, 2, options, clock=fast.clock).search()
    want = CapacitySearch(plain.run, pool, 2, options, clock=plain.engine.clock).search()
    assert got["requests_per_s"] > 0 and got["cost"]["requests"] > 2000  # a real tail search, not a trivial one
    for r in (got, want):
        r.pop("host", None)
    assert got == want
    assert (fast.now, fast.steps) == (plain.engine.now, plain.engine.steps)


def test_a_chunked_prompt_pays_the_step_base_per_chunk_and_its_attention_once() -> None:
    # a lone 384-token prompt through a 128-token step budget: 3 steps, each with the prefill base; the attention
    # pairs of the chunks (128^2, 256^2 - 128^2, 384^2 - 256^2) add up to the whole prompt's 384^2
    model = StepModel(decode_base_s=0.01, prefill_base_s=0.005, prefill_per_token_s=1e-4, prefill_per_token_sq_s=1e-6)
    whole = SimulatedEngine(model, 1).run([Request(0, "", tuple(range(384)), 1, None)], concurrency=1)
    chunked = SimulatedEngine(model, 1, token_budget=128).run([Request(0, "", tuple(range(384)), 1, None)],
                                                              concurrency=1)
    assert whole.results[0].ttft_ms == pytest.approx(model.prefill_s(384) * 1e3)
    assert chunked.results[0].ttft_ms == pytest.approx((model.prefill_s(384) + 2 * (0.01 + 0.005)) * 1e3)
