"""A study as the dashboard reads it: its settings (`StudyInfo`, from the user_attrs `tuner search` writes), the SLO's
limits per field, and its trials as `TrialView`s (tuner.search.answer's Row plus what only the dashboard shows).

Everything here takes trials as Optuna gives them (`study.get_trials()`: objects with `number`, `state`, `params`,
`values`, `user_attrs`, `datetime_start`, `datetime_complete`) and returns plain values. Studies measured by capacity
(`capacity` user attr: the highest request rate meeting the SLO, with its CI, verdict and probes) carry it on each
view; older studies (output tok/s at one fixed arrival rate) still read from `metrics`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.dashboard.curves import capacity_attr, num
from tuner.errors import TunerError
from tuner.search.answer import Row, rows_from_study

THROUGHPUT = "output_tokens_per_s"
CAPACITY = "capacity.requests_per_s"
FINISHED = ("COMPLETE", "PRUNED", "FAIL")


@dataclass(frozen=True)
class StudyInfo:
    """What the dashboard needs from a study's user_attrs (written by `tuner search`)."""

    name: str
    model: str | None = None
    primary: str | None = None  # "ttft:p99<3000ms"
    latency_metric: str | None = None  # "ttft:p99"
    latency_target_ms: float | None = None
    bounds: tuple[str, ...] = ()
    constraint_names: tuple[str, ...] = ()
    recommended_trial: int | None = None
    max_quality_drop: float | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    slo: Mapping[str, Any] = field(default_factory=dict)  # as capacity.slo: bounds, targets_ms, attainment, ...

    @property
    def latency_field(self) -> str | None:
        """The flattened field of the latency metric, e.g. 'ttft_ms.p99'; for an SLO of per-request targets only,
        the first target's metric at the attainment's percentile ('ttft_ms.p90' for ttft<2s met by 90%)."""
        if self.latency_metric:
            return metric_field(self.latency_metric)
        share = num(self.slo.get("attainment"))
        key = next(iter(self.slo.get("targets_ms") or {}), None)
        stat = f"p{round(100 * share)}" if share else None
        return f"{key}.{stat}" if key and stat in ("p50", "p90", "p95", "p99") else None

    @property
    def from_search(self) -> bool:
        return bool(self.constraint_names and (self.primary or self.slo))


def metric_field(metric: str) -> str | None:
    """'ttft:p99' -> 'ttft_ms.p99' (None when it is not METRIC:STAT)."""
    m = re.fullmatch(r"\s*([a-z0-9]+)\s*:\s*([a-z0-9]+)\s*", metric or "")
    return f"{m.group(1)}_ms.{m.group(2)}" if m else None


def study_info(name: str, attrs: Mapping[str, Any]) -> StudyInfo:
    primary = attrs.get("primary")
    metric = attrs.get("latency_metric")
    if not metric and isinstance(primary, str) and "<" in primary:
        metric = primary.split("<", 1)[0]
    target = attrs.get("latency_target_ms")
    rec = attrs.get("recommended_trial")
    return StudyInfo(
        name=name, model=attrs.get("model"), primary=primary if isinstance(primary, str) else None,
        latency_metric=metric if isinstance(metric, str) else None,
        latency_target_ms=float(target) if isinstance(target, (int, float)) else None,
        bounds=tuple(str(b) for b in attrs.get("bounds") or ()),
        constraint_names=tuple(str(c) for c in attrs.get("constraint_names") or ()),
        recommended_trial=int(rec) if isinstance(rec, int) else None,
        max_quality_drop=attrs.get("max_quality_drop"), attrs=dict(attrs),
        slo=dict(attrs["slo"]) if isinstance(attrs.get("slo"), Mapping) else {})


def bound_lines(info: StudyInfo) -> dict[str, list[tuple[float, str]]]:
    """Field -> [(limit ms, label)] for the latency target and every latency bound of the study (its `bounds`, or
    `slo.bounds`), and, for an attainment SLO (`slo.targets_ms` met by a share `slo.attainment` of requests), the
    per-request target on every percentile of that metric."""
    from tuner.slo import parse_slo

    out: dict[str, list[tuple[float, str]]] = {}
    texts = list(info.bounds) or [str(b) for b in info.slo.get("bounds") or ()] or (
        [info.primary] if info.primary else [])
    for text in texts:
        try:
            bounds = parse_slo(text)
        except TunerError:
            continue
        for b in bounds:
            f = f"{b.metric}_ms.{b.stat}"
            label = ("latency target " if b.key == info.latency_metric else "bound ") + str(b)
            if all(v != b.limit_ms for v, _ in out.get(f, [])):
                out.setdefault(f, []).append((b.limit_ms, label))
    share = num(info.slo.get("attainment"))
    for key, limit in (info.slo.get("targets_ms") or {}).items():
        if num(limit) is None or not str(key).endswith("_ms"):
            continue
        label = f"per-request target {key[:-3]}<{limit:g}ms" + (f" for {share:.0%} of requests" if share else "")
        for stat in ("p50", "p90", "p95", "p99", "mean"):
            if all(v != limit for v, _ in out.get(f"{key}.{stat}", [])):
                out.setdefault(f"{key}.{stat}", []).append((float(limit), label))
    if info.latency_field and info.latency_target_ms and info.latency_field not in out:
        out[info.latency_field] = [(info.latency_target_ms, f"latency target {info.latency_metric}<"
                                                              f"{info.latency_target_ms:g}ms")]
    return out


# -------------------------------------------------------------------------------------------------- trials --- #
class _Trials:
    """Gives a list of trials the `get_trials` of a study, so `tuner.search.answer.rows_from_study` reads it."""

    def __init__(self, trials: Sequence[Any], user_attrs: Mapping[str, Any] | None = None) -> None:
        self._trials = list(trials)
        self.user_attrs = dict(user_attrs or {})  # the study's: re-measures of picked trials (tuner.search.confirm)

    def get_trials(self, deepcopy: bool = False, states: Any = None) -> list[Any]:
        return self._trials


def state_name(trial: Any) -> str:
    s = trial.state
    return getattr(s, "name", str(s))


@dataclass(frozen=True)
class TrialView:
    """One trial: tuner.search.answer's Row (config, metrics, quality, constraints, reason, cost) plus what only the
    dashboard shows (per-request latencies, engine, timing, baseline flag, the capacity measurement)."""

    row: Row
    params: Mapping[str, Any]
    requests: list[Mapping[str, Any]]
    engine: Mapping[str, Any] | None
    baseline: bool
    duration_s: float | None
    capacity: Mapping[str, Any] | None = None
    predicted: Mapping[str, Any] | None = None  # `--strategy predict`: its `predicted_*` attrs (before it was measured)

    @property
    def capacity_rps(self) -> float | None:
        return num((self.capacity or {}).get("requests_per_s"))

    @property
    def tok_s(self) -> float:
        """Output tok/s: at the capacity point, or (an older study) at the one rate the trial was measured at."""
        v = num((self.capacity or {}).get(THROUGHPUT)) if self.capacity else num(self.row.metrics.get(THROUGHPUT))
        return v or 0.0

    @property
    def engine_label(self) -> str | None:
        """Which engine served the trial ('transformers-cb', 'transformers-assisted'), None when not recorded."""
        name = (self.engine or {}).get("name") or self.row.config.get("engine")
        return str(name) if name else None

    @property
    def number(self) -> int:
        return self.row.number

    @property
    def state(self) -> str:
        return self.row.state

    @property
    def feasible(self) -> bool:
        return self.row.feasible

    @property
    def finished(self) -> bool:
        return self.row.state in FINISHED


def trial_views(trials: Sequence[Any], study_attrs: Mapping[str, Any] | None = None) -> list[TrialView]:
    rows = rows_from_study(_Trials(trials, study_attrs))
    out = []
    for t, r in zip(trials, rows):
        ua = t.user_attrs or {}
        start, end = getattr(t, "datetime_start", None), getattr(t, "datetime_complete", None)
        dur = (end - start).total_seconds() if start and end else None
        reqs = ua.get("requests")
        eng = ua.get("engine")
        out.append(TrialView(r, dict(getattr(t, "params", {}) or {}), list(reqs) if isinstance(reqs, list) else [],
                             eng if isinstance(eng, dict) else None, bool(ua.get("baseline")), dur,
                             r.capacity if r.trial_capacity is not None else capacity_attr(ua),
                             {k: x for k, x in ua.items() if k.startswith("predicted_")} or None))
    return sorted(out, key=lambda v: v.number)


def has_capacity(views: Sequence[TrialView]) -> bool:
    """Whether the study was measured by capacity (else: output tok/s at one fixed arrival rate, before capacity)."""
    return any(v.capacity is not None for v in views)


def signature(trials: Iterable[Any]) -> tuple[tuple[int, str], ...]:
    """What changes when a running search makes progress (the live page reloads when it does)."""
    return tuple(sorted((t.number, state_name(t)) for t in trials))


def state_counts(views: Sequence[TrialView]) -> dict[str, int]:
    counts = {"trials": len(views), "COMPLETE": 0, "feasible": 0, "PRUNED": 0, "FAIL": 0, "RUNNING": 0,
              "WAITING": 0}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
        counts["feasible"] += v.feasible
    return counts
