"""Capacity shaping for the dashboard: a trial's capacity measurement (the highest request rate that meets the SLO,
with its confidence interval, verdict and the probes of the bracketed search) turned into what app.py draws.

* `latency_curve`: the latency-load curve of one trial, one point per probe (x = offered rate in req/s, y = a
  latency percentile with its CI, the probe's verdict, its achieved throughput), and the capacity point (its
  rate with the rate's CI, and the latency there);
* `plot_arrays`: a curve as Plotly arrays, where a CI side that the probe's few samples cannot bound is drawn to
  the plot's edge and listed for a marker;
* capacity summaries and text for the table, hover, header and trial detail;
* the Plotly figures: `latency_figure`, `throughput_figure` (achieved vs offered rate) and `pareto_figure` (any two
  fields, capacity vs quality by default, with their intervals as error bars).

Pure functions over plain dicts and the dashboard's TrialView (duck-typed: `number`, `capacity`, `row`,
`engine_label`, `baseline`); nothing here imports the dashboard's other modules, which import this one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STATS = ("p50", "p90", "p95", "p99", "mean")
VERDICT_COLOURS = {"meets": "#2ca02c", "misses": "#d62728", "indeterminate": "#ff9f1c"}
LEGACY_NOTE = ("This study predates capacity measurement (no `capacity` attribute on its trials): it shows output "
               "tok/s at the one arrival rate each trial was measured at, and has no latency-load curves.")
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def pct(m: Mapping[str, Any], key: str, stat: str) -> float | None:
    v = m.get(key)
    return num(v.get(stat)) if isinstance(v, Mapping) else None


def ci_pair(x: Any) -> tuple[float | None, float | None]:
    """[low, high] -> (low, high), a side None where it is missing or not finite."""
    if isinstance(x, (list, tuple)) and len(x) == 2:
        return num(x[0]), num(x[1])
    return None, None


def fmt(x: float | None, spec: str, missing: str = "?") -> str:
    return missing if x is None else format(x, spec)


# ------------------------------------------------------------------------------------------ capacity attrs --- #
def capacity_attr(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The capacity measurement of a trial (its `capacity` user attr) or of a bench JSON (`metrics.capacity`)."""
    cap = attrs.get("capacity")
    if not isinstance(cap, Mapping) and isinstance(attrs.get("metrics"), Mapping):
        cap = attrs["metrics"].get("capacity")
    return dict(cap) if isinstance(cap, Mapping) else None


def capacity_text(cap: Mapping[str, Any] | None) -> str:
    """'1.25 req/s (95% CI 1.10–1.40) · meets' for the header, hover and detail."""
    if not cap:
        return "no capacity measured"
    rps = num(cap.get("requests_per_s"))
    lo, hi = ci_pair(cap.get("requests_per_s_ci"))
    slo = cap.get("slo") if isinstance(cap.get("slo"), Mapping) else {}
    conf = num(slo.get("confidence"))
    head = f"{rps:.2f} req/s" if rps is not None else "no rate met the SLO"
    if lo is not None or hi is not None:
        head += (f" ({conf:.0%} CI " if conf else " (CI ") + f"{fmt(lo, '.2f')}–{fmt(hi, '.2f', 'open')})"
    return f"{head} · {cap.get('verdict') or 'no verdict'}"


def capacity_summary(cap: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The capacity measurement without its probes (those are the curves): rate, CI, verdict, SLO, saturation,
    cost of the search, notes."""
    if not cap:
        return None
    sat = cap.get("saturation") if isinstance(cap.get("saturation"), Mapping) else {}
    cost = cap.get("cost") if isinstance(cap.get("cost"), Mapping) else {}
    return {"text": capacity_text(cap), "requests_per_s": num(cap.get("requests_per_s")),
            "ci_rps": ci_pair(cap.get("requests_per_s_ci")), "verdict": cap.get("verdict"),
            "output_tokens_per_s": num(cap.get("output_tokens_per_s")),
            "goodput_requests_per_s": num(cap.get("goodput_requests_per_s")),
            "slo": dict(cap["slo"]) if isinstance(cap.get("slo"), Mapping) else {},
            "saturation": dict(sat), "cost": dict(cost), "notes": [str(n) for n in cap.get("notes") or []],
            "n_probes": len(probes(cap))}


def percentile_rows(metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per latency metric: p50..p99 and mean (ms), the sample count, and each percentile's CI as text
    ('120–180', a side '?' where too few samples bound it)."""
    out = []
    for k in LATENCY_KEYS:
        p = metrics.get(k)
        if not isinstance(p, Mapping):
            continue
        row: dict[str, Any] = {"metric (ms)": k[:-3].upper(), "n": p.get("n")}
        row.update({s: pct(metrics, k, s) for s in STATS})
        ci = p.get("ci") if isinstance(p.get("ci"), Mapping) else {}
        for s in STATS[:4]:
            if isinstance(ci.get(s), (list, tuple)):
                lo, hi = ci_pair(ci[s])
                row[f"{s} CI"] = f"{fmt(lo, '.0f')}–{fmt(hi, '.0f')}"
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------- probes --- #
def probes(cap: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The probes of a capacity search with a numeric offered rate, by rate."""
    ps = [p for p in (cap or {}).get("probes") or [] if isinstance(p, Mapping) and num(p.get("rate_rps")) is not None]
    return sorted(ps, key=lambda p: float(p["rate_rps"]))


def field_label(f: str) -> str:
    """'ttft_ms.p90' -> 'TTFT p90 (ms)' (anything else: 'latency (ms)')."""
    key, _, stat = f.partition(".")
    return f"{_NAMES[key[:-3]]} {stat} (ms)" if key in LATENCY_KEYS and stat in STATS else "latency (ms)"


def curve_fields(views: Sequence[Any], primary: str | None = None) -> list[str]:
    """The latency fields ('ttft_ms.p90') that some probe of some trial has, the study's primary one first."""
    seen = {f"{k}.{s}" for v in views for p in probes(v.capacity) for k in LATENCY_KEYS for s in STATS
            if pct(p, k, s) is not None}
    order = [primary] if primary else []
    order += [f"{k}.{s}" for k in LATENCY_KEYS for s in STATS]
    return [f for f in dict.fromkeys(order) if f in seen]


def curve_trials(views: Sequence[Any]) -> list[int]:
    """Numbers of the trials that have probes (the ones a latency-load curve can be drawn for)."""
    return [v.number for v in views if probes(v.capacity)]


def default_curve_trials(views: Sequence[Any], recommended: int | None) -> list[int]:
    """The recommended trial and the baseline, those that have probes; else the trial with the highest capacity."""
    have = set(curve_trials(views))
    base = next((v.number for v in views if v.baseline), None)
    chosen = [n for n in dict.fromkeys([recommended, base]) if n is not None and n in have]
    if chosen or not have:
        return chosen
    best = max((v for v in views if v.number in have), key=lambda v: (num((v.capacity or {}).get(
        "requests_per_s")) or 0.0, -v.number))
    return [best.number]


def interpolate(xs: Sequence[float], ys: Sequence[float | None], x: float) -> float | None:
    """Linear interpolation of y at x between the neighbouring points with a value (None outside their range)."""
    pts = sorted((a, b) for a, b in zip(xs, ys) if b is not None)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if len(pts) == 1 and math.isclose(pts[0][0], x, rel_tol=1e-9) else None


def latency_curve(v: Any, field: str) -> dict[str, Any]:
    """The latency-load curve of trial `v` on `field` ('ttft_ms.p90'): {number, label, engine, field, points,
    capacity, saturation}. A point per probe: rate_rps (offered), y (the percentile, None when the probe has no
    value, e.g. every request failed), ci_low/ci_high (None: that side is not bounded by the probe's samples),
    open_low/open_high (a CI exists for this stat but that side is missing), verdict, n, failed, achieved_rps,
    output_tokens_per_s, attainment (+ its CI) and the hover text. `capacity`: rate_rps, ci_low_rps, ci_high_rps,
    verdict, y (the latency at that rate: the probe run at that rate, else the trial's metrics there, else
    interpolated between probes) and achieved_rps; None when the trial has no capacity rate."""
    key, _, stat = field.partition(".")
    cap = v.capacity or {}
    conf = num((cap.get("slo") or {}).get("confidence")) if isinstance(cap.get("slo"), Mapping) else None
    engine = getattr(v, "engine_label", None)
    label = f"trial {v.number}" + (f" · {engine}" if engine else "") + (" · baseline" if v.baseline else "")
    points = []
    for p in probes(cap):
        lat = p.get(key) if isinstance(p.get(key), Mapping) else {}
        ci = lat.get("ci") if isinstance(lat.get("ci"), Mapping) else {}
        has_ci = isinstance(ci.get(stat), (list, tuple))
        lo, hi = ci_pair(ci.get(stat))
        y = pct(p, key, stat)
        verdict = p.get("verdict") if p.get("verdict") in VERDICT_COLOURS else "indeterminate"
        att, att_ci = num(p.get("attainment")), ci_pair(p.get("attainment_ci"))
        pt = {"rate_rps": float(p["rate_rps"]), "y": y, "ci_low": lo, "ci_high": hi,
              "open_low": has_ci and lo is None, "open_high": has_ci and hi is None, "verdict": verdict,
              "n": p.get("n"), "failed": p.get("failed"), "achieved_rps": num(p.get("achieved_rps")),
              "output_tokens_per_s": num(p.get("output_tokens_per_s")), "attainment": att,
              "attainment_ci": att_ci if p.get("attainment_ci") is not None else None}
        ci_text = (f" ({conf:.0%} CI " if conf else " (CI ") + f"{fmt(lo, '.0f')}–{fmt(hi, '.0f')} ms)" \
            if has_ci else ""
        pt["hover"] = "<br>".join([
            f"<b>{label}</b>: {pt['rate_rps']:.3g} req/s offered",
            f"{field_label(field).replace(' (ms)', '')} " + (f"{y:.0f} ms{ci_text}" if y is not None else
                                                             "no value (no successful request)"),
            f"achieved {fmt(pt['achieved_rps'], '.3g')} req/s · {fmt(pt['output_tokens_per_s'], '.1f')} tok/s",
            f"<b>{verdict}</b> · n={p.get('n')} · failed {p.get('failed')}"
            + (f" · attainment {att:.2f}" + (f" [{fmt(att_ci[0], '.2f')}, {fmt(att_ci[1], '.2f')}]"
                                              if pt["attainment_ci"] else "") if att is not None else "")])
        points.append(pt)
    return {"number": v.number, "label": label, "engine": engine, "field": field, "points": points,
            "capacity": _capacity_point(v, cap, key, stat, points, label), "saturation": _saturation(cap)}


def _capacity_point(v: Any, cap: Mapping[str, Any], key: str, stat: str, points: Sequence[Mapping[str, Any]],
                    label: str) -> dict[str, Any] | None:
    rate = num(cap.get("requests_per_s"))
    if rate is None:
        return None
    lo, hi = ci_pair(cap.get("requests_per_s_ci"))
    xs = [p["rate_rps"] for p in points]
    at = next((p for p in points if math.isclose(p["rate_rps"], rate, rel_tol=1e-6)), None)
    metrics = v.row.metrics if getattr(v, "row", None) is not None else {}
    y = at["y"] if at and at["y"] is not None else pct(metrics, key, stat)
    if y is None:
        y = interpolate(xs, [p["y"] for p in points], rate)
    achieved = at["achieved_rps"] if at else interpolate(xs, [p["achieved_rps"] for p in points], rate)
    verdict = cap.get("verdict") if cap.get("verdict") in VERDICT_COLOURS else "indeterminate"
    hover = f"<b>{label}</b>: capacity {capacity_text(cap)}" + (
        f"<br>{field_label(f'{key}.{stat}').replace(' (ms)', '')} {y:.0f} ms there" if y is not None else "")
    return {"rate_rps": rate, "ci_low_rps": lo, "ci_high_rps": hi, "verdict": verdict, "y": y,
            "achieved_rps": achieved, "hover": hover}


def _saturation(cap: Mapping[str, Any]) -> dict[str, Any] | None:
    sat = cap.get("saturation")
    if not isinstance(sat, Mapping) or num(sat.get("requests_per_s")) is None:
        return None
    return {"requests_per_s": float(sat["requests_per_s"]), "output_tokens_per_s": num(sat.get("output_tokens_per_s")),
            "concurrency": sat.get("concurrency"), "n": sat.get("n")}


def y_top(curves: Sequence[Mapping[str, Any]], limits: Sequence[float] = ()) -> float:
    """The top of the latency axis: 15% above the highest value, bounded CI end, capacity point or SLO limit
    (open CI sides and probes without a value are drawn up to it)."""
    vals = [x for c in curves for p in c["points"] for x in (p["y"], p["ci_high"]) if x is not None]
    vals += [c["capacity"]["y"] for c in curves if c["capacity"] and c["capacity"]["y"] is not None]
    vals += [float(v) for v in limits]
    return 1.15 * max(vals) if vals and max(vals) > 0 else 1.0


def plot_arrays(curve: Mapping[str, Any], top: float, bottom: float = 0.0) -> dict[str, Any]:
    """A curve as Plotly arrays: x, y, error bars (minus, plus: a side the probe cannot bound runs to the plot's
    edge, `bottom` or `top`), marker colours by verdict, hover text; `open` lists (x, y, 'up'|'down') where such a
    bar runs to the edge (drawn as arrow markers); `missing` lists the rates of probes without a value (drawn at
    the top edge). Points without a value are left out of x and y."""
    out: dict[str, Any] = {"x": [], "y": [], "minus": [], "plus": [], "colour": [], "verdict": [], "hover": [],
                           "open": [], "missing": []}
    for p in curve["points"]:
        y = p["y"]
        if y is None:
            out["missing"].append(p["rate_rps"])
            continue
        out["x"].append(p["rate_rps"])
        out["y"].append(y)
        out["minus"].append(max(0.0, y - (bottom if p["open_low"] else (p["ci_low"] if p["ci_low"] is not None
                                                                          else y))))
        out["plus"].append(max(0.0, (top if p["open_high"] else (p["ci_high"] if p["ci_high"] is not None
                                                                   else y)) - y))
        out["colour"].append(VERDICT_COLOURS[p["verdict"]])
        out["verdict"].append(p["verdict"])
        out["hover"].append(p["hover"])
        if p["open_high"]:
            out["open"].append((p["rate_rps"], top, "up"))
        if p["open_low"]:
            out["open"].append((p["rate_rps"], bottom, "down"))
    return out


def capacity_marker(curve: Mapping[str, Any], limits: Sequence[float] = ()) -> dict[str, Any] | None:
    """Where a curve's capacity point is drawn: x = the capacity rate with its CI as a horizontal error bar
    (minus, plus; 0 for a side without a bound), y = the latency there, or the (lowest) SLO limit when that is
    unknown (`y_known` False: e.g. no rate met the SLO, so the capacity is 0 and no probe ran there). None
    when the trial has no capacity rate."""
    cp = curve.get("capacity")
    if not cp:
        return None
    rate, lo, hi = cp["rate_rps"], cp["ci_low_rps"], cp["ci_high_rps"]
    known = cp["y"] is not None
    return {"x": rate, "y": cp["y"] if known else (min(limits) if limits else 0.0), "y_known": known,
            "minus": max(0.0, rate - lo) if lo is not None else 0.0,
            "plus": max(0.0, hi - rate) if hi is not None else 0.0, "verdict": cp["verdict"],
            "achieved_rps": cp["achieved_rps"], "hover": cp["hover"]}


def slo_limits(lines: Mapping[str, Sequence[tuple[float, str]]], field: str) -> list[dict[str, Any]]:
    """The SLO limits drawn on a latency-load chart of `field` ({'value', 'label'}), from `bound_lines`."""
    return [{"value": float(v), "label": str(label)} for v, label in lines.get(field, [])]



# ------------------------------------------------------------------------------------------------ figures --- #
PALETTE = ("#1f77b4", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22", "#ff7f0e")


def latency_figure(curves: Sequence[Mapping[str, Any]], field: str, limits: Sequence[Mapping[str, Any]]) -> Any:
    """Latency-load chart: per trial a line through its probes (x = offered req/s, y = `field` with its CI as
    error bars, markers filled by verdict, outlined in the trial's colour), its capacity point (a star at the
    capacity rate, the rate's CI as a horizontal bar), arrows where a CI side runs to the plot's edge, crosses
    at the top for probes without a value, and the SLO limits as horizontal lines. Trace names: 'trial N · ...'
    (probes), 'capacity (trial N)', 'open CI (trial N)', 'no value (trial N)', and one per verdict (legend)."""
    import plotly.graph_objects as go

    top = y_top(curves, [float(lim["value"]) for lim in limits])
    fig = go.Figure()
    for i, c in enumerate(curves):
        colour = PALETTE[i % len(PALETTE)]
        a = plot_arrays(c, top)
        group = f"trial {c['number']}"
        fig.add_trace(go.Scatter(
            x=a["x"], y=a["y"], mode="lines+markers", name=c["label"], legendgroup=group,
            line={"color": colour, "width": 2}, customdata=[[c["number"]]] * len(a["x"]), hovertext=a["hover"],
            hovertemplate="%{hovertext}<extra></extra>",
            marker={"size": 11, "color": a["colour"], "line": {"width": 2, "color": colour}},
            error_y={"type": "data", "symmetric": False, "array": a["plus"], "arrayminus": a["minus"],
                     "color": colour, "thickness": 1.5, "width": 5}))
        if a["open"]:
            fig.add_trace(go.Scatter(
                x=[o[0] for o in a["open"]], y=[o[1] for o in a["open"]], mode="markers", legendgroup=group,
                cliponaxis=False,
                name=f"open CI (trial {c['number']})", showlegend=False, hoverinfo="text",
                hovertext=["CI side not bounded: too few requests at this rate for this percentile"] * len(a["open"]),
                marker={"symbol": ["triangle-up" if o[2] == "up" else "triangle-down" for o in a["open"]],
                        "size": 10, "color": colour}))
        if a["missing"]:
            fig.add_trace(go.Scatter(
                x=a["missing"], y=[top] * len(a["missing"]), mode="markers", legendgroup=group, showlegend=False,
                cliponaxis=False,
                name=f"no value (trial {c['number']})", hoverinfo="text",
                hovertext=["no latency value at this rate (no successful request)"] * len(a["missing"]),
                marker={"symbol": "x", "size": 12, "color": VERDICT_COLOURS["misses"]}))
        cm = capacity_marker(c, [float(lim["value"]) for lim in limits])
        if cm:
            fig.add_trace(go.Scatter(
                x=[cm["x"]], y=[cm["y"]], mode="markers", name=f"capacity (trial {c['number']})",
                legendgroup=group, customdata=[[c["number"]]], hovertext=[cm["hover"]],
                hovertemplate="%{hovertext}<extra></extra>",
                marker={"symbol": "star" if cm["y_known"] else "star-open", "size": 20,
                        "color": VERDICT_COLOURS[cm["verdict"]], "line": {"width": 1.5, "color": colour}},
                error_x={"type": "data", "symmetric": False, "array": [cm["plus"]], "arrayminus": [cm["minus"]],
                         "color": colour, "thickness": 2.5, "width": 8}))
    _verdict_legend(fig)
    for lim in limits:
        fig.add_hline(float(lim["value"]), line_dash="dash", line_color="#d62728", annotation_text=lim["label"],
                      annotation_position="top left")
    fig.update_layout(height=480, margin={"l": 10, "r": 10, "t": 30, "b": 10}, yaxis_range=[0, top],
                      xaxis_title="offered rate (req/s)", yaxis_title=field_label(field), xaxis_rangemode="tozero",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0})
    return fig


def throughput_figure(curves: Sequence[Mapping[str, Any]], unit: str = "rps") -> Any:
    """Achieved vs offered rate (`unit` 'rps': requests/s, with the offered = achieved diagonal; 'tok_s': output
    tok/s), per trial, markers by verdict, its capacity point, and its closed-loop saturation as a dotted line."""
    import plotly.graph_objects as go

    key = "achieved_rps" if unit == "rps" else "output_tokens_per_s"
    fig = go.Figure()
    top_x = 0.0
    for i, c in enumerate(curves):
        colour = PALETTE[i % len(PALETTE)]
        pts = [p for p in c["points"] if p[key] is not None]
        top_x = max([top_x] + [p["rate_rps"] for p in c["points"]])
        fig.add_trace(go.Scatter(
            x=[p["rate_rps"] for p in pts], y=[p[key] for p in pts], mode="lines+markers", name=c["label"],
            legendgroup=f"trial {c['number']}", line={"color": colour, "width": 2},
            hovertext=[p["hover"] for p in pts], hovertemplate="%{hovertext}<extra></extra>",
            marker={"size": 10, "color": [VERDICT_COLOURS[p["verdict"]] for p in pts],
                    "line": {"width": 2, "color": colour}}))
        cp = c["capacity"]
        at = next((p for p in pts if math.isclose(p["rate_rps"], cp["rate_rps"], rel_tol=1e-6)), None) if cp else None
        y_cap = at[key] if at else (cp["achieved_rps"] if cp and unit == "rps" else None)
        if cp and y_cap is not None:
            fig.add_trace(go.Scatter(x=[cp["rate_rps"]], y=[y_cap], mode="markers", name=f"capacity (trial "
                                     f"{c['number']})", legendgroup=f"trial {c['number']}", hovertext=[cp["hover"]],
                                     hovertemplate="%{hovertext}<extra></extra>",
                                     marker={"symbol": "star", "size": 18, "color": VERDICT_COLOURS[cp["verdict"]],
                                             "line": {"width": 1.5, "color": colour}}))
        sat = c["saturation"]
        sat_y = (sat or {}).get("requests_per_s" if unit == "rps" else "output_tokens_per_s")
        if sat_y is not None:
            fig.add_hline(sat_y, line_dash="dot", line_color=colour,
                          annotation_text=f"saturation, trial {c['number']} (closed loop, {sat.get('concurrency')} "
                                          "in flight)", annotation_position="bottom right")
    if unit == "rps" and top_x > 0:
        fig.add_trace(go.Scatter(x=[0, top_x], y=[0, top_x], mode="lines", name="achieved = offered",
                                 hoverinfo="skip", line={"color": "#aaaaaa", "dash": "dash", "width": 1}))
    _verdict_legend(fig)
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 30, "b": 10}, xaxis_title="offered rate (req/s)",
                      yaxis_title="achieved (req/s)" if unit == "rps" else "output tok/s",
                      xaxis_rangemode="tozero", yaxis_rangemode="tozero",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0})
    return fig


def pareto_figure(points: Sequence[Mapping[str, Any]], front: Sequence[Mapping[str, Any]],
                  lines: Sequence[Mapping[str, Any]], x_label: str, y_label: str) -> Any:
    """The trials on two axes (`tuner.dashboard.figures.chart_points`): feasible (circles) and infeasible (crosses)
    coloured by quality score, with their error bars (`x_err`, `y_err`: the capacity's CI, the quality score's
    stderr, a latency percentile's CI), the feasible front (`pareto_line`) as a dotted line, the recommended trial
    as a star, and target lines (`target_lines`). Trace names: 'feasible', 'infeasible', 'Pareto front
    (feasible)', 'recommended (trial N)'."""
    import plotly.colors
    import plotly.graph_objects as go

    qs = [p["quality"] for p in points if p.get("quality") is not None]
    qrange = ((min(qs), max(qs)) if max(qs) > min(qs) else (min(qs) - 0.05, max(qs) + 0.05)) if qs else None

    def colour(q: float | None) -> str:
        if q is None or qrange is None:
            return "#9e9e9e"
        t = (q - qrange[0]) / (qrange[1] - qrange[0])
        return plotly.colors.sample_colorscale("Viridis", [min(1.0, max(0.0, t))])[0]

    fig = go.Figure()
    for feasible, name, symbol in ((True, "feasible", "circle"), (False, "infeasible", "x")):
        pts = [p for p in points if p["feasible"] is feasible]
        fig.add_trace(go.Scatter(
            x=[p["x"] for p in pts], y=[p["y"] for p in pts], mode="markers+text", name=name,
            text=[str(p["number"]) for p in pts], textposition="top center", textfont={"size": 10},
            customdata=[[p["number"]] for p in pts], hovertext=[p["hover"] for p in pts],
            hovertemplate="%{hovertext}<extra></extra>", error_x=error_bars(pts, "x_err"),
            error_y=error_bars(pts, "y_err"),
            marker={"symbol": symbol, "size": 13, "color": [colour(p["quality"]) for p in pts],
                    "line": {"width": 1, "color": "#333"}}))
    if front:
        fig.add_trace(go.Scatter(x=[p["x"] for p in front], y=[p["y"] for p in front], mode="lines+markers",
                                 name="Pareto front (feasible)", marker={"size": 5, "color": "#1f77b4"},
                                 hoverinfo="skip", line={"color": "#1f77b4", "width": 2, "dash": "dot"}))
    for p in points:
        if p["recommended"]:
            fig.add_trace(go.Scatter(x=[p["x"]], y=[p["y"]], mode="markers", name=f"recommended (trial "
                                     f"{p['number']})", customdata=[[p["number"]]], hovertext=[p["hover"]],
                                     hovertemplate="%{hovertext}<extra></extra>",
                                     marker={"symbol": "star-open", "size": 28, "color": "#d62728",
                                             "line": {"width": 2.5, "color": "#d62728"}}))
    if qrange is not None:  # a marker-less trace that carries the quality colour bar
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip",
                                 marker={"colorscale": "Viridis", "cmin": qrange[0], "cmax": qrange[1],
                                         "color": [qrange[0]], "showscale": True,
                                         "colorbar": {"title": {"text": "quality"}, "thickness": 14}}))
    for line in lines:
        add = fig.add_vline if line["axis"] == "x" else fig.add_hline
        add(line["value"], line_dash="dash", line_color="#d62728", annotation_text=line["label"],
            annotation_position="top left" if line["axis"] == "x" else "bottom right")
    fig.update_layout(height=520, margin={"l": 10, "r": 10, "t": 30, "b": 10}, xaxis_title=x_label,
                      yaxis_title=y_label, legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0})
    return fig


def error_bars(points: Sequence[Mapping[str, Any]], key: str) -> dict[str, Any]:
    """Plotly error bars from the points' `x_err`/`y_err` (a point without one gets 0; hidden when none has)."""
    errs = [p[key] or {"minus": 0.0, "plus": 0.0} for p in points]
    return {"type": "data", "symmetric": False, "array": [e["plus"] for e in errs], "color": "#555",
            "arrayminus": [e["minus"] for e in errs], "visible": any(p[key] for p in points), "thickness": 1}


def _verdict_legend(fig: Any) -> None:
    import plotly.graph_objects as go

    for verdict, colour in VERDICT_COLOURS.items():
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=verdict, hoverinfo="skip",
                                 marker={"size": 10, "color": colour, "line": {"width": 1, "color": "#333"}}))
