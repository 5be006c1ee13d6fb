"""A study searched with `tuner search --strategy predict`: its predicted configurations beside its measured ones.

The strategy records every configuration it predicted in the study (attribute `predictions`,
tuner.predict.strategy.PREDICTIONS: config, predicted capacity, band, profile) and, on each trial it measured, the
prediction made before the measurement (`predicted_requests_per_s`, `predicted_band`, ...). From those:

* `predicted_points`: every predicted configuration as a point of the Pareto chart (x and y on capacity, a knob or
  the quality measured for its format), its band as the capacity's error bar, drawn apart from the measured trials;
* `prediction_rows` / `prediction_summary`: each measured trial's predicted capacity beside its measured one, the
  signed error (predicted - measured) / measured and whether the measurement fell within the band;
* `scatter_figure`: predicted vs measured capacity with the identity line, the band (x) and the measured CI (y) as
  error bars.

Every figure here says whether it is predicted or measured. A study without predictions gives nothing (None, []):
the page then shows none of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.dashboard.curves import ci_pair, num
from tuner.dashboard.fields import flatten, trial_fields
from tuner.dashboard.study import CAPACITY, TrialView
from tuner.dashboard.views import config_text

PREDICTED_NAME = "predicted (not measured)"  # the Pareto chart's trace of predicted configurations
MEASURED_NOTE = "measured: each trial's real capacity search"
PREDICTED_NOTE = "predicted: the engine model (tuner.predict), raw, before calibration"


def prediction_record(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The study's record of what `--strategy predict` predicted (None when it has none)."""
    from tuner.predict.strategy import PREDICTIONS

    rec = attrs.get(PREDICTIONS)
    return dict(rec) if isinstance(rec, Mapping) and rec.get("configurations") else None


def has_predictions(attrs: Mapping[str, Any], views: Sequence[TrialView]) -> bool:
    return prediction_record(attrs) is not None or any(own_prediction(v) is not None for v in views)


def own_prediction(v: TrialView) -> float | None:
    """The capacity predicted for a trial's configuration before it was measured (req/s)."""
    return num((v.predicted or {}).get("predicted_requests_per_s"))


def same_config(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two configs are one configuration (the device, which a prediction does not depend on, aside)."""
    return {k: x for k, x in a.items() if k != "device"} == {k: x for k, x in b.items() if k != "device"}


def measured_trial(config: Mapping[str, Any], views: Sequence[TrialView]) -> TrialView | None:
    return next((v for v in views if v.state == "COMPLETE" and v.row.config and same_config(v.row.config, config)),
                None)


def quality_trial(config: Mapping[str, Any], views: Sequence[TrialView]) -> TrialView | None:
    """A trial whose quality score stands for this configuration's (the quality gate is per format)."""
    from tuner.search.objective import quality_key

    key = quality_key(dict(config))
    return next((v for v in views if v.row.config and v.row.quality.get("score") is not None
                 and quality_key(dict(v.row.config)) == key), None)


def predicted_fields(entry: Mapping[str, Any], views: Sequence[TrialView]) -> dict[str, float]:
    """The fields a predicted configuration has: its predicted capacity, its numeric knobs and the quality fields
    of a trial of its format (quality is measured per format). No latency, throughput or cost: not predicted."""
    out = {f"config.{k}": x for k, x in flatten(entry.get("config") or {}).items()}
    q = quality_trial(entry.get("config") or {}, views)
    if q is not None:
        out.update({k: x for k, x in trial_fields(q).items() if k.startswith("quality.")})
    rps = num(entry.get("predicted_requests_per_s"))
    if rps is not None:
        out[CAPACITY] = rps
    return out


def band_error(entry: Mapping[str, Any], value: float) -> dict[str, Any] | None:
    lo, hi = ci_pair(entry.get("predicted_band"))
    if lo is None or hi is None:
        return None
    return {"minus": max(0.0, value - lo), "plus": max(0.0, hi - value), "open_minus": False, "open_plus": False}


def predicted_points(record: Mapping[str, Any] | None, views: Sequence[TrialView], x: str,
                     y: str) -> list[dict[str, Any]]:
    """One point per predicted configuration that has both fields (see `predicted_fields`), the band as the
    capacity axis' error bar, and whether (and as which trial) it was measured."""
    out = []
    for entry in (record or {}).get("configurations") or []:
        f = predicted_fields(entry, views)
        if x not in f or y not in f:
            continue
        cfg = entry.get("config") or {}
        m = measured_trial(cfg, views)
        lo, hi = ci_pair(entry.get("predicted_band"))
        hover = [f"<b>predicted</b> (not measured{f'; measured as trial {m.number}' if m else ''})",
                 config_text(cfg), f"predicted capacity {f.get(CAPACITY, float('nan')):.3g} req/s"
                 + (f" (band {lo:.3g}–{hi:.3g})" if lo is not None and hi is not None else
                    " (no band: the search's choosing rule never needed it)")]
        hover += [f"extrapolated: {e}" for e in entry.get("extrapolated") or [] if e.startswith("extrapolated")]
        out.append({"x": f[x], "y": f[y], "x_err": band_error(entry, f[x]) if x == CAPACITY else None,
                    "y_err": band_error(entry, f[y]) if y == CAPACITY else None, "config": cfg,
                    "measured_trial": m.number if m else None, "hover": "<br>".join(hover)})
    return out


def add_predicted_trace(fig: Any, points: Sequence[Mapping[str, Any]]) -> None:
    """The predicted configurations on a Pareto chart: open grey diamonds, named PREDICTED_NAME."""
    import plotly.graph_objects as go

    from tuner.dashboard.curves import error_bars

    if not points:
        return
    fig.add_trace(go.Scatter(
        x=[p["x"] for p in points], y=[p["y"] for p in points], mode="markers", name=PREDICTED_NAME,
        hovertext=[p["hover"] for p in points], hovertemplate="%{hovertext}<extra></extra>",
        error_x=error_bars(points, "x_err"), error_y=error_bars(points, "y_err"),
        marker={"symbol": "diamond-open", "size": 10, "color": "#7f7f7f", "line": {"width": 1.5}}))


# ------------------------------------------------------------------------------ predicted vs measured --- #
def prediction_rows(views: Sequence[TrialView]) -> list[dict[str, Any]]:
    """Each measured trial that was predicted first: predicted (raw model) capacity and band, measured capacity
    (the trial's own capacity search) and CI, signed error (predicted - measured) / measured, within the band."""
    out = []
    for v in views:
        pred = own_prediction(v)
        cap = v.row.trial_capacity if v.row.trial_capacity is not None else v.capacity
        if v.state != "COMPLETE" or pred is None or not cap:
            continue
        meas = num(cap.get("requests_per_s"))
        lo, hi = ci_pair((v.predicted or {}).get("predicted_band"))
        m_lo, m_hi = ci_pair(cap.get("requests_per_s_ci"))
        out.append({
            "trial": v.number, "config": config_text(v.row.config), "predicted_rps": pred,
            "predicted_band_low_rps": lo, "predicted_band_high_rps": hi,
            "calibrated_rps": num((v.predicted or {}).get("predicted_calibrated_requests_per_s")),
            "measured_rps": meas, "measured_ci_low_rps": m_lo, "measured_ci_high_rps": m_hi,
            "verdict": cap.get("verdict"),
            "signed_error": (pred - meas) / meas if meas else None,
            "within_band": None if lo is None or hi is None or meas is None else lo <= meas <= hi,
        })
    return out


def prediction_summary(rows: Sequence[Mapping[str, Any]], record: Mapping[str, Any] | None) -> str | None:
    """One line: configurations predicted, measured, the model's error over them, how many fell in their band."""
    if not rows and not record:
        return None
    errs = [abs(r["signed_error"]) for r in rows if r["signed_error"] is not None]
    inside = [r["within_band"] for r in rows if r["within_band"] is not None]
    n_pred = (record or {}).get("n_predicted", len((record or {}).get("configurations") or []))
    head = (f"predicted {n_pred} of {record.get('n_configurations', n_pred)} configurations, " if record else "") + \
        f"measured {len(rows)} of them"
    if not errs:
        return head + "; no measured capacity to compare yet"
    return (head + f"; model error |predicted - measured| / measured over the {len(errs)} measured: median "
            f"{statistics.median(errs):.0%}, worst {max(errs):.0%}; {sum(inside)} of {len(inside)} measured within "
            "their predicted band")


def scatter_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Predicted (x, raw model, band as error bar) vs measured (y, CI as error bar) capacity per measured trial,
    with the identity line. Trace names: 'within the band', 'outside the band', 'predicted = measured'."""
    import plotly.graph_objects as go

    pts = [r for r in rows if r["measured_rps"] is not None]
    top = max([0.0] + [v for r in pts for v in (r["predicted_rps"], r["measured_rps"], r["predicted_band_high_rps"],
                                                r["measured_ci_high_rps"]) if v is not None]) * 1.1 or 1.0
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="predicted = measured", hoverinfo="skip",
                             line={"color": "#aaaaaa", "dash": "dash", "width": 1}))
    for inside, name, colour in ((True, "within the band", "#2ca02c"), (False, "outside the band", "#d62728"),
                                 (None, "no band", "#7f7f7f")):
        sel = [r for r in pts if r["within_band"] is inside]
        if not sel:
            continue
        fig.add_trace(go.Scatter(
            x=[r["predicted_rps"] for r in sel], y=[r["measured_rps"] for r in sel], mode="markers+text", name=name,
            text=[str(r["trial"]) for r in sel], textposition="top center", customdata=[[r["trial"]] for r in sel],
            hovertext=[f"<b>trial {r['trial']}</b> {r['config']}<br>predicted {r['predicted_rps']:.3g} req/s, "
                       f"measured {r['measured_rps']:.3g} req/s"
                       + (f", error {r['signed_error']:+.0%}" if r["signed_error"] is not None else "") for r in sel],
            hovertemplate="%{hovertext}<extra></extra>",
            error_x=_bars(sel, "predicted_rps", "predicted_band_low_rps", "predicted_band_high_rps"),
            error_y=_bars(sel, "measured_rps", "measured_ci_low_rps", "measured_ci_high_rps"),
            marker={"size": 12, "color": colour, "line": {"width": 1, "color": "#333"}}))
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 60, "b": 10},
                      title={"text": "capacity: predicted (x, band) vs measured (y, 95% CI)", "font": {"size": 14}},
                      xaxis_title="predicted capacity (req/s, model)", yaxis_title="measured capacity (req/s)",
                      xaxis_range=[0, top], yaxis_range=[0, top],
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0})
    return fig


def _bars(rows: Sequence[Mapping[str, Any]], value: str, low: str, high: str) -> dict[str, Any]:
    """Error bars from a low/high pair around `value` (a missing side: none; an open CI top is not drawn)."""
    plus = [max(0.0, r[high] - r[value]) if r[high] is not None else 0.0 for r in rows]
    minus = [max(0.0, r[value] - r[low]) if r[low] is not None else 0.0 for r in rows]
    return {"type": "data", "symmetric": False, "array": plus, "arrayminus": minus, "color": "#555", "thickness": 1}


def axes_for_predictions(fields: Sequence[str], x: str, y: str, record: Mapping[str, Any] | None) -> tuple[str, str]:
    """The Pareto chart's default axes for a study with predictions: capacity against quality when quality was
    scored, else against the batch cap (predictions have no latency: on a latency axis none would show)."""
    if not record or x != CAPACITY or y.startswith(("quality.", "config.")) or "config.batch_cap" not in fields:
        return x, y
    return x, "config.batch_cap"
