"""Capacity: the highest arrival rate a started engine sustains while meeting the SLO, with confidence.

What users of vLLM's `auto_tune` / `sweep serve_sla`, GuideLLM's sweep and DistServe's goodput ask, measured on
one engine that is already started:

1. **Warm-up** drawn from the workload itself: `batch_cap` requests (at least 2) in a closed loop at the batch cap,
   so every slot and the largest batch shape have run before anything is timed. Errors are surfaced; the warm-up is
   excluded from every statistic.
2. **Canary**: one fixed prompt, a batch cap's worth of copies sent together (at least `CANARY_RUNS`; median
   inter-token gap), here and again after the saturation probe and after every rate probe: the engine's own speed
   at a full batch through the measurement, so a capacity measured while the host or the device changed under it
   is said (`canary.drift`, the largest move from their median; a note past 10%).
3. **Saturation probe**: a closed loop keeping more than `batch_cap` requests in flight (so the engine never
   idles), whose steady-state completion rate bounds the sustainable rate from above (an open-loop arrival rate
   above the service rate makes the queue grow without bound). Steady state: after the first fill has completed
   and before the loop stops sending (the drain, with fewer and fewer in flight, is left out); the probe sends
   until that window holds max(in-flight, 32) completions over 10 s at least.
4. **Bracketed rate search** between 0 and that bound: Poisson (or constant) open-loop probes, the arrival pattern
   scaled to the rate (common random numbers for the arrivals). Each probe gets a verdict against the SLO at the given
   confidence (tuner.stats): `meets` raises the lower end, `misses` lowers the upper end; `indeterminate` gets
   more requests at the same rate (pooled, up to the per-probe cap) and, still undecided, is treated as not
   shown to meet (it lowers the upper end; the answer says so). Below the first meeting rate the search halves
   the rate; between a meeting and a missing rate it bisects, until the bracket is within `tolerance` of its
   upper end or the budget (probes, requests, seconds) is spent.
5. **Steady state**: the first `ramp_fraction` of each probe's requests (at least 1) see an emptier engine than
   the rest; they are sent but left out of the probe's statistics.
6. **Fresh prompts for every request**: warm-up, saturation and probes take the next unused prompts of one
   deterministic stream (same seed, same prompts in the same order). Serving a prompt twice would measure the
   server's prompt cache (llama-server's `cache_prompt` and host prompt cache, vLLM's prefix caching) instead of
   the traffic a user sends; a trace too short for the budget is reused, and the result says so. (The canary
   alone repeats its prompt, on purpose: the same request before and after.)
7. A probe stops early only when its verdict can no longer be anything but `misses` (every request still to
   finish counted as meeting the SLO): an exceeded bound is exceeded with confidence before the probe is cut.
8. **The host's other load** (tuner.host): the CPU the host's other processes and its hypervisor took during
   each step (`host`: the canary cannot see a neighbour present from start to end; the CPU accounting can), said
   past 10%.
9. **Measured again when the conditions moved** (`measure_capacity`): a canary drift or a busy host past 10% gets
   a second measurement on fresh prompts when the budget holds one; the steadier of the two is reported, both are
   kept (`remeasured`).

Result (`metrics.capacity` of `tuner bench --capacity`, one trial's measure in `tuner search`):
`{requests_per_s, requests_per_s_ci: [low, high], output_tokens_per_s, goodput_requests_per_s, verdict, slo,
warmup, canary: {itl_ms: [start, after saturation, after each probe], n, at, drift}, host: {cpus, others_share,
steal_share, own_share, busiest: {step, others_share, steal_share}, steps: [...]}, saturation, probes:
[{rate_rps, n, ..., verdict}], cost: {requests, probes, wall_s}, notes, remeasured (when measured twice): {kept,
attempts: [{requests_per_s, canary, ...}]}}`, and from tuner.bench `machine: {memory_bandwidth_gbs: [before,
after] (CPU), drift}` (drift: the canary's).
`requests_per_s` is the highest probed rate shown to meet the SLO (0 when none); the interval runs from it to the
lowest rate above it shown to miss (or the saturation rate): each end decided at the SLO's confidence (a rate that
stayed indeterminate ends the search's bracket but not the interval).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tuner.host import HOST_BUSY, Snapshot, busy_share, load_by_step, snapshot
from tuner.metrics import RequestResult, compute_metrics, meets_slo
from tuner.stats import (
    INDETERMINATE,
    MEETS,
    MISSES,
    attainment_verdict,
    bound_verdict,
    combine_verdicts,
    min_samples_to_meet,
    proportion_bounds,
)
from tuner.targets import SLO, Bound
from tuner.workload import Request, with_arrivals


@dataclass(frozen=True)
class CapacityOptions:
    slo: SLO
    probe_requests: tuple[int, int] = (30, 120)  # first pass, cap after pooling more at an undecided rate
    max_probes: int = 6  # open-loop probes (the saturation probe not counted)
    max_requests: int = 600  # the rate probes together (the warm-up and saturation, sized by the batch cap, come on
    # top: a server with 128 slots needs its 128-request warm-up and a saturation beyond 128 in flight)
    max_wall_s: float = 900.0  # no new probe starts past this (a started probe may run to its own time limit)
    tolerance: float = 0.1  # stop when (high - low) <= tolerance * high
    ramp_fraction: float = 0.1
    arrival: str = "poisson"
    seed: int = 0
    saturation_requests: int | None = None  # most the saturation probe sends; default 2 x (in-flight + steady_count)
    steady_s: float = 10.0  # the saturation probe's steady window lasts this long at least

    def __post_init__(self) -> None:
        from tuner.errors import TunerError

        lo, hi = self.probe_requests
        if lo < 4 or hi < lo:
            raise TunerError(f"--probe-requests {lo}:{hi} is invalid: expected A:B with 4 <= A <= B")
        if self.max_probes < 1:
            raise TunerError(f"--max-probes {self.max_probes} is invalid: expected an integer >= 1")
        if not 0 < self.tolerance < 1:
            raise TunerError(f"capacity tolerance {self.tolerance} is invalid: expected a number in (0, 1)")

    @staticmethod
    def warmup_count(batch_cap: int) -> int:
        return max(2, batch_cap)

    @staticmethod
    def saturation_in_flight(batch_cap: int) -> int:
        return batch_cap + max(1, batch_cap // 4)

    def saturation_count(self, batch_cap: int) -> int:
        """The most requests the saturation probe sends (it stops earlier once its steady window is measured)."""
        c = self.saturation_in_flight(batch_cap)
        return self.saturation_requests or 2 * c + 2 * self.steady_count(batch_cap)

    @staticmethod
    def steady_count(batch_cap: int) -> int:
        # completions the steady window needs: 32 at least (a dozen left a +-15% spread between repeats of one
        # configuration), one full turnover of the in-flight requests on wide batch caps
        return max(CapacityOptions.saturation_in_flight(batch_cap), 32)

    def pool_size(self, batch_cap: int, measurements: int = 1) -> int:
        """Prompts `measurements` capacity measurements may send, each once: warm-up, saturation, the rate probes'
        budget and the last probe's overshoot (a probe that starts under budget may take its full cap plus its
        ramp); `measure_capacity` may measure twice."""
        last = math.ceil(self.probe_requests[1] * (1 + self.ramp_fraction)) + 1
        one = self.warmup_count(batch_cap) + self.saturation_count(batch_cap) + self.max_requests + last
        return measurements * one


# ------------------------------------------------------------------------------------- probe verdicts --- #
def request_values(results: Sequence[RequestResult], metric: str) -> list[float]:
    """Per-request values of a metric for a verdict: failed requests count as infinitely late; ITL pools every
    chunk gap (one infinite gap for a failed request); a TPOT-less request (one token) is left out."""
    out: list[float] = []
    for r in results:
        if not r.ok:
            out.append(math.inf)
        elif metric == "itl":
            out.extend(r.itl_ms)
        else:
            v = r.tpot_ms if metric == "tpot" else getattr(r, f"{metric}_ms")
            if v is not None:
                out.append(v)
    return out


def judge(results: Sequence[RequestResult], slo: SLO) -> dict[str, Any]:
    """Verdict of one probe's (steady-state) requests against every SLO term."""
    terms: dict[str, Any] = {}
    verdicts = []
    for b in slo.bounds:
        v = bound_verdict(request_values(results, b.metric), b.stat, b.limit_ms, slo.confidence)
        terms[str(b)] = v
        verdicts.append(v)
    out: dict[str, Any] = {"terms": terms, "attainment": None, "attainment_ci": None}
    if slo.targets_ms:
        good = sum(meets_slo(r, slo.targets) for r in results)
        n = len(results)
        v = attainment_verdict(good, n, slo.attainment, slo.confidence)
        lo, hi = proportion_bounds(good, n, slo.confidence)
        out.update(attainment=good / n if n else None, attainment_ci=[lo, hi])
        terms[f"attainment>={slo.attainment:g}"] = v
        verdicts.append(v)
    out["verdict"] = combine_verdicts(verdicts)
    return out


def certain_miss(slo: SLO, ramp: int) -> Callable[[list[RequestResult], int], str | None] | None:
    """Early stop for a probe: stop once a term is `misses` even if every request still to finish met the SLO
    perfectly, so the cut never changes the verdict. Only per-request terms (percentiles of ttft/tpot/e2e and the
    attainment) can be decided this way; a mean or an ITL bound waits for the whole probe."""
    bounds = [b for b in slo.bounds if b.stat != "mean" and b.metric != "itl"]
    if not bounds and not slo.targets_ms:
        return None
    best = RequestResult(index=-1, prompt_tokens=1, output_tokens=2, ttft_ms=0.0, e2e_ms=0.0)

    def should_stop(finished: list[RequestResult], total: int) -> str | None:
        steady = [r for r in finished if r.index >= ramp]
        if len(steady) < 4:
            return None
        padded = steady + [best] * max(0, total - ramp - len(steady))
        missed = [str(b) for b in bounds
                  if bound_verdict(request_values(padded, b.metric), b.stat, b.limit_ms, slo.confidence) == MISSES]
        if slo.targets_ms:
            good = sum(meets_slo(r, slo.targets) for r in padded)
            if attainment_verdict(good, len(padded), slo.attainment, slo.confidence) == MISSES:
                missed.append(f"attainment>={slo.attainment:g}")
        if missed:
            return f"{', '.join(missed)} missed with confidence after {len(steady)} of {total - ramp} requests"
        return None

    return should_stop


# ----------------------------------------------------------------------------------------- the search --- #
def finish_s(r: RequestResult) -> float:
    """When a request finished (seconds from the run's start)."""
    return r.send_s + (r.e2e_ms or 0.0) / 1e3


def probe_summary(rate: float | None, results: list[RequestResult], duration_s: float, slo: SLO,
                  ramp: int) -> dict[str, Any]:
    steady = [r for r in results if r.index >= ramp]
    m = compute_metrics(steady, duration_s, slo.targets or None)
    j = judge(steady, slo)
    return {"rate_rps": rate, "n": len(steady), "ramp": ramp, "achieved_rps": m["requests_per_s"],
            "output_tokens_per_s": m["output_tokens_per_s"], "goodput_requests_per_s": m.get("goodput_requests_per_s"),
            "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "e2e_ms": m["e2e_ms"], "itl_ms": m["itl_ms"],
            "dispatch_lag_ms": m["dispatch_lag_ms"], "attainment": j["attainment"],
            "attainment_ci": j["attainment_ci"], "terms": j["terms"], "verdict": j["verdict"],
            "completed": m["completed"], "failed": m["failed"], "errors": m["errors"], "duration_s": duration_s}


class CapacitySearch:
    """Drives warm-up, saturation and rate probes through `run(requests, concurrency, timeout, should_stop)`,
    a function that serves a list of requests on the started engine and returns a tuner.loadgen.LoadResult."""

    def __init__(self, run: Callable[..., Any], pool: Sequence[Request], batch_cap: int, options: CapacityOptions,
                 log: Callable[[str], None] | None = None, start: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.pool, self.cap, self.o = run, list(pool), batch_cap, options
        self.log = log or (lambda s: None)
        self.clock = clock  # seconds; a simulated engine (tuner.predict) passes its virtual clock
        self.requests_used = 0
        self.probe_requests_used = 0  # the rate probes' share, which `max_requests` caps
        self.t0 = self.clock()
        self.notes: list[str] = []
        self.probes: list[dict[str, Any]] = []
        self.results_at: dict[float, list[RequestResult]] = {}
        self.cursor = start  # prompts of the pool already sent (a re-measure starts past the first measurement's)
        self.canaries: list[dict[str, Any]] = []
        self.marks: list[tuple[str, Snapshot]] = []  # the host's CPU accounting at the end of each step

    def mark(self, step: str) -> None:
        self.marks.append((step, snapshot()))

    def take(self, n: int) -> list[Request]:
        """The next `n` unused prompts; past the end of the pool (a short trace) prompts repeat, said once."""
        if not self.pool:
            raise RuntimeError("the workload has no requests")
        out = [self.pool[(self.cursor + i) % len(self.pool)] for i in range(n)]
        if self.cursor + n > len(self.pool) >= self.cursor:
            self.notes.append(f"the workload's {len(self.pool)} prompts were all sent by request {len(self.pool)}: "
                              "later requests repeat prompts, which a server with prompt caching serves from its cache")
        self.cursor += n
        return out

    # --------------------------------------------------------------------------------- steps --- #
    def warm_up(self) -> dict[str, Any]:
        n = self.o.warmup_count(self.cap)
        reqs = with_arrivals(self.take(n), None, self.o.arrival, self.o.seed)
        load = self.run(reqs, concurrency=self.cap, timeout_s=self.o.max_wall_s, should_stop=None)
        self.requests_used += n
        failed = [r for r in load.results if not r.ok]
        return {"n": n, "concurrency": self.cap, "failed": len(failed),
                "errors": sorted({r.error or "" for r in failed})[:3], "duration_s": load.duration_s}

    def canary(self, at: str) -> None:
        """The engine's speed at a full batch now: the median gap between streamed tokens (ITL) pooled over
        max(batch cap, `CANARY_RUNS`) copies of one fixed prompt (the warm-up's first, at most `CANARY_TOKENS` out),
        sent together at the batch cap (one at a time at cap 1) to the idle engine, so each decoding step is as wide
        as the capacity's: the median gap is one decoding step; the few gaps that waited for another copy's prefill
        are left in the tail (a median TPOT of 16 tokens carried them: it moved 13-20% on a quiet host). Measured
        before the saturation probe and after it and every rate probe: a capacity measured while the engine itself sped up or
        slowed down (another tenant on the host, a throttled device) differs from a re-measure by about as much,
        whatever the configuration. (A single request alone was tried first: a neighbour taking one of 2 cores cut
        the capacity at cap 16 by 30% and that request's TPOT by 3-12%. Before and after alone missed a neighbour
        that came during the saturation probe and left before the end: capacity -36%, canary -1%.)"""
        self.mark("the warm-up" if at == "start" else at.removeprefix("after "))
        prompt = replace(self.pool[0], max_tokens=min(self.pool[0].max_tokens, CANARY_TOKENS))
        reqs = with_arrivals([prompt] * max(self.cap, CANARY_RUNS), None, self.o.arrival, self.o.seed)
        load = self.run(reqs, concurrency=self.cap, timeout_s=self.o.max_wall_s, should_stop=None)
        self.requests_used += len(reqs)
        gaps = [g for r in load.results if r.ok for g in r.itl_ms]
        self.canaries.append({"at": at, "itl_ms": statistics.median(gaps) if gaps else None, "n": len(gaps),
                              "duration_s": load.duration_s})

    def canary_s(self) -> float:
        """How long a canary takes (as the first did, on the idle engine): the saturation probe leaves room for the
        one after it and the one after the first rate probe."""
        return self.canaries[0]["duration_s"] if self.canaries else 0.0

    def saturate(self) -> dict[str, Any]:
        """Closed loop at `c` in flight. The service rate is counted in steady state only: from the c-th completion
        (the initial fill has drained through) while the loop still keeps `c` in flight -- up to the moment it stops
        sending; the drain after the last send (fewer and fewer in flight, its length set by whichever requests
        came last) is left out. The probe stops sending once that window holds `steady_count` completions over at
        least `steady_s` seconds (or at `saturation_count` requests), or, on a slow engine, with `MIN_STEADY`
        completions in its window once going on would leave too little of the capacity budget for the first rate
        probe (at the rate measured so far) after the requests in flight: 32 completions of fp32 at batch cap 1 took
        90 s of an 80 s budget in `make demo`, and no rate was ever probed."""
        c = self.o.saturation_in_flight(self.cap)
        n = self.o.saturation_count(self.cap)
        want, want_s = self.o.steady_count(self.cap), self.o.steady_s

        def steady_enough(finished: list[RequestResult], total: int) -> str | None:
            ends = sorted(finish_s(r) for r in finished if r.ok)
            if len(ends) - c >= want and ends[-1] - ends[c - 1] >= want_s:
                return f"steady state measured: {len(ends) - c} completions over {ends[-1] - ends[c - 1]:.1f} s"
            if len(ends) - c >= MIN_STEADY:
                rate = (len(ends) - c) / max(ends[-1] - ends[c - 1], 1e-9)
                # then: the requests in flight, a canary, the first rate probe and its canary
                if (self.clock() - self.t0 + c / rate + 2 * self.canary_s() + self.first_probe_s(rate)
                        >= self.o.max_wall_s):
                    return (f"the first rate probe's budget reached: {len(ends) - c} completions over "
                            f"{ends[-1] - ends[c - 1]:.1f} s")
            return None

        reqs = with_arrivals(self.take(n), None, self.o.arrival, self.o.seed)
        load = self.run(reqs, concurrency=c, timeout_s=self.o.max_wall_s, should_stop=steady_enough)
        ok = sorted((r for r in load.results if r.ok), key=finish_s)
        ends = [finish_s(r) for r in ok]
        # the loop keeps `c` in flight until its last send (or the early stop, if that came first): completions
        # after it came from a draining engine
        last_send = load.last_send_s if load.last_send_s is not None else 0.0
        if load.stopped_reason and ends:
            last_send = min(last_send, ends[-1])
        window = [r for r in ok[c:] if finish_s(r) <= last_send]
        m = compute_metrics(load.results, load.duration_s)
        if len(ok) > c and window and last_send > ends[c - 1]:
            span = last_send - ends[c - 1]
            rate, tok = len(window) / span, sum(r.output_tokens for r in window) / span
            steady = {"completions": len(window), "seconds": span}
        else:  # too few requests for a steady window (a tiny --saturation-requests): the whole run's rate
            rate, tok, steady = m["requests_per_s"], m["output_tokens_per_s"], None
        self.requests_used += load.sent
        self.cursor -= n - load.sent  # prompts never sent stay fresh for the probes
        return {"concurrency": c, "n": load.sent, "max_requests": n, "requests_per_s": rate,
                "output_tokens_per_s": tok, "steady": steady, "completed": m["completed"], "failed": m["failed"],
                "errors": m["errors"], "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "e2e_ms": m["e2e_ms"],
                "itl_ms": m["itl_ms"], "dispatch_lag_ms": m["dispatch_lag_ms"], "duration_s": load.duration_s}

    def probe(self, rate: float) -> dict[str, Any]:
        """One rate: a first pass, then more requests (pooled) while undecided, up to the per-probe cap."""
        first, cap = self.o.probe_requests
        need = self.min_needed()
        n = min(max(first, need), cap)
        pooled: list[RequestResult] = []
        duration = 0.0
        ramp_total = 0
        stopped = None
        offset = 0
        while True:
            ramp = max(1, math.ceil(self.o.ramp_fraction * n))
            batch = self.take(n + ramp)
            reqs = with_arrivals(batch, rate, self.o.arrival, self.o.seed + offset)
            span = (reqs[-1].arrival_s or 0.0) if reqs else 0.0
            load = self.run(reqs, concurrency=None, timeout_s=2.0 * span + 60.0,
                            should_stop=certain_miss(self.o.slo, ramp))
            self.requests_used += len(reqs)
            self.probe_requests_used += len(reqs)
            offset += len(reqs)
            ramp_total += ramp
            duration += load.duration_s
            pooled += [r for r in load.results if r.index >= ramp]
            stopped = load.stopped_reason
            verdict = judge(pooled, self.o.slo)["verdict"]
            if verdict != INDETERMINATE or stopped or len(pooled) >= cap or self.out_of_budget(n / rate):
                break
            n = min(len(pooled), cap - len(pooled))  # double the sample, up to the cap
        for i, r in enumerate(pooled):
            r.index = i + 1  # renumbered: the pooled set has no ramp left in it
        summary = probe_summary(rate, pooled, duration, self.o.slo, ramp=0)
        summary.update(ramp=ramp_total, stopped_early=stopped, sent=offset)
        self.probes.append(summary)
        self.log(f"probe {rate:.3f} req/s: n={summary['n']} -> {summary['verdict']}"
                 + (f" ({stopped})" if stopped else ""))
        return summary

    def min_needed(self) -> int:
        """Requests a probe needs before `meets` is possible at all, for the most demanding SLO term."""
        qs = [float(b.stat[1:]) / 100 for b in self.o.slo.bounds if b.stat != "mean"]
        if self.o.slo.targets_ms:
            qs.append(float(self.o.slo.attainment))
        return max((min_samples_to_meet(q, self.o.slo.confidence) for q in qs), default=5)

    def first_probe_s(self, saturation_rps: float) -> float:
        """How long the first rate probe's first pass takes (it starts at FIRST_PROBE x the saturation rate)."""
        return self.o.probe_requests[0] / (FIRST_PROBE * saturation_rps)

    def out_of_budget(self, next_probe_s: float = 0.0) -> bool:
        left = self.o.max_wall_s - (self.clock() - self.t0)
        return self.probe_requests_used >= self.o.max_requests or left <= next_probe_s

    # --------------------------------------------------------------------------------- search --- #
    def search(self) -> dict[str, Any]:
        import scipy.stats  # noqa: F401 -- every verdict's statistics; its first import (~0.6 s) lands here, not
        # unplanned between the saturation probe and the first rate probe that the budget rules make room for

        o = self.o
        need = self.min_needed()
        if need > o.probe_requests[1]:
            hard = [str(b) for b in o.slo.bounds if b.stat != "mean"
                    and min_samples_to_meet(float(b.stat[1:]) / 100, o.slo.confidence) > o.probe_requests[1]]
            if o.slo.targets_ms and min_samples_to_meet(o.slo.attainment, o.slo.confidence) > o.probe_requests[1]:
                hard.append(f"attainment {o.slo.attainment:g}")
            self.notes.append(
                f"{', '.join(hard)} needs at least {need} requests per probe for a 'meets' at "
                f"{o.slo.confidence:.0%} confidence, but a probe may use {o.probe_requests[1]}: no rate can be shown "
                f"to meet it. Raise --probe-requests to {need} or more, or judge a lower percentile / attainment.")
        self.mark("")
        warm = self.warm_up()
        if warm["failed"] == warm["n"]:
            raise RuntimeError(f"every warm-up request failed: {warm['errors'][0] if warm['errors'] else '?'}")
        self.canary("start")
        sat = self.saturate()
        self.canary("after the saturation probe")
        self.log(f"saturation ({sat['concurrency']} in flight, n={sat['n']}): {sat['requests_per_s']:.3f} req/s")
        out: dict[str, Any] = {"warmup": warm, "saturation": sat}
        if sat["completed"] == 0 or not sat["requests_per_s"]:
            raise RuntimeError(f"no request completed in the saturation probe: "
                               f"{sat['errors'][0] if sat['errors'] else 'no tokens'}")
        high = sat["requests_per_s"]  # an open-loop rate above the service rate is not sustainable
        low = 0.0
        low_probe: dict[str, Any] | None = None
        rate = FIRST_PROBE * high
        floor = high / 64.0
        while len(self.probes) < o.max_probes and not self.out_of_budget(o.probe_requests[0] / rate):
            p = self.probe(rate)
            self.canary(f"after the {rate:.3g} req/s probe")
            if p["verdict"] == MEETS:
                low, low_probe = rate, p
            else:
                high = rate
                if p["verdict"] == INDETERMINATE:
                    self.notes.append(f"{rate:.3g} req/s stayed indeterminate after {p['n']} requests: "
                                      "counted as not shown to meet the SLO")
            if low > 0 and high - low <= o.tolerance * high:
                break
            rate = (low + high) / 2.0 if low > 0 else rate / 2.0
            if rate < floor:
                break
        else:
            if len(self.probes) < o.max_probes:
                self.notes.append(f"capacity budget spent ({self.requests_used} requests, "
                                  f"{self.clock() - self.t0:.0f} s): the bracket is wider than {o.tolerance:.0%}")
        canary = engine_drift(self.canaries, self.notes)
        self.mark("the last canary")
        host = load_by_step(self.marks, self.notes)
        if low_probe is not None:
            verdict = MEETS
        elif self.probes and all(p["verdict"] == MISSES for p in self.probes):
            verdict = MISSES
        else:
            verdict = INDETERMINATE
        if verdict == MISSES:
            self.notes.append(f"the SLO is missed with confidence even at {min(p['rate_rps'] for p in self.probes):.3g}"
                              " req/s, the lowest rate probed")
        # the interval's upper end is decided too: the lowest rate above `low` shown to miss (an indeterminate rate,
        # which lowered the bracket, may still be sustainable), or the saturation rate
        missed = [p["rate_rps"] for p in self.probes if p["verdict"] == MISSES and p["rate_rps"] > low]
        out.update({
            "requests_per_s": low,
            "requests_per_s_ci": [low, min(missed, default=sat["requests_per_s"])],
            "output_tokens_per_s": low_probe["output_tokens_per_s"] if low_probe else None,
            "goodput_requests_per_s": low_probe.get("goodput_requests_per_s") if low_probe else None,
            "verdict": verdict,
            "slo": o.slo.to_dict(),
            "canary": canary,
            "host": host,
            "probes": sorted(self.probes, key=lambda p: p["rate_rps"]),
            "cost": {"requests": self.requests_used, "probes": len(self.probes),
                     "wall_s": self.clock() - self.t0},
            "notes": self.notes,
            "min_requests_to_meet": need,
            "method": {"probe_requests": list(o.probe_requests), "max_probes": o.max_probes,
                       "tolerance": o.tolerance, "ramp_fraction": o.ramp_fraction, "arrival": o.arrival,
                       "confidence": o.slo.confidence},
        })
        return out


def measure_capacity(run: Callable[..., Any], pool: Sequence[Request], batch_cap: int, options: CapacityOptions,
                     log: Callable[[str], None] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """`CapacitySearch.search()`, measured again once when the conditions moved under it -- its canary says the
    engine's own speed moved by more than `DRIFT_NOTE` (a neighbour arrived or left, a device throttled), or other
    processes and the hypervisor took more than `HOST_BUSY` of the host during a step (a neighbour present
    throughout, which no canary sees) -- and what is left of `max_wall_s` holds a second measurement as long as the
    first: more evidence instead of a figure known to be off. The re-measure sends the next unused prompts of
    `pool` (size it with `pool_size(cap, measurements=2)`); its canary is the same prompt as the first's. The
    figure kept is the attempt measured under the steadiest conditions (the smallest `disturbance`), and
    `remeasured` lists both; `cost` counts both."""
    log = log or (lambda s: None)
    first = CapacitySearch(run, pool, batch_cap, options, log, clock=clock)
    result = first.search()
    why = disturbed(result)
    if why is None:
        return result
    spent = result["cost"]["wall_s"]
    left = options.max_wall_s - spent
    if left < spent:
        result["notes"].append(f"not re-measured: {max(left, 0):.0f} s of the capacity budget left, the measurement "
                               f"took {spent:.0f} s (a longer --capacity-timeout re-measures a moved engine)")
        return result
    log(f"{why} during the measurement: measuring again")
    again = CapacitySearch(run, pool, batch_cap, replace(options, max_wall_s=left), log, start=first.cursor,
                           clock=clock).search()
    attempts = [result, again]
    k = min(range(2), key=lambda i: disturbance(attempts[i]))
    kept = attempts[k]
    kept["notes"].insert(0, (
        f"measured twice: {why} under the first measurement ({result['requests_per_s']:.3g} req/s); the "
        f"{('first', 'second')[k]}'s, measured under the steadiest conditions ({describe_conditions(kept)}), "
        "is reported"))
    kept["remeasured"] = {"kept": k, "attempts": [
        {"requests_per_s": a["requests_per_s"], "requests_per_s_ci": a["requests_per_s_ci"], "verdict": a["verdict"],
         "canary": a["canary"], "host": a["host"], "saturation_rps": a["saturation"]["requests_per_s"],
         "probes": a["cost"]["probes"], "requests": a["cost"]["requests"], "wall_s": a["cost"]["wall_s"],
         "notes": a["notes"] if a is not kept else []} for a in attempts]}
    kept["cost"] = {key: result["cost"][key] + again["cost"][key] for key in ("requests", "probes", "wall_s")}
    return kept


def conditions(result: dict[str, Any]) -> tuple[float | None, float | None]:
    """A measurement's conditions: its canary's drift and the busiest step's share of the host taken by other
    processes and the hypervisor (None where not measured)."""
    busiest = (result.get("host") or {}).get("busiest")
    return result["canary"]["drift"], busy_share(busiest) if busiest else None


def disturbance(result: dict[str, Any]) -> float:
    """How far a measurement's conditions moved: its canary's |drift| plus its busiest step's host share (a sum:
    two measurements under one neighbour that stayed are told apart by their canaries; infinite without a canary
    figure: nothing says the engine held)."""
    drift, busy = conditions(result)
    return (math.inf if drift is None else abs(drift)) + (busy or 0.0)


def disturbed(result: dict[str, Any]) -> str | None:
    """Why a measurement deserves a second one, or None."""
    drift, busy = conditions(result)
    if drift is not None and abs(drift) > DRIFT_NOTE:
        return f"the engine's speed moved {drift:+.0%}"
    if busy is not None and busy > HOST_BUSY:
        return f"the host was busy ({busy:.0%} taken by others during {result['host']['busiest']['step']})"
    return None


def describe_conditions(result: dict[str, Any]) -> str:
    drift, busy = conditions(result)
    return ", ".join([f"canary {'-' if drift is None else f'{drift:+.0%}'}"]
                     + ([f"host {busy:.0%} busy at most"] if busy is not None else []))


FIRST_PROBE = 0.75  # the first rate probed, as a share of the saturation rate
MIN_STEADY = 8  # completions the saturation's steady window needs even on a slow engine
DRIFT_NOTE = 0.10  # a move of the engine's own speed during one measurement worth saying
CANARY_RUNS = 3  # requests per canary at least (their gaps pooled); the batch cap's worth on wider engines
CANARY_TOKENS = 16  # output tokens per canary request at most (15 gaps each; a canary runs after every step)


def engine_drift(canaries: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The canaries of one measurement (`CapacitySearch.canary`, in order), with `drift` = the largest move of the
    engine's speed from its median over the measurement (median ITL / that ITL - 1: negative = slower then) and a
    note when it moved by more than `DRIFT_NOTE`. (The first canary as the reference carried its own noise into
    every comparison: three quiet runs moved 8, 9 and 14% from their first canary, 7, 6 and 11% from the median.)"""
    out: dict[str, Any] = {"itl_ms": [c["itl_ms"] for c in canaries], "n": [c["n"] for c in canaries],
                           "at": [c["at"] for c in canaries], "drift": None}
    steps = [c["itl_ms"] for c in canaries if c["itl_ms"]]
    typical = statistics.median(steps) if len(steps) >= 2 else None
    moves = [(typical / c["itl_ms"] - 1, c) for c in canaries if typical and c["itl_ms"]]
    if moves:
        out["drift"], worst = max(moves, key=lambda m: abs(m[0]))
        if abs(out["drift"]) > DRIFT_NOTE:
            notes.append(f"the engine's speed moved {out['drift']:+.0%} during this measurement (its canary, the "
                         f"same batch of one prompt: ITL p50 {worst['itl_ms']:.1f} ms {worst['at']}, "
                         f"{typical:.1f} typically: the host's other load, the device or the engine's own state "
                         "changed): a re-measure may differ by as much")
    return out


def machine_drift(before_gbs: float | None, after_gbs: float | None, canary: dict[str, Any] | None) -> dict[str, Any]:
    """What moved under a capacity measurement: `drift` is the engine canary's (the speed of the engine itself,
    what the capacity moves with), with the host's memory bandwidth before and after (CPU serving only) as context:
    on a shared host that probe alone moves by a third while the capacity holds, so it says nothing by itself."""
    return {"memory_bandwidth_gbs": [before_gbs, after_gbs], "drift": (canary or {}).get("drift")}


def capacity_point(capacity: dict[str, Any]) -> dict[str, Any] | None:
    """The probe at the capacity rate (None when no rate meets)."""
    rate = capacity.get("requests_per_s")
    return next((p for p in capacity.get("probes", []) if rate and p["rate_rps"] == rate), None)


def bound_value_at(capacity: dict[str, Any], bound: Bound) -> float | None:
    """A bound's metric at the capacity point, or at the lowest rate probed when no rate meets."""
    p = capacity_point(capacity)
    if p is None:
        probes = capacity.get("probes") or []
        p = min(probes, key=lambda q: q["rate_rps"]) if probes else capacity.get("saturation")
    if not p:
        return None
    return (p.get(f"{bound.metric}_ms") or {}).get(bound.stat)
