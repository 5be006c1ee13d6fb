"""Latency targets and SLOs: `300ms`, `ttft:p99`, `"ttft:p99<300ms;tpot:p50<50ms"`, durations like `20m`.

A bound is a hard constraint on one percentile of one latency metric of a bench run: metric in ttft, tpot, itl, e2e;
percentile in p50, p90, p95, p99 (or mean). Values carry units (ms or s); a bare number is an error, since
"300" could mean either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tuner.errors import TunerError

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("p50", "p90", "p95", "p99", "mean")
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_BOUND = re.compile(r"^\s*([a-z0-9]+)\s*:\s*([a-z0-9]+)\s*<\s*(.+?)\s*$")


@dataclass(frozen=True)
class Bound:
    """`metric:stat < limit_ms` on a bench run."""

    metric: str
    stat: str
    limit_ms: float

    @property
    def key(self) -> str:
        return f"{self.metric}:{self.stat}"

    def __str__(self) -> str:
        return f"{self.key}<{self.limit_ms:g}ms"

    def value(self, metrics: dict[str, Any]) -> float | None:
        """The bound's metric from a bench `metrics` dict (None when the run has no such value)."""
        summary = metrics.get(f"{self.metric}_ms") or {}
        return summary.get(self.stat)


def parse_time_ms(text: str, what: str = "latency target") -> float:
    """'300ms' -> 300.0, '1.5s' -> 1500.0. A bare number or another unit is an error."""
    m = _TIME.match(str(text))
    if not m:
        raise TunerError(f"{what} {text!r} is invalid: expected a number with a unit, ms or s (e.g. 300ms, 1.5s)")
    value = float(m.group(1)) * (1000.0 if m.group(2) == "s" else 1.0)
    if value <= 0:
        raise TunerError(f"{what} {text!r} is invalid: expected a time > 0")
    return value


def parse_metric(text: str) -> tuple[str, str]:
    """'ttft:p99' -> ('ttft', 'p99')."""
    parts = str(text).strip().lower().split(":")
    if len(parts) != 2 or parts[0] not in METRICS or parts[1] not in STATS:
        raise TunerError(f"latency metric {text!r} is invalid: expected METRIC:STAT with METRIC in "
                         f"{', '.join(METRICS)} and STAT in {', '.join(STATS)} (e.g. ttft:p99)")
    return parts[0], parts[1]


def parse_slo(text: str) -> list[Bound]:
    """'ttft:p99<300ms;tpot:p50<50ms' -> [Bound, Bound]. Separators: ';' or ','."""
    bounds: list[Bound] = []
    items = [s for s in re.split(r"[;,]", str(text)) if s.strip()]
    if not items:
        raise TunerError(f"SLO {text!r} is empty: expected METRIC:STAT<TIME[;...] (e.g. ttft:p99<300ms;tpot:p50<50ms)")
    for item in items:
        m = _BOUND.match(item.lower())
        if not m:
            raise TunerError(f"SLO term {item.strip()!r} is invalid: expected METRIC:STAT<TIME (e.g. ttft:p99<300ms)")
        metric, stat = parse_metric(f"{m.group(1)}:{m.group(2)}")
        bounds.append(Bound(metric, stat, parse_time_ms(m.group(3), f"SLO bound in {item.strip()!r}")))
    keys = [b.key for b in bounds]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise TunerError(f"SLO {text!r} bounds {', '.join(dup)} twice: expected each METRIC:STAT once")
    return bounds


def parse_duration_s(text: str, what: str = "--timeout") -> float:
    """'20m' -> 1200.0; units s, m, h."""
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise TunerError(f"{what} {text!r} is invalid: expected a duration > 0 with a unit s, m or h (e.g. 20m)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def build_bounds(latency_target: str | None, latency_metric: str, slo: str | None) -> tuple[Bound, list[Bound]]:
    """The primary bound (the latency target on the latency metric, an objective) and every hard bound."""
    metric, stat = parse_metric(latency_metric)
    bounds = parse_slo(slo) if slo else []
    if latency_target is not None:
        primary = Bound(metric, stat, parse_time_ms(latency_target))
        bounds = [b for b in bounds if b.key != primary.key] + [primary]
    else:
        if not bounds:
            raise TunerError("no latency target: give --latency-target (e.g. 300ms) or --slo (e.g. ttft:p99<300ms)")
        primary = next((b for b in bounds if b.key == f"{metric}:{stat}"), bounds[0])
    return primary, bounds
