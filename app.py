"""tuner dashboard: `streamlit run app.py [-- --storage URL]` or `tuner dashboard [--storage URL]`.

Reads an Optuna storage written by `tuner search` (default sqlite:///results/tuner.db, or $TUNER_STORAGE) and shows
a study's Pareto view (capacity vs quality), the latency-load curves of chosen trials, its trials, one trial in
detail, why the recommendation was made, and the selected trial's serving configs. While a search runs, the page
reloads when trials start or finish. Layout only: the data shaping lives in tuner/dashboard/ (data.py: the storage;
study.py: a study and its trials; fields.py, figures.py: chart fields and points; views.py: table, hover, detail;
why.py: the answer; exports.py; curves.py: capacity curves and the Plotly figures).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import streamlit as st

from tuner.dashboard import curves, whatif
from tuner.dashboard.data import display_url, open_storage_readonly, sqlite_path, storage_from_argv
from tuner.dashboard.exports import config_json, exports
from tuner.dashboard.fields import axis_fields, default_axes, direction, field_label
from tuner.dashboard.figures import chart_points, pareto_line, quality_range, target_lines
from tuner.dashboard.predicted import (
    MEASURED_NOTE,
    PREDICTED_NOTE,
    add_predicted_trace,
    axes_for_predictions,
    has_predictions,
    predicted_points,
    prediction_record,
    prediction_rows,
    prediction_summary,
    scatter_figure,
)
from tuner.dashboard.study import (
    StudyInfo,
    TrialView,
    bound_lines,
    has_capacity,
    signature,
    state_counts,
    study_info,
    trial_views,
)
from tuner.dashboard.views import config_text, detail, ecdf, filter_rows, first_line, latency_samples, table_rows
from tuner.dashboard.why import constraint_table, latency_at, param_importances, recommended_number, study_answer, why
from tuner.errors import TunerError

st.set_page_config(page_title="tuner dashboard", layout="wide")  # no page_icon: a material one is fetched online

STORAGE = storage_from_argv(sys.argv[1:], os.environ)
SEARCH_HINT = ("Run a search first, e.g. `tuner search --model smollm2-135m --latency-target 3s`, or point the "
               "dashboard at another storage: `tuner dashboard --storage URL`.")


# ------------------------------------------------------------------------------------------------- loading --- #
@st.cache_resource(show_spinner=False)
def storage(url: str) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return open_storage_readonly(url)  # a TunerError is not cached: a file created later is picked up


def study_names(url: str) -> list[str]:
    import optuna

    return sorted(optuna.study.get_all_study_names(storage(url)))


def load(url: str, name: str) -> tuple[Any, list[Any]]:
    import optuna

    study = optuna.load_study(study_name=name, storage=storage(url))
    return study, study.get_trials(deepcopy=False)


def page_signature(url: str, name: str | None) -> Any:
    """Cheap fingerprint of what the page shows: the studies and the selected study's trial states."""
    try:
        names = study_names(url)
        if name not in names:
            return ("studies", tuple(names))
        return ("trials", tuple(names), signature(load(url, name)[1]))
    except Exception as e:  # a missing or locked database is retried at the next check
        return ("error", f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------------- sidebar --- #
def sidebar() -> str | None:
    """The study to show (None, with a friendly message, when there is none)."""
    st.sidebar.title("tuner")
    st.sidebar.caption(f"storage `{display_url(STORAGE)}`")
    try:
        names = study_names(STORAGE)
    except Exception as e:  # TunerError (missing file, bad URL), or the database refusing a read right now
        st.sidebar.warning("no storage yet")
        path = sqlite_path(STORAGE)
        if path is not None and not path.is_file():
            st.info(f"No study database at `{path}` yet. {SEARCH_HINT}", icon=":material/info:")
        else:
            msg = first_line(str(e)) or type(e).__name__
            st.info(f"The storage cannot be read: {msg}. {SEARCH_HINT}", icon=":material/info:")
        return None
    if not names:
        st.info(f"The storage `{display_url(STORAGE)}` has no study yet. {SEARCH_HINT}",
                icon=":material/info:")
        return None
    wanted = st.query_params.get("study")
    if "study" not in st.session_state or st.session_state["study"] not in names:
        st.session_state["study"] = wanted if wanted in names else names[-1]
    name = st.sidebar.selectbox("Study", names, key="study", help="studies in this storage")
    st.query_params["study"] = name
    return name


def live_controls(name: str | None) -> None:
    live = st.sidebar.toggle("Live refresh", value=True, key="live",
                             help="reload the page when trials start or finish (while a search runs)")
    every = st.sidebar.select_slider("Check every", options=[2, 5, 10, 30, 60], value=5, key="every",
                                     format_func=lambda s: f"{s} s", disabled=not live)
    st.session_state["sig"] = page_signature(STORAGE, name)

    def watch() -> None:
        sig = page_signature(STORAGE, name)
        st.caption(f"checked {time.strftime('%H:%M:%S')}")
        if sig != st.session_state.get("sig"):
            st.session_state["sig"] = sig
            st.rerun(scope="app")

    with st.sidebar:
        if live:
            st.fragment(watch, run_every=every)()
        else:
            st.caption("live refresh off")


# ---------------------------------------------------------------------------------------------- the study --- #
def header(info: StudyInfo, views: list[TrialView], rec: int | None) -> None:
    st.title(f"{info.name}")
    bits = [f"model **{info.model}**" if info.model else None,
            f"target **{info.primary}**" if info.primary else None,
            "quality not scored" if (info.attrs.get("quality") or {}).get("scored") is False else
            f"quality budget **{info.max_quality_drop:g} pp**" if isinstance(info.max_quality_drop, (int, float))
            else None]
    st.markdown(" · ".join(b for b in bits if b) or "a study not written by `tuner search`")
    c = state_counts(views)
    cols = st.columns(6)
    cols[0].metric("trials", c["trials"])
    cols[1].metric("complete", c["COMPLETE"])
    cols[2].metric("feasible", c["feasible"])
    cols[3].metric("pruned", c["PRUNED"])
    cols[4].metric("failed", c["FAIL"])
    cols[5].metric("running", c["RUNNING"] + c["WAITING"])
    if rec is not None:
        best = next((v for v in views if v.number == rec), None)
        if best is not None:
            figure = (f"capacity **{curves.capacity_text(best.capacity)}**" if best.capacity else
                      f"**{best.tok_s:.2f} output tok/s**")
            st.success(f"Recommended: **trial {rec}** — {config_text(best.row.config)} — {figure}"
                       + (f" — engine {best.engine_label}" if best.engine_label else ""), icon=":material/star:")
    if not has_capacity(views):
        st.caption(curves.LEGACY_NOTE)


def trial_label(v: TrialView) -> str:
    """What never changes about a trial (the browser keeps showing the label a selection was made with)."""
    return f"#{v.number} · {config_text(v.row.config)}" + (" · baseline" if v.baseline else "")


def trial_status(v: TrialView, rec: int | None) -> str:
    tags = [v.state.lower()]
    if v.state == "COMPLETE":
        tags.append("feasible" if v.feasible else "infeasible")
    if v.number == rec:
        tags.append("**recommended**")
    return ", ".join(tags)


def select_trial(views: list[TrialView], rec: int | None) -> TrialView:
    views = [v for v in views if v.row.config] or views  # a trial gets its config as soon as it starts
    numbers = [v.number for v in views]
    by_number = {v.number: v for v in views}
    if st.session_state.get("trial") not in numbers:
        finished = [v for v in views if v.state == "COMPLETE"]
        default = rec if rec in numbers else (max(finished, key=lambda v: (v.capacity_rps or 0.0, v.tok_s))
                                              .number if finished else numbers[-1])
        st.session_state["trial"] = default
    n = st.selectbox("Selected trial (also: click a point or a table row)", numbers, key="trial",
                     format_func=lambda k: trial_label(by_number[k]))
    st.caption(f"trial {n}: {trial_status(by_number[n], rec)}")
    return by_number[n]


def pick_from_chart() -> None:
    state = st.session_state.get("pareto_chart")
    points = (state or {}).get("selection", {}).get("points", []) if state else []
    for p in points:
        cd = p.get("customdata")
        num = cd[0] if isinstance(cd, (list, tuple)) else cd
        if isinstance(num, (int, float)):
            st.session_state["trial"] = int(num)
            return


def pick_from_table() -> None:
    state = st.session_state.get("trials_table")
    rows = (state or {}).get("selection", {}).get("rows", []) if state else []
    shown = st.session_state.get("_table_numbers", [])
    if rows and rows[0] < len(shown):
        st.session_state["trial"] = shown[rows[0]]


# ------------------------------------------------------------------------------------------------ sections --- #
def pareto_tab(views: list[TrialView], info: StudyInfo, rec: int | None) -> None:
    fields = axis_fields(views, info)
    if not fields:
        st.info("No trial has metrics yet.")
        return
    record = prediction_record(info.attrs)
    default_x, default_y = axes_for_predictions(fields, *default_axes(fields, info, has_capacity(views)), record)
    for key in (f"x_axis_{info.name}", f"y_axis_{info.name}"):  # a field this study no longer offers
        if key in st.session_state and st.session_state[key] not in fields:
            del st.session_state[key]
    c1, c2 = st.columns(2)  # keys per study: each study opens on its own default axes
    x = c1.selectbox("x axis", fields, index=fields.index(default_x), format_func=field_label,
                     key=f"x_axis_{info.name}")
    y = c2.selectbox("y axis", fields, index=fields.index(default_y), format_func=field_label,
                     key=f"y_axis_{info.name}")
    points = chart_points(views, x, y, info, rec)
    front = pareto_line(points, direction(x), direction(y))
    fig = curves.pareto_figure(points, front, target_lines(info, x, y), field_label(x), field_label(y))
    predicted = predicted_points(record, views, x, y)
    add_predicted_trace(fig, predicted)
    say_source(fig, "measured trials" + (" and predicted configurations (open diamonds, not measured)" if predicted else ""))
    st.plotly_chart(fig, key="pareto_chart", on_select=pick_from_chart, selection_mode="points",
                    config={"displaylogo": False})
    n_front = len(front)
    bars = any(p["x_err"] or p["y_err"] for p in points)
    st.caption(f"{len(points)} of {len(views)} trials plotted (trials without both values are left out) · "
               f"colour = quality score" + ("" if quality_range(points) else " (not scored: grey)") + " · "
               + ("error bars: capacity and latency CIs, quality ± stderr · " if bars else "")
               + (f"{n_front} trial(s) on the feasible front of these two axes" if front else
                  "no front for these axes" if direction(x) is None or direction(y) is None else
                  "no feasible trial yet"))
    if record:
        n = len(record["configurations"])
        st.caption(f"{len(predicted)} of {n} predicted configurations drawn (open diamonds: {PREDICTED_NOTE}; their "
                   "band as the capacity's error bar; quality: the score measured for their format)"
                   + ("" if predicted else " · predictions have a capacity, knobs and their format's quality only: "
                                           "choose such axes to see them"))


def say_source(fig: Any, text: str) -> None:
    """Say on the figure whether it shows measured or predicted figures."""
    fig.update_layout(title={"text": text, "font": {"size": 13}, "y": 0.995, "yanchor": "top"},
                      margin={"t": 80})


def curves_tab(views: list[TrialView], info: StudyInfo, rec: int | None) -> None:
    have = curves.curve_trials(views)
    if not have:
        st.info("No latency-load curves: " + (curves.LEGACY_NOTE if not has_capacity(views) else
                                              "no trial has capacity probes yet."), icon=":material/info:")
        return
    by_number = {v.number: v for v in views}
    fields = curves.curve_fields(views, info.latency_field)
    c1, c2 = st.columns([3, 1])  # keys per study: a choice made on another study does not carry over
    chosen = c1.multiselect("Trials to compare", have, default=curves.default_curve_trials(views, rec),
                            key=f"curve_trials_{info.name}", format_func=lambda k: trial_label(by_number[k]))
    field = c2.selectbox("Latency", fields, key=f"curve_metric_{info.name}", format_func=curves.field_label)
    if not chosen:
        st.info("Choose trials to compare.")
        return
    shown = [curves.latency_curve(by_number[n], field) for n in chosen]
    limits = curves.slo_limits(bound_lines(info), field)
    with st.container(key="load_curves"):
        fig = curves.latency_figure(shown, field, limits)
        say_source(fig, "measured: each probe of the trials' capacity searches")
        st.plotly_chart(fig, key="latency_load_chart",
                        config={"displaylogo": False})
    st.caption(f"x = offered arrival rate of each probe · y = {curves.field_label(field)} of the probe's steady-state "
               "requests, error bars = its confidence interval (an arrow: that side is not bounded by so few "
               "requests) · marker fill = the probe's verdict against the SLO · star = the capacity (the highest "
               "rate shown to meet the SLO), its horizontal bar = the capacity's interval"
               + ("" if limits else " · the SLO sets no limit on this metric"))
    unit = st.radio("Throughput", ["rps", "tok_s"], horizontal=True, key="curve_unit",
                    format_func=lambda u: {"rps": "requests/s", "tok_s": "output tok/s"}[u])
    with st.container(key="throughput_curves"):
        fig = curves.throughput_figure(shown, unit)
        say_source(fig, "measured: achieved vs offered rate of each probe")
        st.plotly_chart(fig, key="throughput_chart", config={"displaylogo": False})
    st.caption("achieved throughput of each probe vs the rate offered: it follows the diagonal while the engine keeps "
               "up and flattens at saturation (dotted: the closed-loop saturation measured before the probes)")


def predicted_tab(views: list[TrialView], info: StudyInfo) -> None:
    """`--strategy predict`: each measured configuration's predicted vs measured capacity, and the what-if."""
    record = prediction_record(info.attrs)
    rows = prediction_rows(views)
    summary = prediction_summary(rows, record)
    if summary:
        st.markdown(summary)
    for entry in (record or {}).get("left_out") or []:
        st.caption(f"not predicted: {entry['configurations']} configuration(s): {entry['why']}")
    if rows:
        with st.container(key="predicted_vs_measured"):
            st.plotly_chart(scatter_figure(rows), key="predicted_measured_chart", config={"displaylogo": False})
        st.caption(f"x = {PREDICTED_NOTE}, its band as the horizontal bar · y = {MEASURED_NOTE}, its 95% interval as "
                   "the vertical bar (no top: the search found no rate above it that misses) · on the dashed line the "
                   "model was exact; above it the model under-predicted")
        cc = st.column_config
        rps = {k: cc.NumberColumn(k.replace("_rps", " (req/s)").replace("_", " "), format="%.3f")
               for k in rows[0] if k.endswith("_rps")}
        st.dataframe(rows, hide_index=True, width="stretch", column_config={
            **rps, "trial": cc.NumberColumn("trial", format="%d"),
            "signed_error": cc.NumberColumn("error (predicted − measured) / measured", format="percent"),
            "within_band": cc.CheckboxColumn("measured within the band")})
    if record:
        whatif_section(record, views, info)


@st.cache_resource(show_spinner=False)
def tokenizer(model: str) -> Any:
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    return load_tokenizer(checkpoint_dir(model))


@st.cache_resource(show_spinner=False)
def whatif_cache(study: str) -> dict[Any, Any]:
    return {}  # capacity pools and simulated capacities, kept between what-ifs of one study


def whatif_section(record: dict[str, Any], views: list[TrialView], info: StudyInfo) -> None:
    from tuner.measure.bench import bench_prompts  # the prompts `tuner bench --capacity` sends for a workload

    st.markdown("#### What-if (predicted: nothing is measured)")
    base = whatif.study_scenario(info.attrs)
    with st.form(key=f"whatif_{info.name}"):
        c = st.columns([3, 2, 2, 2, 2])
        slo = c[0].text_input("SLO", base.slo, help="bounds METRIC:STAT<TIME and targets METRIC<TIME, ';'-separated")
        lens_in = c[1].text_input("input tokens", f"{base.input_len[0]}:{base.input_len[1]}")
        lens_out = c[2].text_input("output tokens", f"{base.output_len[0]}:{base.output_len[1]}")
        arrival = c[3].selectbox("arrivals", ["poisson", "constant"], index=int(base.arrival == "constant"))
        rate = c[4].text_input("target rate (req/s)", "", help="replicas each configuration needs for it")
        asked = st.form_submit_button("Predict every configuration")
    if not asked:
        st.caption(f"{len(record['configurations'])} configurations: change the SLO, the token lengths, the "
                   "arrivals or a target rate and predict their capacities again from the study's engine profiles")
        return
    def pool(config: Any, spec: Any, options: Any) -> list[Any]:  # the model's tokenizer, loaded when first needed
        return bench_prompts(config, spec, tokenizer(str(info.model)), options)[0]

    try:
        scenario = whatif.parse_scenario(slo, lens_in, lens_out, arrival, rate)
        out = whatif.what_if(record, info.attrs, views, scenario, pool, cache=whatif_cache(info.name))
    except TunerError as e:
        st.error(str(e))
        return
    except Exception as e:  # a tokenizer or profile that cannot be read here
        st.error(f"the what-if cannot run here: {first_line(str(e)) or type(e).__name__}")
        return
    if out["message"]:
        st.info(out["message"])
        return
    st.caption(f"{len(out['rows'])} configurations predicted in {out['seconds']:.2f} s ({out['simulations']} "
               f"simulated capacity searches), ranked by predicted capacity · "
               f"{whatif.calibration_text(out['calibration'])}"
               + (" · measured: the trial's capacity, shown under the study's own SLO and workload only"
                  if out.get("same_as_study") else ""))
    for note in out["left_out"]:
        st.caption(f"left out: {note}")
    cc = st.column_config
    st.container(key="whatif_rows").dataframe(out["rows"], hide_index=True, width="stretch", column_config={
        "rank": cc.NumberColumn("rank", format="%d"),
        "predicted_rps": cc.NumberColumn("predicted (req/s, model)", format="%.3f"),
        "calibrated_rps": cc.NumberColumn("predicted, calibrated (req/s)", format="%.3f"),
        "calibration": cc.TextColumn("calibration group"),
        "study_predicted_rps": cc.NumberColumn("predicted in the search (req/s)", format="%.3f"),
        "measured_rps": cc.NumberColumn("measured (req/s)", format="%.3f"),
        "measured_trial": cc.NumberColumn("measured as trial", format="%d"),
        "replicas_needed": cc.NumberColumn("replicas needed (predicted)", format="%d")})


def trials_tab(views: list[TrialView], info: StudyInfo, rec: int | None, study: str) -> None:
    from tuner.search.answer import trials_csv

    rows = table_rows(views, info, rec)
    formats = sorted({r["quant"] for r in rows if r["quant"]})
    states = sorted({r["state"] for r in rows})
    c1, c2, c3 = st.columns([2, 1, 2])  # an empty selection means all (new formats and states included)
    fmts = c1.multiselect("Format", formats, key="f_formats", placeholder="all formats")
    feas = c2.selectbox("Feasibility", ["all", "feasible", "infeasible"], key="f_feasible")
    sts = c3.multiselect("State", states, key="f_states", placeholder="all states")
    shown = filter_rows(rows, fmts or None, feas, sts or None)
    st.session_state["_table_numbers"] = [r["number"] for r in shown]
    st.caption(f"{len(shown)} of {len(rows)} trials shown · click a column header to sort, a row to select it")
    cc = st.column_config
    ms_columns = {k: cc.NumberColumn(k.replace("_ms", " (ms)").replace("_", " "), format="%.0f")
                  for k in (rows[0] if rows else {}) if k.endswith("_ms")}
    st.dataframe(shown, hide_index=True, key="trials_table", on_select=pick_from_table,
                 selection_mode="single-row", width="stretch", column_config={
                     "number": cc.NumberColumn("trial", format="%d"),
                     "recommended": cc.CheckboxColumn("★"),
                     "output_tokens_per_s": cc.NumberColumn("output tok/s", format="%.2f"),
                     "capacity_rps": cc.NumberColumn("capacity req/s", format="%.3f",
                                                     help="highest request rate shown to meet the SLO"),
                     "capacity_ci_low_rps": cc.NumberColumn("CI low", format="%.3f"),
                     "capacity_ci_high_rps": cc.NumberColumn("CI high", format="%.3f"),
                     "verdict": cc.TextColumn("SLO verdict", help="meets / misses / indeterminate at the capacity"),
                     "quality_gate": cc.TextColumn("quality gate", help="within / exceeds / indeterminate budget"),
                     "goodput_rps": cc.NumberColumn("goodput req/s", format="%.3f"),
                     "kv_fraction": cc.NumberColumn("KV fraction", format="%.4f"),
                     **ms_columns,
                     "acceptance_rate": cc.NumberColumn("acceptance", format="%.2f"),
                     "drop_pp": cc.NumberColumn("drop pp", format="%.2f"),
                     "peak_rss_mb": cc.NumberColumn("peak RSS MB", format="%.0f"),
                     "peak_cuda_mb": cc.NumberColumn("peak CUDA MB", format="%.0f"),
                     "quality_score": cc.NumberColumn("quality", format="%.3f"),
                     "quality_stderr": cc.NumberColumn("± stderr", format="%.3f"),
                     "cost_per_million_tokens": cc.NumberColumn("$/1M tok", format="%.2f"),
                     "duration_s": cc.NumberColumn("duration (s)", format="%.0f"),
                     "reason": cc.TextColumn("reason", width="medium", help="why a trial failed or was pruned"),
                 })
    st.download_button("Download trials.csv", trials_csv([v.row for v in views]), file_name=f"{study}-trials.csv",
                       mime="text/csv", on_click="ignore", key="dl_csv")


CONSTRAINT_COLUMNS = {"value": st.column_config.NumberColumn("value (≤ 0 satisfied)", format="%.2f"),
                      "slack": st.column_config.NumberColumn("slack", format="%.2f")}


def detail_tab(v: TrialView, info: StudyInfo) -> None:
    import plotly.graph_objects as go

    d = detail(v)
    st.subheader(f"Trial {v.number} — {v.state}" + (" (baseline)" if v.baseline else ""))
    if d["reason"]:
        (st.error if v.state == "FAIL" else st.warning)(f"{v.state.lower()}: {d['reason']}")
    capacity_block(v, d, info)
    left, right = st.columns([1, 2])
    with left:
        st.markdown("**Config**")
        st.json(d["config"], expanded=True)
        cols = st.columns(2)
        if d["output_tokens_per_s"] is not None:
            cols[0].metric("output tok/s", f"{d['output_tokens_per_s']:.2f}")
        if d["completed"] is not None:
            cols[1].metric("requests ok / failed", f"{d['completed']} / {d['failed']}")
        mem = [("peak RSS", d["peak_rss_mb"]), ("peak CUDA", d["peak_cuda_mb"])]
        for col, (label, val) in zip(st.columns(2), mem):
            col.metric(label, f"{val:.0f} MB" if val is not None else "—")
        if d["uses_draft"]:
            st.metric("draft acceptance rate", f"{d['acceptance_rate']:.2f}" if d["acceptance_rate"] is not None
                      else "not recorded")
        else:
            st.caption("no speculative draft (acceptance rate does not apply)")
    with right:
        samples = latency_samples(v.requests)
        if any(samples.values()):
            fig = go.Figure()
            for key, name, col in (("ttft_ms", "TTFT", "#1f77b4"), ("e2e_ms", "E2E", "#ff7f0e")):
                xs, ys = ecdf(samples[key])
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", line_shape="hv", name=name,
                                         line={"color": col}))
            for line in target_lines(info, "ttft_ms.p99", "e2e_ms.p99"):  # a TTFT/E2E target on this scale
                biggest = max(samples["ttft_ms"] + samples["e2e_ms"])
                if line["value"] <= 2 * biggest:
                    fig.add_vline(line["value"], line_dash="dash", line_color="#d62728",
                                  annotation_text=line["label"])
                else:
                    st.caption(f"{line['label']} is far right of these latencies (off the chart)")
            fig.update_layout(height=330, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                              title=f"measured latency of its {len(v.requests)} requests (CDF)", xaxis_title="ms",
                              yaxis_title="share of requests", yaxis_range=[0, 1.02])
            st.plotly_chart(fig, key="latency_cdf")
        else:
            st.info("No per-request latencies recorded for this trial.")
        if d["percentiles"]:
            st.markdown("**Latency**" + (" at the capacity point (CI: distribution-free 95%)" if v.capacity else ""))
            st.dataframe(curves.percentile_rows(v.row.metrics), hide_index=True, width="stretch",
                         column_config={s: st.column_config.NumberColumn(s, format="%.1f")
                                        for s in ("p50", "p90", "p95", "p99", "mean")})
        if d["tasks"]:
            st.markdown("**Quality per task** (accuracy ± standard error)")
            q = d["quality"]
            st.caption(f"suite score {q.get('score', float('nan')):.3f} ± {q.get('score_stderr', float('nan')):.3f}"
                       + (f" · drop {q['drop_pp']:+.2f} pp vs baseline" if "drop_pp" in q else "")
                       + (f" · {q['limit']} examples per task" if "limit" in q else ""))
            tfig = go.Figure(go.Bar(x=[t["task"] for t in d["tasks"]], y=[t["acc"] for t in d["tasks"]],
                                    error_y={"type": "data", "array": [t["acc_stderr"] or 0 for t in d["tasks"]]}))
            tfig.update_layout(height=260, margin={"l": 10, "r": 10, "t": 40, "b": 10}, yaxis_range=[0, 1],
                               title="measured accuracy per task",
                               yaxis_title="accuracy")
            st.plotly_chart(tfig, key="quality_tasks")
            st.dataframe(d["tasks"], hide_index=True, width="stretch")
        elif v.state == "COMPLETE":
            st.caption("quality not scored for this trial")
    if d["failed_requests"]:
        with st.expander(f"{len(d['failed_requests'])} failed request(s)"):
            st.code("\n".join(str(x) for x in d["failed_requests"]), language=None)
    if d["constraints"] is not None:
        st.markdown("**Constraints** (≤ 0 is satisfied)")
        st.dataframe(constraint_table(info.constraint_names, d["constraints"]), hide_index=True,
                     column_config=CONSTRAINT_COLUMNS)


def capacity_block(v: TrialView, d: dict[str, Any], info: StudyInfo) -> None:
    """Capacity with CI and verdict, quality gate, engine, and the probes of the capacity search."""
    cap, gate = d["capacity"], d["gate"] or {}
    cols = st.columns(4)
    again = d["in_trial_requests_per_s"]
    cols[0].metric("capacity (req/s)", f"{cap['requests_per_s']:.3f}" if cap and cap["requests_per_s"] is not None
                   else "—", help=cap["text"] if cap else "not measured by capacity (an older study)")
    if again is not None:
        st.caption(f"capacity re-measured after the search (the figure shown); its trial measured {again:.3f} req/s")
    lo, hi = cap["ci_rps"] if cap else (None, None)
    cols[1].metric("capacity CI (req/s)", f"{curves.fmt(lo, '.3f')} – {curves.fmt(hi, '.3f', 'open')}" if cap else "—")
    cols[2].metric("SLO verdict / quality gate", f"{(cap or {}).get('verdict') or '—'} / {gate.get('verdict') or '—'}",
                   help=f"quality drop {gate.get('drop_pp')} pp, CI {gate.get('drop_ci_pp')}, budget "
                        f"{gate.get('budget_pp')} pp" if gate else "quality gate not recorded")
    cols[3].metric("engine", d["engine_label"] or "not recorded")
    if not cap:
        return
    slo = "; ".join(cap["slo"].get("bounds") or []) or str(cap["slo"].get("targets_ms") or "")
    sat = cap["saturation"]
    st.caption(f"SLO {slo} at {curves.fmt(curves.num(cap['slo'].get('confidence')), '.0%')} confidence · "
               f"saturation {curves.fmt(curves.num(sat.get('requests_per_s')), '.3g')} req/s (closed loop, "
               f"{sat.get('concurrency')} in flight) · capacity search: {cap['n_probes']} probes, "
               f"{cap['cost'].get('requests')} requests, {curves.fmt(curves.num(cap['cost'].get('wall_s')), '.0f')} s")
    for note in cap["notes"]:
        st.caption(f"note: {note}")
    field = info.latency_field or "ttft_ms.p90"
    pts = curves.latency_curve(v, field)["points"]
    with st.expander(f"{len(pts)} probe(s) of the capacity search ({curves.field_label(field)})", expanded=False):
        st.dataframe([{"offered req/s": p["rate_rps"], "achieved req/s": p["achieved_rps"],
                       "output tok/s": p["output_tokens_per_s"], curves.field_label(field): p["y"],
                       "CI low": p["ci_low"], "CI high": p["ci_high"], "attainment": p["attainment"],
                       "verdict": p["verdict"], "n": p["n"], "failed": p["failed"]} for p in pts], hide_index=True)


def why_tab(views: list[TrialView], trials: list[Any], info: StudyInfo) -> None:
    import plotly.graph_objects as go

    w = why(views, info)
    by_number = {v.number: v for v in views}

    def figures(n: Any) -> dict[str, Any]:  # a trial of the answer, with its figures from the trial itself
        v = by_number[n]
        return {"trial": n, "config": config_text(v.row.config), "engine": v.engine_label,
                "capacity": curves.capacity_text(v.capacity), "output tok/s": v.tok_s,
                f"{curves.field_label(info.latency_field or '.')}": latency_at(v, info), "quality": v.row.quality.get("score"),
                "quality gate": (v.row.quality.get("gate") or {}).get("verdict")}

    if "message" in w:
        st.info(w["message"])
    elif "legacy" in w:
        st.info(w["legacy"], icon=":material/info:")
        if w["recommended"] is not None:
            v = by_number[w["recommended"]]
            st.markdown(f"### Trial {v.number}: {config_text(v.row.config)} — {v.tok_s:.2f} output tok/s")
            st.dataframe(w["constraints"], hide_index=True, column_config=CONSTRAINT_COLUMNS)
    else:
        a = w["answer"]
        rec, cap = a.get("recommendation"), w.get("capacity")
        if rec:
            best = by_number[rec["trial"]]
            st.markdown(f"### Trial {best.number}: {config_text(best.row.config)}")
            cols = st.columns(4)
            r = cap["recommended"]
            cols[0].metric("capacity (req/s)", f"{r['requests_per_s']:.3f}" if r["requests_per_s"] is not None
                           else "—", help=r["text"])
            lat = latency_at(best, info)
            cols[1].metric(f"{curves.field_label(info.latency_field or '.')} at capacity", f"{lat:.0f} ms" if lat is not None else "—",
                           help=f"SLO {'; '.join(info.slo.get('bounds') or []) or info.primary}")
            gain, g_ci = rec.get("gain_over_baseline"), curves.ci_pair(rec.get("gain_ci"))
            cols[2].metric("gain over baseline", f"{gain:.2f}×" if gain else "—",
                           help=f"capacity / the engine-default baseline's capacity, interval "
                                f"{curves.fmt(g_ci[0], '.2f')}–{curves.fmt(g_ci[1], '.2f')}")
            q = best.row.quality.get("score")
            gate = (best.row.quality.get("gate") or {}).get("verdict")
            cols[3].metric("quality", f"{q:.3f}" if q is not None else "not scored", help=f"quality gate: {gate}")
            if rec.get("statement"):
                st.markdown(f"> {rec['statement']}")
            base = cap.get("baseline")
            st.markdown(
                f"It is the feasible configuration with the highest capacity: **{a.get('n_feasible')}** of "
                f"**{a.get('n_trials')}** trials met every constraint ({a.get('n_pruned')} pruned, "
                f"{a.get('n_failed')} failed). " + (f"The baseline sustained {base['text']}. " if base else "")
                + f"**Binding constraint:** {rec.get('binding_constraint')}."
                + (f" Not distinguishable from it by the evidence: trial(s) "
                   f"{', '.join(str(n) for n in rec['indistinguishable_from'])}."
                   if rec.get("indistinguishable_from") else ""))
            st.dataframe(w.get("constraints", []), hide_index=True, column_config=CONSTRAINT_COLUMNS)
            if a.get("runners_up"):
                st.markdown("**Runners-up**")
                st.dataframe([{**figures(r["trial"]), "vs recommendation": r.get("vs_best")}
                              for r in a["runners_up"] if r.get("trial") in by_number], hide_index=True)
        else:
            st.warning("No feasible configuration yet.")
            c = a.get("closest")
            if c:
                st.markdown(f"Closest miss: **trial {c['trial']}** ({config_text(c.get('config') or {})}), "
                            f"missing: " + ", ".join(f"{k} by {v:g}" for k, v in (c.get("misses") or {}).items()))
                st.dataframe(w.get("constraints", []), hide_index=True, column_config=CONSTRAINT_COLUMNS)
        if a.get("pareto_front"):
            st.markdown("**Feasible Pareto front** (capacity, quality)")
            st.dataframe([figures(p["trial"]) for p in a["pareto_front"] if p.get("trial") in by_number],
                         hide_index=True)
    st.markdown("#### Parameter importance (fANOVA)")
    imps = importances(tuple(signature(trials)), info.name)
    titles = {"throughput": "throughput (output tok/s)", "latency": f"latency ({info.latency_metric})",
              "capacity": "capacity (req/s)", "quality": "quality score"}
    for col, (label, res) in zip(st.columns(2), imps.items()):
        with col:
            if "importances" in res:
                items = sorted(res["importances"].items(), key=lambda kv: kv[1])
                fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h"))
                fig.update_layout(height=220, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title=f"{titles[label]}, over the measured trials",
                                  xaxis_title="share of variance", xaxis_range=[0, 1])
                st.plotly_chart(fig, key=f"imp_{label}")
            else:
                st.markdown(f"**{titles[label]}**")
                st.info(f"Importance {res['message']}.")


@st.cache_data(show_spinner=False, max_entries=32)
def importances(sig: tuple, name: str) -> dict[str, dict[str, Any]]:
    study, trials = load(STORAGE, name)
    return param_importances(trials, study.directions)


def export_tab(v: TrialView, study: str) -> None:
    from tuner.export.locate import locate

    st.subheader(f"Serving configs for trial {v.number}")
    if v.state != "COMPLETE" or not v.row.config:
        st.info(f"Trial {v.number} is {v.state}: only COMPLETE trials can be exported. Select another trial.")
        return
    conf = config_json(v)
    st.markdown("**Trial config** (`tuner bench --config`, `tuner export --config`)")
    st.code(json.dumps(json.loads(conf), indent=2), language="json")
    st.download_button("Download config.json", conf + "\n", file_name=f"{study}-trial{v.number}-config.json",
                       mime="application/json", on_click="ignore", key=f"dl_conf_{v.number}")
    exps = exports(v, study, paths=locate)
    tabs = st.tabs([e["target"] for e in exps])
    for tab, e in zip(tabs, exps):
        with tab:
            if "error" in e:
                st.error(e["error"])
                continue
            st.markdown(f"**{e['engine']}** — equivalent to `tuner export --study {study} --trial {v.number} "
                        f"--to {e['target']}`")
            st.code(e["command"], language="bash")
            if e["warnings"]:
                st.warning("\n".join(f"- {w}" for w in e["warnings"]))
            for fname, text in e["files"].items():
                st.markdown(f"`{fname}`")
                lang = {"sh": "bash", "py": "python", "yaml": "yaml", "json": "json"}.get(fname.rsplit(".", 1)[-1])
                st.code(text, language=lang)
                st.download_button(f"Download {fname}", text, file_name=fname, on_click="ignore",
                                   key=f"dl_{e['target']}_{fname}_{v.number}")
            st.download_button("Download export JSON", e["json"], file_name=f"{study}-trial{v.number}-"
                               f"{e['target']}.json", mime="application/json", on_click="ignore",
                               key=f"dl_{e['target']}_json_{v.number}")
            with st.expander("How each knob carried over"):
                st.markdown("\n".join(f"- {n}" for n in e["notes"]))


# ---------------------------------------------------------------------------------------------------- main --- #
def main() -> None:
    name = sidebar()
    live_controls(name)
    if name is None:
        return
    try:
        study, trials = load(STORAGE, name)
    except Exception as e:  # deleted meanwhile, or the database refusing a read right now
        st.info(f"Study `{name}` cannot be read right now ({first_line(str(e)) or type(e).__name__}); "
                "the page tries again at the next refresh.")
        return
    info = study_info(name, study.user_attrs)
    views = trial_views(trials, study.user_attrs)
    if not any(v.finished for v in views):
        running = sum(v.state in ("RUNNING", "WAITING") for v in views)
        st.title(name)
        st.info(f"Study `{name}` has no finished trial yet"
                + (f" ({running} running: this page reloads when one finishes)." if running else ".")
                + " Trials appear here as the search completes them.", icon=":material/hourglass_top:")
        return
    ans = study_answer(views, info)
    rec = recommended_number(ans, info)
    header(info, views, rec)
    selected = select_trial(views, rec)
    names = ["Pareto", "Latency–load", "Trials", "Trial detail", "Why this one", "Export"]
    predicted = has_predictions(info.attrs, views)
    tabs = st.tabs(names[:2] + ["Predicted vs measured"] + names[2:] if predicted else names)
    t_pareto, t_curves, t_trials, t_detail, t_why, t_export = tabs[:2] + tabs[-4:]
    if predicted:
        with tabs[2]:
            predicted_tab(views, info)
    with t_pareto:
        pareto_tab(views, info, rec)
    with t_curves:
        curves_tab(views, info, rec)
    with t_trials:
        trials_tab(views, info, rec, name)
    with t_detail:
        detail_tab(selected, info)
    with t_why:
        why_tab(views, trials, info)
    with t_export:
        export_tab(selected, name)


main()
