"""Per-request results and the pure `compute_metrics` over them (vLLM benchmark conventions, units in names).

TTFT counts from the request's *scheduled* arrival (open loop: its place in the arrival process; closed loop: the
moment a slot freed), so time queued in the engine and the harness's own dispatch lag are both included
(coordinated omission counted); `dispatch_lag_ms` records scheduled -> actually handed to the engine. E2E runs
from the same scheduled arrival to the last token. TPOT of a request is (E2E - TTFT) / (output_tokens - 1), so it
excludes the first token. ITL follows vLLM's `benchmark_serving` convention: one gap per streamed chunk after the
first (a chunk carrying several tokens, e.g. accepted draft tokens, is one gap, not padded with zeros).

Every percentile object carries its sample count `n` and a distribution-free 95% confidence interval per
percentile (`ci`, order statistics, see tuner.stats; a side is None when n is too small for it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 95, 99)
CI_LEVEL = 0.95


@dataclass
class RequestResult:
    """What one request saw. Never raises: an error is recorded in `error`."""

    index: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    error: str | None = None
    send_s: float = 0.0  # scheduled arrival, seconds from the run start
    dispatch_lag_ms: float | None = None  # scheduled arrival -> handed to the engine
    chunks: int = 0  # streamed chunks received
    harness_overhead_ms: float | None = None  # harness-seen first token minus the engine's own first-token stamp
    draft_proposed: int = 0
    draft_accepted: int = 0
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.e2e_ms is None or self.ttft_ms is None:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_ms"] = self.tpot_ms
        return d


def summarize(values: Sequence[float], confidence: float = CI_LEVEL) -> dict[str, Any]:
    """p50/p90/p95/p99 (linear interpolation, as numpy.percentile) and mean, the count `n`, and `ci`: a two-sided
    distribution-free interval per percentile at `confidence` ([lower, upper], a side None when n is too small).
    Percentiles and mean are None for an empty input."""
    from tuner.stats import quantile_ci

    xs = sorted(float(v) for v in values)
    out: dict[str, Any] = {}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p) if xs else None
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    out["ci"] = {f"p{p}": list(quantile_ci(xs, p / 100.0, confidence)) if xs else [None, None] for p in PERCENTILES}
    return out


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile of an already sorted, non-empty sequence."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    rank = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (rank - lo)


def meets_slo(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    """Per-request SLO check for goodput: every named per-request metric (ttft_ms, tpot_ms, e2e_ms) within bound."""
    if not r.ok:
        return False
    for key, bound in slo_ms.items():
        value = r.tpot_ms if key == "tpot_ms" else getattr(r, key)
        if value is not None and value > bound:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult], duration_s: float, slo_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """Aggregate request results over a run of `duration_s` seconds (first send to last completion)."""
    done = [r for r in results if r.ok]
    failed = len(results) - len(done)
    total_out = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    proposed = sum(r.draft_proposed for r in results)
    accepted = sum(r.draft_accepted for r in results)
    overhead = [r.harness_overhead_ms for r in done if r.harness_overhead_ms is not None]
    lag = [r.dispatch_lag_ms for r in results if r.dispatch_lag_ms is not None]
    metrics: dict[str, Any] = {
        "ttft_ms": summarize([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": summarize([t for r in done if (t := r.tpot_ms) is not None]),
        "itl_ms": summarize([x for r in done for x in r.itl_ms]),
        "e2e_ms": summarize([r.e2e_ms for r in done if r.e2e_ms is not None]),
        "output_tokens_per_s": total_out / duration_s,
        "requests_per_s": len(done) / duration_s,
        "completed": len(done),
        "failed": failed,
        "total_output_tokens": total_out,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "duration_s": duration_s,
        "acceptance_rate": accepted / proposed if proposed else None,
        "draft_proposed": proposed,
        "draft_accepted": accepted,
        "harness_overhead_ms": summarize(overhead),
        "dispatch_lag_ms": summarize(lag),
    }
    if slo_ms:
        good = sum(1 for r in results if meets_slo(r, slo_ms))
        metrics["goodput_requests_per_s"] = good / duration_s
        metrics["slo_ms"] = dict(slo_ms)
    errors = sorted({r.error for r in results if r.error})
    metrics["errors"] = errors[:5]
    return metrics
