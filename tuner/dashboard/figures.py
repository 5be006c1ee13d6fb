"""The Pareto chart's data: one point per trial on any two fields with its error bars (capacity CI, quality
stderr, latency percentile CI), the feasible front of those two axes, the quality colour range and the SLO's lines on
an axis. The Plotly figure itself is tuner.dashboard.curves.pareto_figure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.dashboard.curves import ci_pair, num
from tuner.dashboard.fields import trial_fields
from tuner.dashboard.study import CAPACITY, StudyInfo, TrialView, bound_lines
from tuner.dashboard.views import hover_text


def chart_points(views: Sequence[TrialView], x: str, y: str, info: StudyInfo | None = None,
                 recommended: int | None = None) -> list[dict[str, Any]]:
    """One point per trial that has both values: x, y, their error bars (`x_err`, `y_err`: see `field_error`),
    quality (None when not scored), feasible, state, whether it is the recommendation, the engine, and the hover
    text (its config and key figures)."""
    out = []
    for v in views:
        f = trial_fields(v)
        if x not in f or y not in f:
            continue
        out.append({"number": v.number, "x": f[x], "y": f[y], "x_err": field_error(v, x, f[x]),
                    "y_err": field_error(v, y, f[y]), "quality": num(v.row.quality.get("score")),
                    "feasible": v.feasible, "state": v.state, "recommended": v.number == recommended,
                    "baseline": v.baseline, "engine": v.engine_label, "hover": hover_text(v, info)})
    return out


def field_error(v: TrialView, f: str, value: float) -> dict[str, Any] | None:
    """The uncertainty of a trial's value on a field, as error-bar lengths {'minus', 'plus', 'open_minus',
    'open_plus'} (an open side has no bound: too few samples; its length is 0): the capacity's CI, the quality
    score's standard error (±), a latency percentile's CI (`metrics[...].ci`, `capacity.saturation` has none).
    None when the field carries no uncertainty."""
    lo: float | None
    hi: float | None
    if f == CAPACITY and v.capacity and "requests_per_s_ci" in v.capacity:
        lo, hi = ci_pair(v.capacity.get("requests_per_s_ci"))
    elif f == "quality.score" and num(v.row.quality.get("score_stderr")) is not None:
        se = float(v.row.quality["score_stderr"])
        lo, hi = value - se, value + se
    else:
        m = re.fullmatch(r"([a-z0-9]+_ms)\.(p50|p90|p95|p99)", f)
        ci = (v.row.metrics.get(m.group(1)) or {}).get("ci") if m else None
        if m is None or not isinstance(ci, Mapping) or not isinstance(ci.get(m.group(2)), (list, tuple)):
            return None
        lo, hi = ci_pair(ci.get(m.group(2)))
    return {"minus": max(0.0, value - lo) if lo is not None else 0.0, "open_minus": lo is None,
            "plus": max(0.0, hi - value) if hi is not None else 0.0, "open_plus": hi is None}


def pareto_line(points: Sequence[Mapping[str, Any]], x_dir: str | None, y_dir: str | None) -> list[dict[str, Any]]:
    """The feasible points not dominated on the two axes (directions 'max'/'min'), sorted by x: the front drawn
    as a line. Empty when an axis has no direction (a knob) or nothing is feasible."""
    if x_dir not in ("max", "min") or y_dir not in ("max", "min"):
        return []
    sx, sy = (1 if x_dir == "max" else -1), (1 if y_dir == "max" else -1)
    pts = [p for p in points if p["feasible"]]
    front = []
    for p in pts:
        a, b = sx * p["x"], sy * p["y"]
        if not any(sx * o["x"] >= a and sy * o["y"] >= b and (sx * o["x"], sy * o["y"]) != (a, b) for o in pts):
            front.append(p)
    # one point per distinct position (ties keep the lowest trial number)
    uniq: dict[tuple[float, float], Mapping[str, Any]] = {}
    for p in sorted(front, key=lambda p: p["number"]):
        uniq.setdefault((p["x"], p["y"]), p)
    return [dict(p) for p in sorted(uniq.values(), key=lambda p: (p["x"], p["y"]))]


def quality_range(points: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    qs = [p["quality"] for p in points if p.get("quality") is not None]
    if not qs:
        return None
    lo, hi = min(qs), max(qs)
    return (lo, hi) if hi > lo else (lo - 0.05, hi + 0.05)


def target_lines(info: StudyInfo | None, x: str, y: str) -> list[dict[str, Any]]:
    """The latency target (and other latency bounds) that fall on an axis: {'axis': 'x'|'y', 'value', 'label'}."""
    if info is None:
        return []
    lines = bound_lines(info)
    out = []
    for axis, f in (("x", x), ("y", y)):
        for value, label in lines.get(f, []):
            out.append({"axis": axis, "value": value, "label": label})
    return out
