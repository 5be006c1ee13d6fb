"""The numeric fields of a trial that a chart axis can use ('capacity.requests_per_s', 'ttft_ms.p99',
'quality.score', 'config.batch_cap', ...), their order, labels and directions (larger is better or worse)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.dashboard.study import CAPACITY, THROUGHPUT, StudyInfo, TrialView, has_capacity

# Fields that are worse when larger (chart directions); everything latency-like ("..._ms...") is too.
_MINIMIZE = ("failed", "peak_rss_mb", "peak_cuda_mb", "cost_per_million_tokens", "quality.drop_pp",
             "quality.kld_mean", "quality.kld_p99", "duration_s", "capacity.cost.requests", "capacity.cost.wall_s",
             "capacity.cost.probes")
_MAXIMIZE = (THROUGHPUT, "requests_per_s", "goodput_requests_per_s", "completed", "acceptance_rate",
             "quality.score", "quality.top1_agree", "roofline.percent_of_bound", "capacity.requests_per_s",
             "capacity.output_tokens_per_s", "capacity.goodput_requests_per_s", "capacity.saturation.requests_per_s",
             "capacity.saturation.output_tokens_per_s")
_SKIP_FIELDS = ("quality.limit", "quality.seed", "quality.baseline_score", "quality.score_stderr")
_LATENCY = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numeric leaves of nested dicts, keys joined with '.' (booleans and lists are left out)."""
    out: dict[str, float] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def trial_fields(v: TrialView) -> dict[str, float]:
    """Every numeric value of a trial a chart axis can use: metrics ('ttft_ms.p99', 'output_tokens_per_s',
    'roofline.percent_of_bound'), quality ('quality.score', 'quality.tasks.arc_easy.acc'), the numeric knobs
    ('config.batch_cap', 'config.kv_fraction'), capacity ('capacity.requests_per_s',
    'capacity.saturation.requests_per_s'), cost and duration. Sample counts ('.n') are left out."""
    r = v.row
    out = {k: x for k, x in flatten({k: m for k, m in r.metrics.items() if k != "capacity"}).items()
           if not k.endswith(".n")}
    if v.capacity:
        out.update({k: x for k, x in flatten({k: c for k, c in v.capacity.items() if k != "slo"}, "capacity.").items()
                    if not k.endswith(".n")})
    out.update({k: x for k, x in flatten(r.quality, "quality.").items()
                if k not in _SKIP_FIELDS and not k.endswith((".n", "_stderr")) and not k.startswith("quality.gate.")})
    out.update({f"config.{k}": x for k, x in flatten(r.config).items()})
    if isinstance(r.cost, (int, float)) and math.isfinite(r.cost):
        out["cost_per_million_tokens"] = float(r.cost)
    if v.duration_s is not None:
        out["duration_s"] = v.duration_s
    out["trial"] = float(v.number)
    return out


def axis_fields(views: Sequence[TrialView], info: StudyInfo | None = None) -> list[str]:
    """Fields present in at least one trial: throughput and the study's latency metric first, then the other
    latency percentiles, then the rest alphabetically."""
    seen: set[str] = set()
    for v in views:
        seen.update(trial_fields(v))
    first = [CAPACITY, "quality.score", THROUGHPUT] if has_capacity(views) else [THROUGHPUT]
    if info and info.latency_field:
        first.append(info.latency_field)
    first += [f"{m}_ms.{s}" for m in _LATENCY for s in ("p50", "p90", "p95", "p99", "mean")]
    first += ["requests_per_s", "quality.score", "capacity.output_tokens_per_s", "capacity.goodput_requests_per_s"]
    ordered = [f for f in dict.fromkeys(first) if f in seen]
    return ordered + sorted(seen - set(ordered))


def default_axes(fields: Sequence[str], info: StudyInfo | None, by_capacity: bool) -> tuple[str, str]:
    """The chart's default (x, y): capacity vs quality score for a study measured by capacity (vs its latency at
    capacity when quality was not scored); latency vs output tok/s for an older study."""
    lat = info.latency_field if info else None

    def first(*choices: str | None) -> str:
        return next((c for c in choices if c and c in fields), fields[0])

    if by_capacity and CAPACITY in fields:
        return CAPACITY, first("quality.score", lat, THROUGHPUT, "trial")
    return first(lat), first(THROUGHPUT)


def field_label(f: str) -> str:
    """'ttft_ms.p99' -> 'TTFT p99 (ms)', 'output_tokens_per_s' -> 'output tok/s', 'config.batch_cap' -> 'batch cap'."""
    m = re.fullmatch(r"([a-z0-9]+)_ms\.([a-z0-9]+)", f)
    if m and m.group(1) in _LATENCY:
        return f"{_LATENCY[m.group(1)]} {m.group(2)} (ms)"
    special = {THROUGHPUT: "output tok/s", "requests_per_s": "requests/s", "quality.score": "quality score",
               "cost_per_million_tokens": "$ per 1M output tokens", "duration_s": "trial duration (s)",
               "trial": "trial number", "peak_rss_mb": "peak RSS (MB)", "peak_cuda_mb": "peak CUDA memory (MB)",
               "quality.drop_pp": "quality drop (pp)", "acceptance_rate": "draft acceptance rate",
               CAPACITY: "capacity (req/s)", "capacity.output_tokens_per_s": "output tok/s at capacity",
               "capacity.goodput_requests_per_s": "goodput at capacity (req/s)",
               "capacity.saturation.requests_per_s": "saturation (req/s, closed loop)",
               "capacity.saturation.output_tokens_per_s": "saturation output tok/s (closed loop)",
               "capacity.cost.wall_s": "capacity search wall time (s)"}
    if f in special:
        return special[f]
    if f.startswith("capacity."):
        return f[len("capacity."):].replace("_", " ").replace(".", " ") + " (capacity search)"
    if f.startswith("config."):
        return f[len("config."):].replace("_", " ")
    return f.replace("_", " ")


def direction(f: str) -> str | None:
    """'max' or 'min' when larger is better or worse for this field; None for knobs and neutral fields."""
    if f in _MAXIMIZE or (f.startswith("quality.tasks.") and f.endswith(".acc")):
        return "max"
    if f in _MINIMIZE or re.fullmatch(r"[a-z0-9]+_ms\.[a-z0-9]+", f):
        return "min"
    return None
