"""Latency targets and SLOs: `300ms`, `ttft:p99`, `"ttft:p99<300ms;tpot:p50<50ms"`, `"ttft<300ms;tpot<50ms"`,
durations like `20m`.

Two kinds of terms, mixable in one SLO:
* a *bound* on one percentile (or the mean) of one latency metric over a run: `METRIC:STAT<TIME`, metric in ttft,
  tpot, itl, e2e; stat in p50, p90, p95, p99, mean;
* a *per-request target* `METRIC<TIME` (ttft, tpot, e2e): a request is good when it meets every target, and the
  SLO holds when the share of good requests (attainment, DistServe/GuideLLM style) is at least `--attainment`.
Values carry units (ms or s); a bare number is an error, since "300" could mean either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tuner.errors import TunerError
from tuner.stats import DEFAULT_CONFIDENCE

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("p50", "p90", "p95", "p99", "mean")
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")
_DURATION = re.compile(r"\s*((?:\d+(?:\.\d+)?[hms])+)\s*")  # 20m, 90s, 1.5h, 7m30s, 1h30m
_BOUND = re.compile(r"^\s*([a-z0-9]+)\s*:\s*([a-z0-9]+)\s*<\s*(.+?)\s*$")
_TARGET = re.compile(r"^\s*([a-z0-9]+)\s*<\s*(.+?)\s*$")
REQUEST_METRICS = ("ttft", "tpot", "e2e")
DEFAULT_ATTAINMENT = 0.95
# the latency metric a bare --latency-target bounds: p90, which a probe of 57 requests can show at 95% over the
# capacity search's looks (p99 needs ~600 per probe: minutes per rate on a small engine; ask for it explicitly)
DEFAULT_LATENCY_METRIC = "ttft:p90"


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


def parse_slo_terms(text: str) -> tuple[list[Bound], dict[str, float]]:
    """'ttft:p99<300ms;tpot<50ms' -> ([Bound ttft:p99], {'tpot_ms': 50.0}). Separators: ';' or ','."""
    bounds: list[Bound] = []
    targets: dict[str, float] = {}
    items = [s for s in re.split(r"[;,]", str(text)) if s.strip()]
    if not items:
        raise TunerError(f"SLO {text!r} is empty: expected METRIC:STAT<TIME or METRIC<TIME terms separated by ';' "
                         "(e.g. ttft:p99<300ms;tpot:p50<50ms or ttft<300ms;tpot<50ms)")
    for item in items:
        m = _BOUND.match(item.lower())
        if m:
            metric, stat = parse_metric(f"{m.group(1)}:{m.group(2)}")
            bounds.append(Bound(metric, stat, parse_time_ms(m.group(3), f"SLO bound in {item.strip()!r}")))
            continue
        t = _TARGET.match(item.lower())
        if not t or t.group(1) not in REQUEST_METRICS:
            raise TunerError(f"SLO term {item.strip()!r} is invalid: expected METRIC:STAT<TIME (e.g. ttft:p99<300ms) "
                             f"or a per-request target METRIC<TIME with METRIC in {', '.join(REQUEST_METRICS)}")
        key = f"{t.group(1)}_ms"
        if key in targets:
            raise TunerError(f"SLO {text!r} sets the per-request target {t.group(1)} twice: expected it once")
        targets[key] = parse_time_ms(t.group(2), f"SLO target in {item.strip()!r}")
    keys = [b.key for b in bounds]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise TunerError(f"SLO {text!r} bounds {', '.join(dup)} twice: expected each METRIC:STAT once")
    return bounds, targets


def parse_slo(text: str) -> list[Bound]:
    """'ttft:p99<300ms;tpot:p50<50ms' -> [Bound, Bound] (percentile bounds only)."""
    bounds, targets = parse_slo_terms(text)
    if targets:
        raise TunerError(f"SLO {text!r}: per-request targets ({', '.join(targets)}) are not accepted here: expected "
                         "METRIC:STAT<TIME bounds only")
    return bounds


def parse_attainment(value: float | None) -> float | None:
    if value is None:
        return None
    if not 0.0 < float(value) < 1.0:
        raise TunerError(f"--attainment {value!r} is invalid: expected a share in (0, 1), e.g. 0.95")
    return float(value)


def parse_confidence(value: float) -> float:
    if not 0.5 < float(value) < 1.0:
        raise TunerError(f"--confidence {value!r} is invalid: expected a number in (0.5, 1), e.g. 0.95")
    return float(value)


@dataclass(frozen=True)
class SLO:
    """Everything a measurement is judged against: percentile bounds, per-request targets with the attainment
    share they must reach, and the confidence every verdict is taken at."""

    bounds: tuple[Bound, ...] = ()
    targets_ms: tuple[tuple[str, float], ...] = ()  # (("ttft_ms", 300.0), ...)
    attainment: float | None = None
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self) -> None:
        if not self.bounds and not self.targets_ms:
            raise TunerError("the SLO is empty: give --latency-target (e.g. 300ms) or --slo (e.g. ttft:p99<300ms)")
        if self.targets_ms and self.attainment is None:
            object.__setattr__(self, "attainment", DEFAULT_ATTAINMENT)

    @property
    def targets(self) -> dict[str, float]:
        return dict(self.targets_ms)

    def terms(self) -> list[str]:
        """Human-readable terms, bounds first: ['ttft:p99<300ms', '95% of requests: ttft<300ms, tpot<50ms']."""
        out = [str(b) for b in self.bounds]
        if self.targets_ms:
            t = ", ".join(f"{k.removesuffix('_ms')}<{v:g}ms" for k, v in self.targets_ms)
            out.append(f"{self.attainment:.0%} of requests: {t}")
        return out

    def __str__(self) -> str:
        return "; ".join(self.terms())

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": [str(b) for b in self.bounds], "targets_ms": self.targets, "attainment": self.attainment,
                "confidence": self.confidence}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SLO:
        bounds = tuple(parse_slo(";".join(d.get("bounds") or []))) if d.get("bounds") else ()
        return cls(bounds, tuple((d.get("targets_ms") or {}).items()), d.get("attainment"),
                   float(d.get("confidence", DEFAULT_CONFIDENCE)))


def build_slo(latency_target: str | None, latency_metric: str, slo: str | None, attainment: float | None = None,
              confidence: float = DEFAULT_CONFIDENCE) -> tuple[Bound | None, SLO]:
    """The primary bound (latency target on the latency metric; None when the SLO has only per-request targets)
    and the whole SLO."""
    metric, stat = parse_metric(latency_metric)
    bounds, targets = parse_slo_terms(slo) if slo else ([], {})
    attainment = parse_attainment(attainment)
    confidence = parse_confidence(confidence)
    primary: Bound | None
    if latency_target is not None:
        primary = Bound(metric, stat, parse_time_ms(latency_target))
        bounds = [b for b in bounds if b.key != primary.key] + [primary]
    else:
        if not bounds and not targets:
            raise TunerError("no latency target: give --latency-target (e.g. 300ms) or --slo (e.g. ttft:p99<300ms)")
        primary = next((b for b in bounds if b.key == f"{metric}:{stat}"), bounds[0] if bounds else None)
    if attainment is not None and not targets:
        raise TunerError(f"--attainment {attainment:g} needs per-request targets: expected --slo with METRIC<TIME "
                         "terms (e.g. --slo 'ttft<300ms;tpot<50ms' --attainment 0.95)")
    return primary, SLO(tuple(bounds), tuple(targets.items()), attainment, confidence)


def parse_duration_s(text: str, what: str = "--timeout") -> float:
    """'20m' -> 1200.0, '7m30s' -> 450.0; units s, m, h."""
    m = _DURATION.fullmatch(str(text))
    total = sum(float(v) * {"s": 1, "m": 60, "h": 3600}[u]
                for v, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", m.group(1))) if m else 0.0
    if total <= 0:
        raise TunerError(f"{what} {text!r} is invalid: expected a duration > 0 with units s, m or h (e.g. 20m, "
                         "7m30s)")
    return total
