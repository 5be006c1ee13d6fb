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
   shown to meet (it lowers the upper end; the answer says so). The first rate is 75% of that bound, or
   `start_rps` when given below it (a predicted capacity: `tuner search --strategy predict` verifies a tail SLO
   there with one long probe, then one above or below it). Below the first meeting rate the search halves
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
8. **The host's other load** (tuner.measure.host): the CPU the host's other processes and its hypervisor took during
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
attempts: [{requests_per_s, canary, ...}]}}`, and from tuner.measure.bench `machine: {memory_bandwidth_gbs: [before,
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

from tuner.measure.host import HOST_BUSY, Snapshot, busy_share, load_by_step, snapshot
from tuner.measure.metrics import RequestResult, compute_metrics, meets_slo
from tuner.measure.workload import Request, with_arrivals
from tuner.slo import SLO, Bound
from tuner.stats import (
    INDETERMINATE,
    MEETS,
    MISSES,
    attainment_verdict,
    bound_verdict,
    combine_verdicts,
    effective_n,
    min_samples_to_meet,
    proportion_bounds,
)

DEFAULT_PROBE_REQUESTS = (30, 120)  # the least first pass and cap of a probe sized by its percentile
DEFAULT_TIMEOUT_S = 600.0  # one capacity measurement's budget (`--capacity-timeout`)


@dataclass(frozen=True)
class CapacityOptions:
    """Every capacity setting and its default: the one home (`tuner bench` flags, a search's trials and its space
    file's `capacity:` section read their defaults from here)."""

    slo: SLO
    probe_requests: tuple[int, int] = DEFAULT_PROBE_REQUESTS  # a probe's first pass (at least what its percentile needs), and
    # its cap after one more pass at an undecided rate
    max_probes: int = 5  # open-loop probes (the saturation probe not counted); the lower bound's alpha is spent
    # over all of them
    max_requests: int = 600  # the rate probes together, lead-ins included (the warm-up and saturation, sized by the
    # batch cap, come on top: a server with 128 slots needs its 128-request warm-up and a saturation beyond 128)
    max_wall_s: float = DEFAULT_TIMEOUT_S  # no new probe starts past this (a started probe may run to its own time limit)
    tolerance: float = 0.1  # stop when (high - low) <= tolerance * high
    ramp_fraction: float = 0.1  # a probe's lead-in is at least this share of its measured requests
    arrival: str = "poisson"
    seed: int = 0
    saturation_requests: int | None = None  # most the saturation probe sends; default 2 x (in-flight + steady_count)
    steady_s: float = 10.0  # the saturation probe's steady window lasts this long at least
    start_rps: float | None = None  # the first rate probed (a predicted capacity: tuner search --strategy predict);
    # None, or at or above the saturation rate: FIRST_PROBE x the saturation rate

    def __post_init__(self) -> None:
        from tuner.errors import TunerError

        lo, hi = self.probe_requests
        if lo < 4 or hi < lo:
            raise TunerError(f"--probe-requests {lo}:{hi} is invalid: expected A:B with 4 <= A <= B")
        if self.max_probes < 1:
            raise TunerError(f"--max-probes {self.max_probes} is invalid: expected an integer >= 1")
        if not 0 < self.tolerance < 1:
            raise TunerError(f"capacity tolerance {self.tolerance} is invalid: expected a number in (0, 1)")
        if self.start_rps is not None and not self.start_rps > 0:
            raise TunerError(f"capacity start rate {self.start_rps} is invalid: expected a rate > 0 req/s (or none)")

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

    def look_confidence(self) -> float:
        """The confidence of each look: every rate probe may look `LOOKS_PER_PROBE` times (its first pass, one more
        at an undecided rate), and each end of the capacity interval is one-sided at half the SLO's alpha, spent
        over all `max_probes` x `LOOKS_PER_PROBE` looks (Bonferroni): the interval holds at the SLO's confidence
        whichever probe and look decided each end."""
        alpha = 1.0 - self.slo.confidence
        return 1.0 - alpha / (2 * self.max_probes * LOOKS_PER_PROBE)

    def stop_confidence(self) -> float:
        """A probe's early stop tests after every completion, up to its cap: each check at the look's alpha divided
        by the checks it may make."""
        return 1.0 - (1.0 - self.look_confidence()) / self.probe_requests[1]

    def pool_size(self, batch_cap: int, measurements: int = 1) -> int:
        """Prompts `measurements` capacity measurements may send, each once: warm-up, saturation, the rate probes'
        budget and the last probe's overshoot (a probe that starts under budget may take its full cap plus a
        lead-in per pass, each at most the cap); `measure_capacity` may measure twice."""
        last = (LOOKS_PER_PROBE + 1) * self.probe_requests[1]
        one = self.warmup_count(batch_cap) + self.saturation_count(batch_cap) + self.max_requests + last
        return measurements * one


def requests_to_show(slo: SLO, look_confidence: float) -> int:
    """Requests a probe needs before `meets` is possible at all (every one within), for the most demanding SLO term
    at the per-look confidence: p90 needs 57 at 95% over the default 5 probes x 2 looks, p99 597."""
    qs = [float(b.stat[1:]) / 100 for b in slo.bounds if b.stat != "mean"]
    if slo.targets_ms:
        qs.append(float(slo.attainment))
    return max((min_samples_to_meet(q, look_confidence) for q in qs), default=5)


def probe_requests_for(slo: SLO, max_probes: int, given: tuple[int, int] | None) -> tuple[int, int]:
    """A probe's size: as given, or following the SLO's percentile -- a first pass of what the percentile needs
    (at least `DEFAULT_PROBE_REQUESTS`'s first) and a cap of twice that (at least its cap)."""
    if given is not None:
        return given
    first, cap = DEFAULT_PROBE_REQUESTS
    need = requests_to_show(slo, CapacityOptions(slo=slo, max_probes=max_probes).look_confidence())
    return max(first, need), max(cap, 2 * need)


# ------------------------------------------------------------------------------------- probe verdicts --- #
def request_values(results: Sequence[RequestResult], metric: str) -> list[float]:
    """Per-request values of a metric for a verdict, in the results' order: failed requests count as infinitely
    late; ITL gives each request's own mean gap (the unit of evidence is a request: the gaps of one request share
    its batch and are not independent); a request without the metric (one token: no TPOT, no gap) is left out."""
    out: list[float] = []
    for r in results:
        if not r.ok:
            out.append(math.inf)
        elif metric == "itl":
            if r.itl_ms:
                out.append(sum(r.itl_ms) / len(r.itl_ms))
        else:
            v = r.tpot_ms if metric == "tpot" else getattr(r, f"{metric}_ms")
            if v is not None:
                out.append(v)
    return out


def term_verdict(results: Sequence[RequestResult], b: Bound, confidence: float, correlated: bool = False) -> str:
    """One SLO bound's verdict. A percentile of ITL (vLLM's pooled gaps) is judged per request: each request's share
    of gaps within the limit (0 for a failed request), their sum against the number of requests -- n is the requests,
    not the gaps, which would count one request's correlated gaps as independent evidence. `correlated`: the
    requests are judged on their effective sample size (`tuner.stats.effective_n`), not their count."""
    if b.metric == "itl" and b.stat != "mean":
        shares = [0.0 if not r.ok else sum(g <= b.limit_ms for g in r.itl_ms) / len(r.itl_ms)
                  for r in results if not r.ok or r.itl_ms]
        if not shares:
            return INDETERMINATE
        k, n = sum(shares), float(len(shares))
        if correlated:
            n_eff = effective_n(shares)
            k, n = k * n_eff / n, n_eff
        return attainment_verdict(k, n, float(b.stat[1:]) / 100, confidence)
    return bound_verdict(request_values(results, b.metric), b.stat, b.limit_ms, confidence, correlated=correlated)


def judge(results: Sequence[RequestResult], slo: SLO, confidence: float | None = None,
          correlated: bool = False) -> dict[str, Any]:
    """Verdict of one probe's (steady-state) requests, in send order, against every SLO term, each at `confidence`
    (default: the SLO's; the capacity search passes its per-look confidence). The requests of one probe share a
    queue and are not independent: the search makes each probe span several relaxation times of that queue
    (`CapacitySearch.window`) before its verdict may be `meets`, and near saturation (`correlated`, see
    `CapacitySearch.near_saturation`) judges them on their effective sample size."""
    conf = slo.confidence if confidence is None else confidence
    terms: dict[str, Any] = {}
    verdicts = []
    for b in slo.bounds:
        v = term_verdict(results, b, conf, correlated)
        terms[str(b)] = v
        verdicts.append(v)
    out: dict[str, Any] = {"terms": terms, "attainment": None, "attainment_ci": None}
    if slo.targets_ms:
        good = sum(meets_slo(r, slo.targets) for r in results)
        n = len(results)
        if correlated and n:
            n_eff = effective_n([float(meets_slo(r, slo.targets)) for r in results])
            v = attainment_verdict(good * n_eff / n, n_eff, slo.attainment, conf)
        else:
            v = attainment_verdict(good, n, slo.attainment, conf)
        lo, hi = proportion_bounds(good, n, conf)
        out.update(attainment=good / n if n else None, attainment_ci=[lo, hi])
        terms[f"attainment>={slo.attainment:g}"] = v
        verdicts.append(v)
    out["verdict"] = combine_verdicts(verdicts)
    return out


def certain_miss(slo: SLO, ramp: int, confidence: float | None = None
                 ) -> Callable[[list[RequestResult], int], str | None] | None:
    """Early stop for a probe: stop once a term is `misses` even if every request still to finish met the SLO
    perfectly, so the cut never changes the verdict. Only per-request terms (percentiles of ttft/tpot/e2e and the
    attainment) can be decided this way; a mean or an ITL bound waits for the whole probe. The test is re-run after
    every completion: `confidence` is per check (the capacity search divides its per-look alpha by the checks a
    probe may make)."""
    conf = slo.confidence if confidence is None else confidence
    bounds = [b for b in slo.bounds if b.stat != "mean" and b.metric != "itl"]
    if not bounds and not slo.targets_ms:
        return None
    best = RequestResult(index=-1, prompt_tokens=1, output_tokens=2, ttft_ms=0.0, e2e_ms=0.0)
    # Counted as the requests finish (the finished list only grows between calls; anything else is counted afresh):
    # per bound the steady requests with a value and those within its limit, and those meeting every target --
    # what bound_verdict and attainment_verdict decide on -- so a check costs O(new requests), not O(finished).
    pad_within = [bool(request_values([best], b.metric)) and request_values([best], b.metric)[0] <= b.limit_ms
                  for b in bounds]
    pad_good = bool(slo.targets_ms) and meets_slo(best, slo.targets)
    state: dict[str, Any] = {"seen": 0, "last": None, "steady": 0, "n": [0] * len(bounds),
                             "k": [0] * len(bounds), "good": 0}
    verdicts: dict[tuple[float, float, float], str] = {}

    def verdict(k: float, n: float, q: float) -> str:
        if (k, n, q) not in verdicts:
            verdicts[k, n, q] = attainment_verdict(k, n, q, conf)
        return verdicts[k, n, q]

    def count(finished: list[RequestResult]) -> None:
        seen = state["seen"]
        if seen > len(finished) or (seen and finished[seen - 1] is not state["last"]):
            state.update(seen=0, steady=0, n=[0] * len(bounds), k=[0] * len(bounds), good=0)
            seen = 0
        for r in finished[seen:]:
            if r.index < ramp:
                continue
            state["steady"] += 1
            for i, b in enumerate(bounds):
                for v in request_values([r], b.metric):
                    state["n"][i] += 1
                    state["k"][i] += v <= b.limit_ms
            if slo.targets_ms:
                state["good"] += meets_slo(r, slo.targets)
        state["seen"], state["last"] = len(finished), finished[-1] if finished else None

    def should_stop(finished: list[RequestResult], total: int) -> str | None:
        count(finished)
        steady = state["steady"]
        if steady < 4:
            return None
        pad = max(0, total - ramp - steady)
        missed = [str(b) for i, b in enumerate(bounds)
                  if state["n"][i] + pad > 0 and verdict(state["k"][i] + pad * pad_within[i], state["n"][i] + pad,
                                                         float(b.stat.lstrip("p")) / 100.0) == MISSES]
        if slo.targets_ms and verdict(state["good"] + pad * pad_good, steady + pad, slo.attainment) == MISSES:
            missed.append(f"attainment>={slo.attainment:g}")
        if missed:
            return f"{', '.join(missed)} missed with confidence after {steady} of {total - ramp} requests"
        return None

    return should_stop


def unsteady(results: Sequence[RequestResult], slo: SLO) -> str | None:
    """Why a probe's measured requests were not in steady state, or None: the SLO's statistic of a metric it bounds
    rose from the probe's first half (by send time) to its second by more than `STEADY_RISE` of itself and of the
    SLO's limit (a rise of a few ms far below a limit of seconds is no queue that matters), and a one-sided
    Mann-Whitney test says the second half's values are larger (p < `STEADY_P`): the queue was still building when
    the probe ended, so the latencies it measured are better than the rate sustains. Too few requests (< 2 x
    `STEADY_MIN`) to compare: None."""
    import numpy as np
    from scipy.stats import mannwhitneyu, norm

    ordered = sorted(results, key=lambda r: r.send_s)
    half = len(ordered) // 2
    if half < STEADY_MIN:
        return None
    checks = [(b.metric, 0.5 if b.stat == "mean" else float(b.stat[1:]) / 100, b.limit_ms) for b in slo.bounds]
    checks += [(key.removesuffix("_ms"), float(slo.attainment), limit) for key, limit in slo.targets_ms]
    for metric, q, limit in checks:
        first = request_values(ordered[:half], metric)
        second = request_values(ordered[half:], metric)
        if len(first) < STEADY_MIN or len(second) < STEADY_MIN:
            continue
        v1, v2 = (float(np.quantile(np.asarray(x), q, method="inverted_cdf")) for x in (first, second))
        if not (v2 > v1 * (1 + STEADY_RISE) and v2 - v1 > STEADY_RISE * limit):
            continue
        fin = [x if math.isfinite(x) else 1e300 for x in first], [x if math.isfinite(x) else 1e300 for x in second]
        # the halves' values are correlated in time: the test's z shrinks by sqrt(n_eff / n) (its variance grows
        # by the autocorrelation time, taken around the trend), so a slow stretch that a stable queue recovers from
        # is not read as a trend
        z = float(norm.isf(mannwhitneyu(fin[1], fin[0], alternative="greater").pvalue))
        both = first + second
        p = float(norm.sf(z * math.sqrt(effective_n(both, detrend=True) / len(both))))
        if p < STEADY_P:
            shown = f"{v2:.0f} ms" if math.isfinite(v2) else "failures"
            return (f"{metric} p{q * 100:g} rose from {v1:.0f} ms in the probe's first half to {shown} in its second "
                    f"(n={len(first)}, {len(second)}; Mann-Whitney p={p:.2g}): the queue was still building")
    return None


# ----------------------------------------------------------------------------------------- the search --- #
def saturation_upper(completions: int, seconds: float, confidence: float) -> float | None:
    """A one-sided upper bound on the service rate from `completions` counted over `seconds` (exact Poisson bound:
    chi2(confidence, 2(k + 1)) / 2 per span). A closed loop at saturation completes more regularly than a Poisson
    process, so the bound is conservative (wider than it need be), never narrower."""
    from scipy.stats import chi2

    if seconds <= 0:
        return None
    return float(chi2.ppf(confidence, 2 * (completions + 1))) / 2.0 / seconds


def finish_s(r: RequestResult) -> float:
    """When a request finished (seconds from the run's start)."""
    return r.send_s + (r.e2e_ms or 0.0) / 1e3


def steady_duration_s(results: Sequence[RequestResult]) -> float:
    """A pass's measured span: from its first measured request's send (not the lead-in's first) to the last measured
    completion -- the throughput at a rate counts only the requests it measured over the time they took."""
    ends = [finish_s(r) for r in results if r.ok]
    if not results or not ends:
        return 0.0
    return max(ends) - min(r.send_s for r in results)


def probe_summary(rate: float | None, results: list[RequestResult], duration_s: float, slo: SLO,
                  ramp: int, confidence: float | None = None, correlated: bool = False) -> dict[str, Any]:
    steady = [r for r in results if r.index >= ramp]
    m = compute_metrics(steady, duration_s, slo.targets or None)
    j = judge(steady, slo, confidence, correlated)
    return {"rate_rps": rate, "n": len(steady), "ramp": ramp, "achieved_rps": m["requests_per_s"],
            "output_tokens_per_s": m["output_tokens_per_s"], "goodput_requests_per_s": m.get("goodput_requests_per_s"),
            "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "e2e_ms": m["e2e_ms"], "itl_ms": m["itl_ms"],
            "dispatch_lag_ms": m["dispatch_lag_ms"], "attainment": j["attainment"],
            "attainment_ci": j["attainment_ci"], "terms": j["terms"], "verdict": j["verdict"],
            "completed": m["completed"], "failed": m["failed"], "errors": m["errors"], "duration_s": duration_s}


class CapacitySearch:
    """Drives warm-up, saturation and rate probes through `run(requests, concurrency, timeout, should_stop)`,
    a function that serves a list of requests on the started engine and returns a tuner.measure.loadgen.LoadResult."""

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
        self.sat_rps = 0.0  # the saturation probe's steady completion rate, once measured
        self.marks: list[tuple[str, Snapshot]] = []  # the host's CPU accounting at the end of each step

    def mark(self, step: str) -> None:
        if self.clock is time.monotonic:  # on a virtual clock (a simulated engine) this host's CPU says nothing
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
        k = len(window) if steady else m["completed"]
        span_s = steady["seconds"] if steady else load.duration_s
        return {"concurrency": c, "n": load.sent, "max_requests": n, "requests_per_s": rate,
                "requests_per_s_upper": saturation_upper(k, span_s, self.o.look_confidence()),
                "output_tokens_per_s": tok, "steady": steady, "completed": m["completed"], "failed": m["failed"],
                "errors": m["errors"], "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "e2e_ms": m["e2e_ms"],
                "itl_ms": m["itl_ms"], "dispatch_lag_ms": m["dispatch_lag_ms"], "duration_s": load.duration_s}

    def lead_in(self, rate: float, n: int) -> int | None:
        """Arrivals sent at `rate` before a pass's measured requests, so the pass measures the queue that rate
        builds, not an idle engine draining it: one relaxation time of the engine seen as one server of the
        saturation rate mu at utilisation rho = rate / mu, scaled by the variability of arrivals and service as in
        the heavy-traffic (diffusion) approximation: ((ca^2 + cs^2) / 2) / (mu (1 - sqrt(rho))^2) -- M/M/1's time
        constant of the approach to steady state from empty when ca = cs = 1 (`variability`) -- and at least
        `ramp_fraction` of the pass. Poisson arrivals and 24:48 output tokens: 23 arrivals at 0.75 x mu, 58 at
        0.83, 188 at 0.9, 555 at 0.94. None when it exceeds the probe's cap: so close to saturation that no probe
        within the budget reaches the steady state, and the rate is not claimed."""
        rho = rate / self.sat_rps
        if rho >= 1.0:
            return None
        lead = max(1, math.ceil(self.o.ramp_fraction * n), math.ceil(rate * self.relax_s(rate)))
        return lead if lead <= self.o.probe_requests[1] and self.window(rate) <= self.o.probe_requests[1] else None

    def window(self, rate: float) -> int:
        """Measured requests a probe needs at `rate` before it may say `meets`: `WINDOW_RELAX` relaxation times of
        the queue. Latencies within one relaxation time rise and fall together (a burst makes its neighbours late
        too), so a shorter window is one draw of the queue, however many requests it holds; over several, the
        share within the SLO is close to the steady state's."""
        rho = rate / self.sat_rps
        if rho >= 1.0:
            return math.inf  # type: ignore[return-value]
        return math.ceil(WINDOW_RELAX * rate * self.relax_s(rate))

    def near_saturation(self, rate: float) -> bool:
        """A rate whose queue needs a window longer than a default probe's cap (above ~81% of saturation with
        Poisson arrivals and 24:48 output tokens): its requests are judged on their effective sample size. Up to
        there the coverage benchmark holds the independent-count verdict to its confidence (0.5% of 200 simulated
        searches claimed above the truth); beyond it, with the cap raised, 13 of 60 did (the queue's slow swings
        make a window's requests far from independent), 1 of 60 judged on the effective sample size."""
        return self.window(rate) > DEFAULT_PROBE_REQUESTS[1]

    def relax_s(self, rate: float) -> float:
        rho = rate / self.sat_rps
        return self.variability() / (self.sat_rps * (1.0 - math.sqrt(rho)) ** 2)

    def variability(self) -> float:
        """(ca^2 + cs^2) / 2: ca^2 = 1 for Poisson arrivals (a trace's too, unknown), 0 for constant ones; cs^2 the
        squared coefficient of variation of the requests' output lengths (decoding dominates a request's service),
        at least `MIN_SERVICE_CV2` for the engine's own step-time noise. Computed once (the pool is fixed)."""
        if getattr(self, "_variability", None) is None:
            ca2 = 0.0 if self.o.arrival == "constant" else 1.0
            outs = [r.max_tokens for r in self.pool[:2000]]
            mean = statistics.fmean(outs) if outs else 0.0
            cs2 = statistics.pvariance(outs) / mean ** 2 if mean > 0 and len(outs) > 1 else 0.0
            self._variability = (ca2 + max(cs2, MIN_SERVICE_CV2)) / 2.0
        return self._variability

    def first_pass(self, rate: float | None = None) -> int:
        first, cap = self.o.probe_requests
        return min(max(first, self.min_needed(), self.window(rate) if rate and self.sat_rps else 0), cap)

    def probe(self, rate: float, lead: int) -> dict[str, Any]:
        """One rate: a pass of `lead` arrivals (left out) then `first_pass()` measured ones, and while undecided one
        more pass (its own lead-in) up to the cap, pooled: at most `LOOKS_PER_PROBE` looks, each at the per-look
        confidence. A pass whose latencies still rose from its first half to its second (`unsteady`) is not
        steady: the probe cannot be `meets` (it says `indeterminate`, with the reason)."""
        cap = self.o.probe_requests[1]
        conf = self.o.look_confidence()
        n = self.first_pass(rate)
        near = self.near_saturation(rate)
        pooled: list[RequestResult] = []
        duration = 0.0
        leads = 0
        stopped = None
        why_unsteady = None
        offset = 0
        for _look in range(LOOKS_PER_PROBE):
            batch = self.take(lead + n)
            reqs = with_arrivals(batch, rate, self.o.arrival, self.o.seed + offset)
            span = (reqs[-1].arrival_s or 0.0) if reqs else 0.0
            load = self.run(reqs, concurrency=None, timeout_s=2.0 * span + 60.0,
                            should_stop=certain_miss(self.o.slo, lead, self.o.stop_confidence()))
            self.requests_used += len(reqs)
            self.probe_requests_used += len(reqs)
            offset += len(reqs)
            leads += lead
            measured = [r for r in load.results if r.index >= lead]
            duration += steady_duration_s(measured)
            pooled += measured
            stopped = load.stopped_reason
            why_unsteady = why_unsteady or (None if stopped else unsteady(measured, self.o.slo))
            verdict = judge(pooled, self.o.slo, conf, near)["verdict"]
            if (verdict != INDETERMINATE or stopped or why_unsteady or len(pooled) >= cap
                    or self.out_of_budget((lead + n) / rate)):
                break
            n = cap - len(pooled)
        for i, r in enumerate(pooled):
            r.index = i + 1  # renumbered: the pooled set has no lead-in left in it
        summary = probe_summary(rate, pooled, duration, self.o.slo, ramp=0, confidence=conf, correlated=near)
        summary.update(ramp=leads, stopped_early=stopped, sent=offset)
        if near:
            summary["judged_on"] = "effective sample size (near saturation)"
        if why_unsteady:
            summary["unsteady"] = why_unsteady
            if summary["verdict"] == MEETS:
                summary["verdict"] = INDETERMINATE
        self.probes.append(summary)
        self.log(f"probe {rate:.3f} req/s: n={summary['n']} (+{leads} lead-in) -> {summary['verdict']}"
                 + (f" ({stopped})" if stopped else "") + (f" ({why_unsteady})" if why_unsteady else ""))
        return summary

    def min_needed(self) -> int:
        """Requests a probe needs before `meets` is possible at all, for the most demanding SLO term."""
        return requests_to_show(self.o.slo, self.o.look_confidence())

    def first_probe_s(self, saturation_rps: float) -> float:
        """How long the first rate probe's first pass takes (it starts at FIRST_PROBE x the saturation rate), its
        lead-in included."""
        n = self.first_pass()
        rate = FIRST_PROBE * saturation_rps
        relax = self.variability() / (saturation_rps * (1.0 - math.sqrt(FIRST_PROBE)) ** 2)
        lead = max(1, math.ceil(self.o.ramp_fraction * n), math.ceil(rate * relax))
        return (min(lead, self.o.probe_requests[1]) + n) / rate

    def probe_s(self, rate: float) -> float | None:
        """How long a probe's first pass at `rate` takes, its lead-in included (None: not probed so close to
        saturation)."""
        n = self.first_pass(rate)
        lead = self.lead_in(rate, n)
        return None if lead is None else (lead + n) / rate

    def affordable_rate(self, rate: float, high: float) -> float | None:
        """The lowest rate in [`rate`, `high`) whose probe fits what is left of the budget (the bracket's tolerance
        below `high`), or None."""
        top = high * (1.0 - self.o.tolerance)
        if top <= rate:
            return None
        for i in range(1, 33):
            r = rate * (top / rate) ** (i / 32)
            t = self.probe_s(r)
            if t is not None and not self.out_of_budget(t):
                return r
        return None

    def out_of_budget(self, next_probe_s: float = 0.0) -> bool:
        left = self.o.max_wall_s - (self.clock() - self.t0)
        return self.probe_requests_used >= self.o.max_requests or left <= next_probe_s

    # --------------------------------------------------------------------------------- search --- #
    def search(self) -> dict[str, Any]:
        import scipy.stats  # noqa: F401 -- every verdict's statistics; its first import (~0.6 s) lands here, not
        # unplanned between the saturation probe and the first rate probe that the budget rules make room for

        o = self.o
        need = self.min_needed()
        look = o.look_confidence()
        if need > o.probe_requests[1]:
            hard = [str(b) for b in o.slo.bounds if b.stat != "mean"
                    and min_samples_to_meet(float(b.stat[1:]) / 100, look) > o.probe_requests[1]]
            if o.slo.targets_ms and min_samples_to_meet(o.slo.attainment, look) > o.probe_requests[1]:
                hard.append(f"attainment {o.slo.attainment:g}")
            self.notes.append(
                f"{', '.join(hard)} needs at least {need} requests per probe for a 'meets' at "
                f"{o.slo.confidence:.0%} confidence over the search's {o.max_probes * LOOKS_PER_PROBE} looks "
                f"({look:.4f} each), but a probe may use {o.probe_requests[1]}: no rate can be shown "
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
        self.sat_rps = sat["requests_per_s"]
        high = sat["requests_per_s"]  # an open-loop rate above the service rate is not sustainable
        low = 0.0
        low_probe: dict[str, Any] | None = None
        rate = o.start_rps if o.start_rps and o.start_rps < high else FIRST_PROBE * high
        floor = high / 64.0
        unreached: list[float] = []  # rates too close to saturation for a probe to reach their steady state
        while len(self.probes) < o.max_probes:
            n = self.first_pass(rate)
            lead = self.lead_in(rate, n)
            if lead is None:
                unreached.append(rate)
                high = rate  # the search's bracket, not the interval: nothing was shown to miss here
            elif self.out_of_budget((lead + n) / rate):
                # a lower rate takes longer to probe (its requests arrive more slowly): a higher one inside the
                # bracket may still fit what is left of the budget
                fits = self.affordable_rate(rate, high)
                if fits is None:
                    self.notes.append(f"capacity budget spent ({self.requests_used} requests, "
                                      f"{self.clock() - self.t0:.0f} s): the bracket is wider than {o.tolerance:.0%}")
                    break
                self.notes.append(f"{rate:.3g} req/s would not fit the capacity budget left: {fits:.3g} req/s "
                                  "probed instead, the lowest rate in the bracket that does")
                rate = fits
                continue
            else:
                p = self.probe(rate, lead)
                self.canary(f"after the {rate:.3g} req/s probe")
                if p["verdict"] == MEETS:
                    low, low_probe = rate, p
                else:
                    high = rate
                    if p["verdict"] == INDETERMINATE:
                        self.notes.append(f"{rate:.3g} req/s stayed indeterminate after {p['n']} requests"
                                          + (f" ({p['unsteady']})" if p.get("unsteady") else "")
                                          + ": counted as not shown to meet the SLO")
            if low > 0 and high - low <= o.tolerance * high:
                break
            if low > 0:
                rate = (low + high) / 2.0
            elif self.probes and self.probes[-1]["rate_rps"] == rate and self.probes[-1]["verdict"] == MISSES:
                rate /= 2.0  # shown to miss: the capacity may be far below
            else:
                rate *= UNDECIDED_STEP  # not shown either way (or not probed): it may lie just below
            if rate < floor:
                break
        if unreached:
            r = min(unreached)
            self.notes.append(
                f"{r:.3g} req/s and above not probed: at {r / self.sat_rps:.0%} of the saturation rate the queue needs "
                f"about {math.ceil(r * self.relax_s(r))} arrivals to reach its steady state and "
                f"{self.window(r)} measured ones to span {WINDOW_RELAX:g} relaxation times, more than a probe's "
                f"{o.probe_requests[1]}; a short probe there measures an engine that has not queued yet, or one "
                "draw of its queue (raise --probe-requests to claim rates closer to saturation)")
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
            # nothing above shown to miss: the saturation rate's upper bound (no open-loop rate above the service
            # rate is sustained)
            "requests_per_s_ci": [low, min(missed, default=sat.get("requests_per_s_upper") or sat["requests_per_s"])],
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
                       "start_rps": o.start_rps,
                       "confidence": o.slo.confidence, "looks": o.max_probes * LOOKS_PER_PROBE,
                       "look_confidence": look,
                       "interval": "each end one-sided at half the alpha, spent over every probe and look "
                                   "(Bonferroni); lead-in by the relaxation time; unsteady probes not claimed"},
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
    if drift is not None and abs(drift) > result["canary"].get("threshold", DRIFT_NOTE):
        return f"the engine's speed moved {drift:+.0%}"
    if busy is not None and busy > HOST_BUSY:
        return f"the host was busy ({busy:.0%} taken by others during {result['host']['busiest']['step']})"
    return None


def describe_conditions(result: dict[str, Any]) -> str:
    drift, busy = conditions(result)
    return ", ".join([f"canary {'-' if drift is None else f'{drift:+.0%}'}"]
                     + ([f"host {busy:.0%} busy at most"] if busy is not None else []))


FIRST_PROBE = 0.75  # the first rate probed, as a share of the saturation rate
UNDECIDED_STEP = 0.7  # below a rate not shown to meet nor to miss (nothing shown to meet yet), the next rate's share
LOOKS_PER_PROBE = 2  # a probe's first pass, and one more pass while undecided
STEADY_RISE = 0.25  # a probe's second half worse than its first by more than this share of it and of the limit ...
STEADY_P = 0.05  # ... with a one-sided Mann-Whitney p below this: the queue was still building
STEADY_MIN = 8  # requests per half at least for that comparison
WINDOW_RELAX = 3.0  # relaxation times a probe's measured requests span at least
MIN_SERVICE_CV2 = 0.1  # the least squared coefficient of variation of a request's service time a lead-in assumes
MIN_STEADY = 8  # completions the saturation's steady window needs even on a slow engine
DRIFT_NOTE = 0.10  # the least move of the engine's own speed during one measurement worth saying
CANARY_NOISE_K = 3.0  # a canary move past this many robust spreads of the measurement's canaries is the engine's
CANARY_RUNS = 3  # requests per canary at least (their gaps pooled); the batch cap's worth on wider engines
CANARY_TOKENS = 16  # output tokens per canary request at most (15 gaps each; a canary runs after every step)


def engine_drift(canaries: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The canaries of one measurement (`CapacitySearch.canary`, in order), with `drift` = the largest move of the
    engine's speed from its median over the measurement (median ITL / that ITL - 1: negative = slower then), and
    `threshold`, the move worth a note and a re-measure, set from the canaries' own noise: `CANARY_NOISE_K` x their
    robust spread (1.4826 x the median |move|, which one moved canary does not inflate), never below `DRIFT_NOTE`.
    (The first canary as the reference carried its own noise into every comparison: three quiet runs moved 8, 9
    and 14% from their first canary, 7, 6 and 11% from the median; a fixed 10% re-measured most quiet runs.)"""
    out: dict[str, Any] = {"itl_ms": [c["itl_ms"] for c in canaries], "n": [c["n"] for c in canaries],
                           "at": [c["at"] for c in canaries], "drift": None, "threshold": DRIFT_NOTE}
    steps = [c["itl_ms"] for c in canaries if c["itl_ms"]]
    typical = statistics.median(steps) if len(steps) >= 2 else None
    moves = [(typical / c["itl_ms"] - 1, c) for c in canaries if typical and c["itl_ms"]]
    if moves:
        spread = 1.4826 * statistics.median(abs(m) for m, _ in moves)
        out["threshold"] = max(DRIFT_NOTE, CANARY_NOISE_K * spread)
        out["drift"], worst = max(moves, key=lambda m: abs(m[0]))
        if abs(out["drift"]) > out["threshold"]:
            notes.append(f"the engine's speed moved {out['drift']:+.0%} during this measurement (its canary, the "
                         f"same batch of one prompt: ITL p50 {worst['itl_ms']:.1f} ms {worst['at']}, "
                         f"{typical:.1f} typically; past its own noise, {out['threshold']:.0%}: the host's other "
                         "load, the device or the engine's own state changed): a re-measure may differ by as much")
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
