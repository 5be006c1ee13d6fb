"""The dashboard: the pure data shaping (tuner/dashboard/*.py), `tuner dashboard`'s input
checks, and the real app (app.py served by Streamlit) in a real headless Chromium driven by Playwright, on a study
written by a real `tuner search` (measured by capacity: latency-load curves), on in-memory studies shaped like it,
and on one from before the capacity measure. Screenshots go to results/dashboard/ for a person to look at.

Set TUNER_TEST_STORAGE (and TUNER_TEST_STUDY, default "tiny") to reuse a study instead of running the search."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner
from tuner.dashboard import curves
from tuner.dashboard.data import display_url, open_storage_readonly, storage_from_argv
from tuner.dashboard.exports import config_json, exports
from tuner.dashboard.fields import axis_fields, default_axes, direction, field_label
from tuner.dashboard.figures import chart_points, pareto_line, quality_range, target_lines
from tuner.dashboard.study import (
    CAPACITY,
    bound_lines,
    has_capacity,
    metric_field,
    signature,
    state_counts,
    study_info,
    trial_views,
)
from tuner.dashboard.views import detail, ecdf, filter_rows, latency_samples, table_rows
from tuner.dashboard.why import latency_at, param_importances, recommended_number, study_answer, why
from tuner.errors import TunerError
from tuner.search.storage import check_storage_url

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = REPO / "results" / "dashboard"
ROW_PX = 35  # Streamlit's data frame row (and header) height
LOAD_S = 120  # first page load imports optuna, plotly, transformers' config... on a busy 2-core machine


# ============================================================================== pure functions (in-memory) === #
def _pct(v: float, n: int = 40, open_high: bool = False) -> dict:
    """A percentile object as tuner.measure.metrics writes it: p90 = v, its CI (the upper side None when `open_high`)."""
    ci = {s: [v * f * 0.8, None if open_high and s in ("p95", "p99") else v * f * 1.25]
          for s, f in (("p50", 0.5), ("p90", 1.0), ("p95", 1.1), ("p99", 1.3))}
    if open_high:
        ci["p90"][1] = None
    return {"p50": v / 2, "p90": v, "p95": v * 1.1, "p99": v * 1.3, "mean": v / 2, "n": n, "ci": ci}


def _probe(rate: float, ttft_p90: float, tok_s: float, verdict: str, open_high: bool = False) -> dict:
    return {"rate_rps": rate, "n": 40, "achieved_rps": rate * 0.98, "output_tokens_per_s": tok_s,
            "ttft_ms": _pct(ttft_p90, open_high=open_high), "tpot_ms": _pct(40.0), "e2e_ms": _pct(ttft_p90 + 500),
            "itl_ms": _pct(40.0), "attainment": None, "attainment_ci": None, "verdict": verdict, "failed": 0}


SLO = {"bounds": ["ttft:p90<3000ms"], "targets_ms": {}, "attainment": None, "confidence": 0.95}


def _capacity(cap: float, ttft: float, tok: float) -> dict:
    """A capacity measurement as tuner.measure.capacity writes it: probes at half, the capacity and 1.5x (the last one
    misses, with an open CI side), capacity = the highest meeting rate, its CI up to the first missing rate."""
    probes = [_probe(cap * 0.5, ttft * 0.4, tok * 0.5, "meets"), _probe(cap, ttft, tok, "meets"),
              _probe(cap * 1.5, ttft * 2.5, tok * 1.1, "misses", open_high=True)]
    return {"requests_per_s": cap, "requests_per_s_ci": [cap, cap * 1.5], "output_tokens_per_s": tok,
            "goodput_requests_per_s": cap * 0.97, "verdict": "meets", "slo": SLO,
            "saturation": {"concurrency": 5, "requests_per_s": cap * 1.8, "output_tokens_per_s": tok * 1.3, "n": 16},
            "probes": probes, "cost": {"requests": 160, "wall_s": 95.0, "probes": 3}, "notes": []}


def _metrics(tok_s: float, ttft_p90: float, **extra):
    """The metrics of the probe at the capacity point (what a trial keeps as `metrics`)."""
    return {"output_tokens_per_s": tok_s, "requests_per_s": tok_s / 10, "ttft_ms": _pct(ttft_p90),
            "tpot_ms": _pct(40.0), "itl_ms": _pct(40.0), "e2e_ms": _pct(ttft_p90 + 500), "completed": 40, "failed": 0,
            "peak_rss_mb": 800.0, "peak_cuda_mb": None, "roofline": {"percent_of_bound": 12.5}, **extra}


def _config(quant="bf16", batch_cap=4, kv=0.01, draft="none"):
    return {"model": "smollm2-135m", "quant": quant, "batch_cap": batch_cap, "kv_fraction": kv, "draft": draft,
            "device": "cpu"}


NAMES = ["ttft:p90<3000ms", "quality drop<=1pp", "failed requests=0"]
ATTRS = {"model": "smollm2-135m", "primary": "ttft:p90<3000ms", "bounds": ["ttft:p90<3000ms"],
         "constraint_names": NAMES, "latency_metric": "ttft:p90", "latency_target_ms": 3000.0,
         "max_quality_drop": 1.0, "slo": SLO}
def _dists():
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    return {"quant": CategoricalDistribution(["fp32", "bf16", "bnb-nf4"]),
            "batch_cap": CategoricalDistribution([1, 2, 4, 8]), "kv_fraction": FloatDistribution(0.001, 0.1, log=True),
            "draft": CategoricalDistribution(["none", "ngram:3"])}


def _study(specs, storage=None, name=None):
    """An Optuna study (in memory unless `storage`) with trials shaped like `tuner search` writes them since the
    capacity measure: 2 objectives (capacity req/s, quality), `capacity`, `metrics` at the capacity point,
    `quality` with its gate, normalised constraints. A spec: cap (req/s), ttft (p90 ms at capacity), tok (tok/s
    at capacity), q, drop (pp), optional engine, state, reason."""
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "maximize"], storage=storage, study_name=name)
    for k, v in ATTRS.items():
        study.set_user_attr(k, v)
    for i, s in enumerate(specs):
        cfg = _config(s.get("quant", "bf16"), s.get("batch_cap", 4), s.get("kv", 0.01), s.get("draft", "none"))
        engine = s.get("engine", "transformers-assisted" if cfg["draft"] != "none" else "transformers-cb")
        ua = {"config": cfg, **({"baseline": True} if i == 0 else {})}
        state = s.get("state", TrialState.COMPLETE)
        values = None
        if "cap" in s:
            drop = s.get("drop", 0.0)
            gate = {"verdict": "within" if drop <= 1.0 else "exceeds", "drop_pp": drop,
                    "drop_ci_pp": [drop - 1.5, drop + 1.5], "budget_pp": 1.0}
            q = {"score": s.get("q", 0.5), "score_stderr": 0.05, "drop_pp": drop, "limit": 8, "seed": 1,
                 "tasks": {"arc_easy": {"acc": s.get("q", 0.5), "acc_stderr": 0.05}}, "gate": gate}
            ua.update(metrics=_metrics(s["tok"], s["ttft"], **s.get("extra", {})), quality=q,
                      capacity=_capacity(s["cap"], s["ttft"], s["tok"]),
                      engine={"name": engine, "versions": {"transformers": "5.24.0"}, "device": "cpu"})
            if state == TrialState.COMPLETE:
                ua["constraints"] = [(s["ttft"] - 3000) / 3000, (drop - 1.0) / 1.0, 0.0]
                values = [s["cap"], s.get("q", 0.5)]
        if s.get("reason"):
            ua["reason"] = s["reason"]
        params = {"quant": cfg["quant"], "batch_cap": cfg["batch_cap"], "kv_fraction": cfg["kv_fraction"],
                  "draft": cfg["draft"]}
        study.add_trial(create_trial(state=state, values=values, params=params, distributions=_dists(),
                                     user_attrs=ua))
    return study


def _mixed_specs():
    from optuna.trial import TrialState

    return [
        {"quant": "fp32", "batch_cap": 1, "cap": 0.5, "tok": 5.0, "ttft": 2000},  # 0 baseline, feasible
        {"quant": "bf16", "batch_cap": 4, "cap": 2.0, "tok": 20.0, "ttft": 1500, "q": 0.55},  # 1 feasible, best
        {"quant": "bf16", "batch_cap": 8, "cap": 3.0, "tok": 30.0, "ttft": 5000},  # 2 infeasible (latency)
        {"quant": "bnb-nf4", "batch_cap": 2, "cap": 1.2, "tok": 12.0, "ttft": 900, "q": 0.40, "drop": 3.0},  # 3 quality
        {"quant": "bf16", "batch_cap": 2, "draft": "ngram:3", "cap": 1.0, "tok": 10.0, "ttft": 800, "q": 0.6,
         "extra": {"acceptance_rate": 0.4}},  # 4 feasible, on the capacity-quality front (best quality)
        {"quant": "bnb-nf4", "state": TrialState.PRUNED, "reason": "stopped early: ttft:p90 over 3000ms"},  # 5
        {"quant": "fp32", "batch_cap": 8, "state": TrialState.FAIL, "reason": "out of memory\ntraceback..."},  # 6
    ]


def _legacy_study(storage=None, name=None):
    """A study as `tuner search` wrote them before the capacity measure: 3 objectives (tok/s, latency, quality),
    output tok/s at one fixed arrival rate, no `capacity`."""
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize", "maximize"], storage=storage, study_name=name)
    attrs = {"model": "smollm2-135m", "primary": "ttft:p99<3000ms", "bounds": ["ttft:p99<3000ms"],
             "constraint_names": ["ttft:p99<3000ms", "failed requests=0"], "latency_metric": "ttft:p99",
             "latency_target_ms": 3000.0, "recommended_trial": 1}
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    pct = lambda v: {"p50": v / 2, "p90": v * 0.9, "p95": v * 0.95, "p99": v, "mean": v / 2}  # noqa: E731
    for i, (cap, tok, ttft) in enumerate([(1, 5.0, 2000.0), (4, 20.0, 1500.0), (8, 30.0, 5000.0)]):
        m = {"output_tokens_per_s": tok, "requests_per_s": tok / 10, "ttft_ms": pct(ttft), "tpot_ms": pct(40.0),
             "e2e_ms": pct(ttft + 500), "completed": 4, "failed": 0}
        ua = {"config": _config("bf16", cap), "metrics": m, "constraints": [ttft - 3000, 0.0],
              "requests": [{"ttft_ms": ttft * f, "e2e_ms": ttft * f + 500, "tpot_ms": 40.0, "output_tokens": 10,
                            "error": None} for f in (0.2, 0.5, 1.0)],
              "engine": {"name": "transformers-cb", "device": "cpu"}, **({"baseline": True} if i == 0 else {})}
        study.add_trial(create_trial(values=[tok, ttft, 0.0], user_attrs=ua, distributions=_dists(),
                                     params={"quant": "bf16", "batch_cap": cap, "kv_fraction": 0.01, "draft": "none"}))
    return study


@pytest.fixture(scope="module")
def mixed():
    study = _study(_mixed_specs())
    info = study_info("mixed", study.user_attrs)
    return study, info, trial_views(study.get_trials(deepcopy=False))


def test_storage_url_from_args_env_default():
    assert storage_from_argv(["--storage", "sqlite:///a.db"], {"TUNER_STORAGE": "sqlite:///b.db"}) == \
        "sqlite:///a.db"
    assert storage_from_argv(["--other", "x"], {"TUNER_STORAGE": "sqlite:///b.db"}) == "sqlite:///b.db"
    assert storage_from_argv([], {}) == "sqlite:///results/tuner.db"


@pytest.mark.parametrize("url,needle", [
    ("not a url", "is invalid"), ("nosuch://x", "unusable"), ("sqlite:////nonexistent/dir/x.db", "does not exist"),
])
def test_check_storage_url_rejects(url, needle):
    with pytest.raises(TunerError, match=needle):
        check_storage_url(url)


def test_display_url_masks_password():
    assert display_url("postgresql://me:secret@db.local/tuner") == "postgresql://me:***@db.local/tuner"
    assert display_url("sqlite:///results/tuner.db") == "sqlite:///results/tuner.db"


def test_check_storage_url_accepts_missing_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'later.db'}"
    assert check_storage_url(url) == url
    assert not (tmp_path / "later.db").exists()  # nothing created
    with pytest.raises(TunerError, match="no such database file"):
        open_storage_readonly(url)
    assert not (tmp_path / "later.db").exists()


def test_study_info_and_target_lines(mixed):
    _, info, _ = mixed
    assert info.latency_field == "ttft_ms.p90" and info.latency_target_ms == 3000.0 and info.from_search
    assert info.slo["confidence"] == 0.95
    assert target_lines(info, "ttft_ms.p90", "output_tokens_per_s") == [
        {"axis": "x", "value": 3000.0, "label": "latency target ttft:p90<3000ms"}]
    assert target_lines(info, CAPACITY, "ttft_ms.p90")[0]["axis"] == "y"
    assert target_lines(info, "e2e_ms.p99", "output_tokens_per_s") == []
    assert metric_field("tpot:p50") == "tpot_ms.p50" and metric_field("nonsense") is None


def test_bound_lines_from_the_slo_attr_and_attainment_targets():
    # a study whose SLO has only per-request targets (attainment): the target is drawn on every TTFT percentile
    info = study_info("a", {"latency_metric": "ttft:p90", "slo": {
        "bounds": ["e2e:p50<9s"], "targets_ms": {"ttft_ms": 2000.0}, "attainment": 0.9, "confidence": 0.95}})
    lines = bound_lines(info)
    assert lines["e2e_ms.p50"] == [(9000.0, "bound e2e:p50<9000ms")]
    assert lines["ttft_ms.p90"] == [(2000.0, "per-request target ttft<2000ms for 90% of requests")]
    assert lines["ttft_ms.p99"] == lines["ttft_ms.p90"] and "tpot_ms.p90" not in lines
    # no latency metric: the first target at the attainment's percentile is the one the curves open on
    info = study_info("b", {"slo": {"bounds": [], "targets_ms": {"ttft_ms": 2000.0}, "attainment": 0.9}})
    assert info.latency_field == "ttft_ms.p90" and curves.field_label("ttft_ms.p90") == "TTFT p90 (ms)"


def test_table_has_every_trial_with_reasons_and_filters(mixed):
    _, info, views = mixed
    rows = table_rows(views, info, recommended=1)
    assert [r["number"] for r in rows] == list(range(7))
    assert [r["state"] for r in rows] == ["COMPLETE"] * 5 + ["PRUNED", "FAIL"]
    assert [r["feasible"] for r in rows] == [True, True, False, False, True, None, None]
    assert rows[1]["recommended"] and rows[0]["baseline"]
    assert rows[5]["reason"].startswith("stopped early") and rows[6]["reason"] == "out of memory"
    assert rows[1]["ttft_p90_ms"] == 1500 and rows[4]["acceptance_rate"] == 0.4 and rows[3]["drop_pp"] == 3.0
    assert [r["number"] for r in filter_rows(rows, feasible="feasible")] == [0, 1, 4]
    assert [r["number"] for r in filter_rows(rows, feasible="infeasible")] == [2, 3, 5, 6]
    assert [r["number"] for r in filter_rows(rows, formats=["bnb-nf4"])] == [3, 5]
    assert [r["number"] for r in filter_rows(rows, states=["PRUNED", "FAIL"])] == [5, 6]
    assert filter_rows(rows, formats=["bf16"], feasible="feasible", states=["COMPLETE"])[0]["number"] == 1
    with pytest.raises(ValueError):
        filter_rows(rows, feasible="maybe")


def test_table_shows_capacity_ci_verdicts_and_engine(mixed):
    _, info, views = mixed
    rows = table_rows(views, info, recommended=1)
    r = rows[1]
    assert (r["capacity_rps"], r["capacity_ci_low_rps"], r["capacity_ci_high_rps"]) == (2.0, 2.0, 3.0)
    assert (r["verdict"], r["quality_gate"], r["engine"], r["output_tokens_per_s"]) == (
        "meets", "within", "transformers-cb", 20.0)
    assert rows[3]["quality_gate"] == "exceeds" and rows[4]["engine"] == "transformers-assisted"
    assert rows[5]["capacity_rps"] is None and rows[5]["verdict"] is None  # pruned: no capacity measured


def test_axis_fields_labels_directions(mixed):
    _, info, views = mixed
    fields = axis_fields(views, info)
    assert fields[:4] == [CAPACITY, "quality.score", "output_tokens_per_s", "ttft_ms.p90"]
    assert default_axes(fields, info, True) == (CAPACITY, "quality.score")
    # quality not scored: capacity vs the latency at capacity (the study the browser test reads scored it)
    assert default_axes([f for f in fields if not f.startswith("quality.")], info, True) == (CAPACITY, "ttft_ms.p90")
    assert {"capacity.saturation.requests_per_s", "capacity.goodput_requests_per_s", "config.batch_cap",
            "roofline.percent_of_bound", "quality.tasks.arc_easy.acc", "e2e_ms.p50"} <= set(fields)
    assert not any(f.endswith(("_stderr", ".seed", ".limit", ".n")) or f.startswith(("quality.gate", "capacity.slo"))
                   for f in fields)
    assert field_label("ttft_ms.p99") == "TTFT p99 (ms)" and field_label("config.batch_cap") == "batch cap"
    assert field_label(CAPACITY) == "capacity (req/s)"
    assert (direction(CAPACITY), direction("e2e_ms.mean"), direction("peak_rss_mb"),
            direction("quality.score"), direction("config.batch_cap")) == ("max", "min", "min", "max", None)


def test_capacity_quality_pareto_with_error_bars(mixed):
    _, info, views = mixed
    pts = chart_points(views, CAPACITY, "quality.score", info, recommended=1)
    assert [p["number"] for p in pts] == [0, 1, 2, 3, 4]  # pruned/failed trials have no capacity
    assert [p["feasible"] for p in pts] == [True, True, False, False, True]
    p1 = pts[1]
    assert (p1["x"], p1["y"], p1["recommended"], p1["engine"]) == (2.0, 0.55, True, "transformers-cb")
    # the capacity's CI [2.0, 3.0] as a horizontal bar; the quality score's stderr as a vertical one
    assert p1["x_err"] == {"minus": 0.0, "plus": 1.0, "open_minus": False, "open_plus": False}
    assert p1["y_err"]["minus"] == pytest.approx(0.05) and p1["y_err"]["plus"] == pytest.approx(0.05)
    assert "engine transformers-cb" in p1["hover"] and "capacity 2.00 req/s (95% CI 2.00–3.00) · meets" in p1["hover"]
    assert "quality gate within" in p1["hover"] and "engine transformers-assisted" in pts[4]["hover"]
    front = pareto_line(pts, direction(CAPACITY), direction("quality.score"))
    # capacity max, quality max among feasible (0, 1, 4): 4 (1.0, 0.6) and 1 (2.0, 0.55); 0 is dominated by 1
    assert [(p["number"], p["x"], p["y"]) for p in front] == [(4, 1.0, 0.6), (1, 2.0, 0.55)]
    fig = curves.pareto_figure(pts, front, target_lines(info, CAPACITY, "quality.score"), "x", "y")
    feas = {t.name: t for t in fig.data}["feasible"]  # trials 0, 1, 4
    assert list(feas.error_x.array) == [0.25, 1.0, 0.5] and list(feas.error_x.arrayminus) == [0.0, 0.0, 0.0]
    assert list(feas.error_y.array) == pytest.approx([0.05] * 3) and feas.error_x.visible
    assert {t.name for t in fig.data} >= {"infeasible", "Pareto front (feasible)", "recommended (trial 1)"}
    # a latency axis carries its percentile's CI; an open side is reported, not invented
    lat = chart_points(views, CAPACITY, "ttft_ms.p90", info)
    assert lat[1]["y_err"]["minus"] == pytest.approx(300.0) and lat[1]["y_err"]["plus"] == pytest.approx(375.0)
    assert chart_points(views, "config.batch_cap", "peak_rss_mb")[0]["x_err"] is None


def test_chart_points_any_metric_and_quality_range(mixed):
    _, info, views = mixed
    pts = chart_points(views, "ttft_ms.p90", "output_tokens_per_s", info, recommended=1)
    assert [p["number"] for p in pts] == [0, 1, 2, 3, 4]
    front = pareto_line(pts, direction("ttft_ms.p90"), direction("output_tokens_per_s"))
    assert [(p["number"], p["x"], p["y"]) for p in front] == [(4, 800, 10.0), (1, 1500, 20.0)]
    assert pareto_line(pts, None, "max") == []
    assert quality_range(pts) == (0.4, 0.6)
    assert quality_range([{"quality": None}]) is None
    assert len(chart_points(views, "config.batch_cap", "peak_rss_mb")) == 5


def test_latency_curve_points_error_bars_and_capacity_marker(mixed):
    _, info, views = mixed
    v = views[1]  # capacity 2.0 req/s, CI [2.0, 3.0]; probes at 1.0, 2.0, 3.0 req/s (the last one misses)
    assert curves.curve_fields(views, info.latency_field)[0] == "ttft_ms.p90"
    c = curves.latency_curve(v, "ttft_ms.p90")
    assert c["label"] == "trial 1 · transformers-cb" and c["engine"] == "transformers-cb"
    pts = c["points"]
    assert len(pts) == len(v.capacity["probes"]) == 3
    assert [p["rate_rps"] for p in pts] == [1.0, 2.0, 3.0]
    assert [p["y"] for p in pts] == [600.0, 1500.0, 3750.0]
    assert [p["verdict"] for p in pts] == ["meets", "meets", "misses"]
    assert (pts[1]["ci_low"], pts[1]["ci_high"], pts[1]["open_high"]) == (1200.0, 1875.0, False)
    assert pts[2]["ci_high"] is None and pts[2]["open_high"] and not pts[2]["open_low"]
    assert pts[2]["achieved_rps"] == pytest.approx(2.94) and "misses" in pts[2]["hover"]
    # capacity: at its probe's rate and latency, with the rate's interval
    assert c["capacity"]["rate_rps"] == 2.0 and c["capacity"]["y"] == 1500.0
    assert (c["capacity"]["ci_low_rps"], c["capacity"]["ci_high_rps"]) == (2.0, 3.0)
    assert c["saturation"]["requests_per_s"] == pytest.approx(3.6)
    # error bars: bounded sides as given, the open side runs to the top of the plot and is listed for an arrow
    limits = curves.slo_limits(bound_lines(info), "ttft_ms.p90")
    assert limits == [{"value": 3000.0, "label": "latency target ttft:p90<3000ms"}]
    top = curves.y_top([c], [lim["value"] for lim in limits])
    assert top == pytest.approx(1.15 * 3750.0)
    a = curves.plot_arrays(c, top)
    assert a["x"] == [1.0, 2.0, 3.0] and a["y"] == [600.0, 1500.0, 3750.0]
    assert a["minus"] == pytest.approx([120.0, 300.0, 750.0])
    assert a["plus"] == pytest.approx([150.0, 375.0, top - 3750.0])
    assert a["open"] == [(3.0, top, "up")] and a["missing"] == []
    assert a["colour"] == [curves.VERDICT_COLOURS[x] for x in ("meets", "meets", "misses")]
    m = curves.capacity_marker(c, [3000.0])
    assert (m["x"], m["y"], m["y_known"], m["minus"], m["plus"]) == (2.0, 1500.0, True, 0.0, 1.0)
    # the mean has no CI: no error bars and nothing open
    mean = curves.plot_arrays(curves.latency_curve(v, "ttft_ms.mean"), top)
    assert mean["minus"] == [0.0] * 3 and mean["plus"] == [0.0] * 3 and mean["open"] == []


def test_latency_curve_without_a_meeting_rate_and_without_values():
    from types import SimpleNamespace

    cap = _capacity(1.0, 1000.0, 10.0)
    cap.update(requests_per_s=0.0, requests_per_s_ci=[0.0, 0.5], verdict="misses")  # no rate met the SLO
    cap["probes"][0]["ttft_ms"] = {"p90": None, "n": 0, "ci": {"p90": [None, None]}}  # every request failed
    v = SimpleNamespace(number=7, capacity=cap, baseline=False, engine_label=None, row=SimpleNamespace(metrics={}))
    c = curves.latency_curve(v, "ttft_ms.p90")
    a = curves.plot_arrays(c, 5000.0)
    assert a["missing"] == [0.5] and a["x"] == [1.0, 1.5]  # drawn as a cross at the top, not as a value
    m = curves.capacity_marker(c, [3000.0])
    assert (m["x"], m["y"], m["y_known"], m["plus"], m["verdict"]) == (0.0, 3000.0, False, 0.5, "misses")
    # a capacity between two probes: its latency is interpolated
    cap2 = _capacity(2.0, 1000.0, 10.0)
    cap2["requests_per_s"] = 2.5
    v2 = SimpleNamespace(number=8, capacity=cap2, baseline=False, engine_label=None, row=SimpleNamespace(metrics={}))
    assert curves.latency_curve(v2, "ttft_ms.p90")["capacity"]["y"] == pytest.approx(1000 + 0.5 * 1500)
    assert curves.interpolate([1.0, 2.0], [10.0, None], 1.5) is None


def test_latency_and_throughput_figures(mixed):
    _, info, views = mixed
    shown = [curves.latency_curve(views[n], "ttft_ms.p90") for n in curves.default_curve_trials(views, 1)]
    assert [c["number"] for c in shown] == [1, 0]  # the recommendation and the baseline
    limits = curves.slo_limits(bound_lines(info), "ttft_ms.p90")
    fig = curves.latency_figure(shown, "ttft_ms.p90", limits)
    traces = {t.name: t for t in fig.data}
    probes = traces["trial 1 · transformers-cb"]
    assert list(probes.x) == [1.0, 2.0, 3.0] and list(probes.error_y.array)[:2] == pytest.approx([150.0, 375.0])
    assert list(probes.marker.color) == [curves.VERDICT_COLOURS[x] for x in ("meets", "meets", "misses")]
    assert list(traces["capacity (trial 1)"].x) == [2.0] and list(traces["capacity (trial 1)"].error_x.array) == [1.0]
    assert list(traces["capacity (trial 0)"].x) == [0.5]
    assert len(traces["open CI (trial 1)"].x) == 1 and {"meets", "misses", "indeterminate"} <= set(traces)
    assert [(s.y0, s.y1) for s in fig.layout.shapes] == [(3000.0, 3000.0)]
    assert fig.layout.yaxis.range[1] == pytest.approx(curves.y_top(shown, [3000.0]))
    tp = curves.throughput_figure(shown, "rps")
    tt = {t.name: t for t in tp.data}
    assert list(tt["trial 1 · transformers-cb"].y) == pytest.approx([0.98, 1.96, 2.94])
    assert list(tt["achieved = offered"].x) == [0, 3.0]
    assert sorted(s.y0 for s in tp.layout.shapes) == pytest.approx([0.9, 3.6])  # saturation of trials 0 and 1
    tok = {t.name: t for t in curves.throughput_figure(shown, "tok_s").data}
    assert list(tok["trial 1 · transformers-cb"].y) == [10.0, 20.0, 22.0] and "achieved = offered" not in tok


def test_old_study_without_capacity_still_renders():
    study = _legacy_study()
    info = study_info("old", study.user_attrs)
    views = trial_views(study.get_trials(deepcopy=False))
    assert not has_capacity(views) and curves.curve_trials(views) == []
    assert curves.default_curve_trials(views, 1) == []
    fields = axis_fields(views, info)
    assert default_axes(fields, info, False) == ("ttft_ms.p99", "output_tokens_per_s")
    rows = table_rows(views, info)
    assert "capacity_rps" not in rows[0] and rows[1]["output_tokens_per_s"] == 20.0 and rows[0]["engine"]
    pts = chart_points(views, "ttft_ms.p99", "output_tokens_per_s", info)
    assert len(pts) == 3 and all(p["x_err"] is None and p["y_err"] is None for p in pts)
    assert detail(views[1])["capacity"] is None and views[1].tok_s == 20.0
    # its recommendation is the one its search stored, not recomputed from capacities it does not have
    w = why(views, info)
    assert "predates capacity" in w["legacy"] and w["recommended"] == 1 and "answer" not in w
    assert [c["satisfied"] for c in w["constraints"]] == [True, True]
    assert study_answer(views, info) is None and recommended_number(None, info) == 1
    assert set(param_importances(study.get_trials(deepcopy=False), study.directions)) == {"throughput",
                                                                                                "latency"}


def test_capacity_attr_from_a_trial_or_a_bench_json():
    cap = _capacity(1.0, 100.0, 5.0)
    assert curves.capacity_attr({"capacity": cap}) == cap
    assert curves.capacity_attr({"metrics": {"capacity": cap, "output_tokens_per_s": 5.0}}) == cap
    assert curves.capacity_attr({"metrics": {"output_tokens_per_s": 5.0}}) is None
    assert curves.capacity_text(cap) == "1.00 req/s (95% CI 1.00–1.50) · meets"
    assert curves.capacity_text(dict(cap, requests_per_s_ci=[1.0, None])).endswith("(95% CI 1.00–open) · meets")


def test_detail_latencies_quality_tasks(mixed):
    _, info, views = mixed
    d = detail(views[4])
    assert d["uses_draft"] and d["acceptance_rate"] == 0.4 and d["peak_rss_mb"] == 800.0
    assert d["tasks"] == [{"task": "arc_easy", "acc": 0.6, "acc_stderr": 0.05}]
    assert d["percentiles"]["ttft_ms"]["p90"] == 800
    assert d["engine_label"] == "transformers-assisted" and d["gate"]["verdict"] == "within"
    cap = d["capacity"]
    assert (cap["requests_per_s"], cap["ci_rps"], cap["verdict"], cap["n_probes"]) == (1.0, (1.0, 1.5), "meets", 3)
    assert cap["saturation"]["concurrency"] == 5 and cap["cost"]["requests"] == 160
    rows = curves.percentile_rows(views[4].row.metrics)
    assert rows[0]["metric (ms)"] == "TTFT" and rows[0]["n"] == 40 and rows[0]["p90 CI"] == "640–1000"
    s = latency_samples([{"ttft_ms": 5.0, "e2e_ms": 9.0}, {"ttft_ms": 1.0, "e2e_ms": 2.0, "error": "boom"}])
    assert s == {"ttft_ms": [5.0], "e2e_ms": [9.0]}
    assert ecdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    assert not detail(views[0])["uses_draft"]
    assert detail(views[6])["reason"].startswith("out of memory") and detail(views[6])["capacity"] is None
    assert detail(views[4])["in_trial_requests_per_s"] is None  # not re-measured after the search


def test_detail_of_a_trial_re_measured_after_the_search_shows_the_re_measure_and_its_trial(mixed):
    # tuner.search.confirm re-measured trial 1 (2.0 req/s in its trial) at 1.6: the page shows 1.6 and says 2.0
    study, _, _ = mixed
    again = _capacity(1.6, 1400, 16.0)
    views = trial_views(study.get_trials(deepcopy=False),
                        {**study.user_attrs, "confirmed": {"1": {"capacity": again, "metrics": _metrics(16.0, 1400),
                                                                 "constraints": [-0.5, -1.0, 0.0]}}})
    d = detail(views[1])
    assert d["capacity"]["requests_per_s"] == 1.6 and d["in_trial_requests_per_s"] == 2.0
    assert detail(views[2])["in_trial_requests_per_s"] is None


def test_why_reuses_the_search_answer(mixed):
    from tuner.search.answer import answer, rows_from_study

    study, info, views = mixed
    w = why(views, info)
    assert w["answer"] == answer(rows_from_study(study), NAMES, baseline_number=0)
    rec = w["answer"]["recommendation"]
    assert rec["trial"] == 1
    assert "ttft:p90<3000ms" in rec["binding_constraint"]  # trial 2 had more capacity and broke the latency target
    assert recommended_number(w["answer"], info) == 1
    assert [c["satisfied"] for c in w["constraints"]] == [True, True, True]
    assert rec["gain_over_baseline"] == pytest.approx(4.0)  # capacity 2.0 / the baseline's 0.5 req/s
    assert w["capacity"]["recommended"]["requests_per_s"] == 2.0 and w["capacity"]["baseline"]["requests_per_s"] == 0.5
    assert latency_at(views[1], info) == 1500
    assert why(views, study_info("foreign", {}))["message"].startswith("this study was not written")


def test_param_importances_and_too_few_trials(mixed):
    study, _, _ = mixed
    trials = study.get_trials(deepcopy=False)
    imp = param_importances(trials, study.directions)
    assert set(imp) == {"capacity", "quality"}
    for res in imp.values():
        assert set(res["importances"]) <= {"quant", "batch_cap", "kv_fraction", "draft"}
        assert sum(res["importances"].values()) == pytest.approx(1.0)
    few = param_importances(trials[:2], study.directions)
    assert few["capacity"] == {"message": "needs at least 3 completed trials with a capacity value (has 2)"}
    assert param_importances(trials, None).keys() == {"capacity", "quality"}  # told by the trials' values
    assert param_importances([], None)["latency"]["message"].startswith("needs at least")


def test_exports_for_every_target(mixed):
    from tuner.export import TARGETS

    study, _, views = mixed
    exps = exports(views[1], "mixed")
    assert [e["target"] for e in exps] == list(TARGETS)
    vllm = exps[0]
    assert "error" not in vllm and "--max-num-seqs 4" in vllm["command"]
    assert any("--max-num-seqs 4" in text for text in vllm["files"].values())
    assert json.loads(vllm["json"])["source"] == {"study": "mixed", "trial": 1}
    assert json.loads(config_json(views[1]))["batch_cap"] == 4
    with pytest.raises(TunerError, match="PRUNED"):
        exports(views[5], "mixed")


def test_signature_and_counts(mixed):
    study, _, views = mixed
    sig = signature(study.get_trials(deepcopy=False))
    assert sig[0] == (0, "COMPLETE") and sig[5] == (5, "PRUNED") and len(sig) == 7
    c = state_counts(views)
    assert (c["trials"], c["COMPLETE"], c["feasible"], c["PRUNED"], c["FAIL"], c["RUNNING"]) == (7, 5, 3, 1, 1, 0)


# ================================================================================ `tuner dashboard` input === #
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args,needle", [
    (["--port", "abc"], "invalid int value"),
    (["--port", "0"], "--port 0 is invalid"),
    (["--port", "70000"], "--port 70000 is invalid"),
    (["--storage", "not a url"], "--storage 'not a url' is invalid"),
    (["--storage", "nosuch://x"], "unusable"),
    (["--storage", "sqlite:////nonexistent/dir/x.db"], "does not exist"),
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid' is invalid"),
])
def test_bad_args_one_line_exit_2(args, needle):
    assert_one_line_error(run_tuner("dashboard", *args, timeout=60), needle)


def test_bad_storage_from_env_one_line_exit_2():
    assert_one_line_error(run_tuner("dashboard", timeout=60, env={"TUNER_STORAGE": "bad"}), "$TUNER_STORAGE 'bad'")


def test_port_in_use_one_line_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert_one_line_error(run_tuner("dashboard", "--port", str(port), timeout=60), f"--port {port}")


def test_streamlit_command_is_local_and_offline():
    from tuner.cli.dashboard import APP, streamlit_argv

    argv = streamlit_argv(APP, "sqlite:///x.db", "127.0.0.1", 8600)
    s = " ".join(argv)
    assert APP == REPO / "app.py" and APP.is_file()
    for flag in ("--server.address 127.0.0.1", "--server.port 8600", "--server.headless true",
                 "--browser.gatherUsageStats false"):
        assert flag in s
    assert argv[-3:] == ["--", "--storage", "sqlite:///x.db"]
    cfg = (REPO / ".streamlit" / "config.toml").read_text()  # `streamlit run app.py` from the repo gets the same
    assert "gatherUsageStats = false" in cfg and 'address = "127.0.0.1"' in cfg


# ====================================================================================== the real browser === #
def _need_browser():
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright): the browser tests need it")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; scripts/system_deps.sh): the browser "
                    "tests need it")
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        pytest.skip("streamlit is not installed (pip install 'tuner[dashboard]')")


class Server:
    """A dashboard served by a real Streamlit process on a free local port."""

    def __init__(self, argv: list[str], port: int, log: Path, cwd: Path = REPO):
        self.port = port
        self.log = log
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_healthy(90)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"dashboard exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"dashboard did not come up: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the process group this test started
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def tuner_dashboard(storage: str, log: Path) -> Server:
    port = _free_port()
    return Server([sys.executable, "-m", "tuner", "dashboard", "--storage", storage, "--port", str(port)], port, log)


@pytest.fixture(scope="session")
def searched(request):
    """(storage URL, study name) of a study written by a real `tuner search`: the session's tiny search
    (tests/conftest.py `tiny_search`, checked by tests/test_search_e2e.py: 3 trials, quality scored, small capacity
    probes judged on e2e p50, which 8 requests can show met), read only."""
    if os.environ.get("TUNER_TEST_STORAGE"):
        return os.environ["TUNER_TEST_STORAGE"], os.environ.get("TUNER_TEST_STUDY", "tiny")
    _need_browser()  # no point searching when the browser tests cannot run
    d, _ = request.getfixturevalue("tiny_search")
    return f"sqlite:///{d / 'tuner.db'}", "tiny"


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page that records every request leaving 127.0.0.1 (there must be none) and page errors."""
    ctx = browser.new_context(viewport={"width": 1500, "height": 2300})
    pg = ctx.new_page()
    pg.external = []
    pg.errors = []
    pg.on("request", lambda r: None if r.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:"))
          else pg.external.append(r.url))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.set_default_timeout(LOAD_S * 1000 / 2)
    pg.set_default_navigation_timeout(LOAD_S * 1000)
    yield pg
    ctx.close()


def shot(pg, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.mouse.move(1490, 2290)  # no tooltip over the picture
    time.sleep(0.8)  # let plotly finish its transitions
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def no_exception(pg) -> None:
    assert pg.locator('[data-testid="stException"]').count() == 0, pg.locator(
        '[data-testid="stException"]').first.inner_text()
    assert pg.errors == [], pg.errors


def tab(pg, name: str) -> None:
    pg.get_by_role("tab", name=name, exact=True).click()


def pick(pg, label: str, typed: str, option: re.Pattern) -> None:
    """Choose `option` in the Streamlit select box labelled `label`, typing `typed` first (its list is virtual:
    only the options in view exist in the page)."""
    box = pg.get_by_role("combobox", name=label, exact=True)
    box.click()
    box.fill(typed)
    pg.get_by_role("option").filter(has_text=option).first.click()


def plot_traces(pg, index: int | str) -> dict:
    """name -> number of points of each trace of the index-th Plotly chart on the page (or of the chart inside the
    Streamlit container with that key)."""
    return pg.evaluate(
        "(i) => { const el = typeof i === 'number' ? document.querySelectorAll('.js-plotly-plot')[i]"
        " : document.querySelector('.st-key-' + i + ' .js-plotly-plot');"
        " const out = {}; (el.data || []).forEach(t => { out[t.name || ''] = (t.x || []).filter(v => v !== null)"
        ".length; }); return out; }", index)


def plot_shapes(pg, index: int | str) -> list[list[float]]:
    """[x0, x1, y0, y1] of each shape (target lines) of a Plotly chart, found as in `plot_traces`."""
    return pg.evaluate(
        "(i) => { const el = typeof i === 'number' ? document.querySelectorAll('.js-plotly-plot')[i]"
        " : document.querySelector('.st-key-' + i + ' .js-plotly-plot');"
        " return (el.layout.shapes || []).map(s => [s.x0, s.x1, s.y0, s.y1]); }", index)


def curve_chart(pg) -> None:
    """Open the latency-load tab and wait for its chart (in the container keyed 'load_curves')."""
    tab(pg, "Latency–load")
    pg.locator(".st-key-load_curves .js-plotly-plot").first.wait_for()
    # after a study switch the previous study's chart lingers until the new run has finished
    pg.wait_for_function("() => document.querySelectorAll('.st-key-load_curves .js-plotly-plot').length === 1")


def selected(pg, number: int) -> None:
    """Wait until trial `number` is the selected trial (the caption under the trial select box)."""
    pg.get_by_text(re.compile(rf"^trial {number}: ")).wait_for()


def point_xy(pg, number: int) -> tuple[float, float]:
    """Screen position of trial `number`'s marker in the Pareto chart (the first Plotly chart)."""
    return tuple(pg.evaluate(
        "(num) => { const el = document.querySelectorAll('.js-plotly-plot')[0];"
        " for (const g of el.querySelectorAll('.scatterlayer .trace')) {"
        "  const t = g.__data__[0].trace; if (!['feasible', 'infeasible'].includes(t.name)) continue;"
        "  const i = (t.customdata || []).findIndex(c => c[0] === num); if (i < 0) continue;"
        "  const r = g.querySelectorAll('path.point')[i].getBoundingClientRect();"
        "  return [r.x + r.width / 2, r.y + r.height / 2]; } return null; }", number))


def table_rows_shown(pg, expect: int | None = None, timeout_s: float = 20.0) -> int:
    """Data rows of the visible Streamlit data frame (its accessibility table; aria-rowcount counts the header).
    With `expect`, waits up to `timeout_s` for that count (the caption above it is drawn first)."""
    deadline = time.time() + timeout_s
    while True:
        grid = pg.locator('[data-testid="stDataFrame"]:visible table[aria-rowcount]').first
        rows = int(grid.get_attribute("aria-rowcount")) - 1
        if expect is None or rows == expect or time.time() > deadline:
            return rows
        time.sleep(0.3)


def _leaf(attrs: dict, field: str):
    """A dotted field of a trial's user attrs as the dashboard names it ('capacity.requests_per_s', 'ttft_ms.p99'
    from `metrics`, 'quality.score'), None when absent."""
    head, _, rest = field.partition(".")
    node = attrs.get(head) if head in ("capacity", "quality") else (attrs.get("metrics") or {}).get(head)
    for part in rest.split(".") if rest else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def default_xy(study_attrs: dict, trials: list) -> tuple[str, str]:
    """The chart axes the page opens on, stated from the raw attrs: capacity vs quality score (vs the latency
    metric when quality was not scored) for a study measured by capacity, else latency vs output tok/s."""
    metric, stat = study_attrs["latency_metric"].split(":")
    lat = f"{metric}_ms.{stat}"
    if any(isinstance(t.user_attrs.get("capacity"), dict) for t in trials):
        scored = any(_leaf(t.user_attrs, "quality.score") is not None for t in trials)
        return "capacity.requests_per_s", "quality.score" if scored else lat
    return lat, "output_tokens_per_s"


def expected(storage: str, name: str) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    x, y = default_xy(study.user_attrs, trials)
    plotted = [t for t in trials if _leaf(t.user_attrs, x) is not None and _leaf(t.user_attrs, y) is not None]
    confirmed = study.user_attrs.get("confirmed") or {}

    def ok(t) -> bool:  # feasible, judged on its re-measure after the search where it has one (tuner.search.confirm)
        cons = (confirmed.get(str(t.number)) or t.user_attrs).get("constraints")
        return t.state.name == "COMPLETE" and cons is not None and all(c <= 0 for c in cons)

    feasible = [t for t in plotted if ok(t)]
    probes = {t.number: t.user_attrs["capacity"].get("probes") or [] for t in trials
              if isinstance(t.user_attrs.get("capacity"), dict)}
    return {"study": study, "trials": trials, "plotted": plotted, "feasible": feasible, "x": x, "y": y, "ok": ok,
            "complete": [t for t in trials if t.state.name == "COMPLETE"], "probes": probes,
            "recommended": study.user_attrs.get("recommended_trial")}


def check_curves(pg, exp: dict, target: float, field: str) -> None:
    """The latency-load tab of a study measured by capacity: the recommended trial and the baseline by default, one
    marker per probe with a value, the capacity star, the SLO limit as a horizontal line."""
    curve_chart(pg)
    traces = plot_traces(pg, "load_curves")
    base = next((t.number for t in exp["trials"] if t.user_attrs.get("baseline")), None)
    shown = [n for n in dict.fromkeys([exp["recommended"], base]) if n is not None and exp["probes"].get(n)]
    assert shown, ("no default trial has probes", exp["recommended"], base, list(exp["probes"]))
    for n in shown:
        key, stat = field.split(".")
        with_value = [p for p in exp["probes"][n] if (p.get(key) or {}).get(stat) is not None]
        name = next(k for k in traces if re.match(rf"^trial {n}( ·|$)", k))
        assert traces[name] == len(with_value), (name, traces)
        cap = exp["trials"][n].user_attrs["capacity"].get("requests_per_s")
        assert traces.get(f"capacity (trial {n})", 0) == (1 if cap is not None else 0), traces
    assert [target, target] in [s[2:] for s in plot_shapes(pg, "load_curves")]  # the SLO limit, horizontal
    pg.locator(".st-key-throughput_curves .js-plotly-plot").wait_for()
    assert any(re.match(rf"^trial {shown[0]}( ·|$)", k) for k in plot_traces(pg, "throughput_curves"))
    no_exception(pg)


@pytest.mark.slow
def test_dashboard_in_a_real_browser(searched, page, tmp_path):
    """On a study from a real `tuner search`: the Pareto view (capacity vs quality with their intervals, or, for a
    study from before the capacity measure, latency vs tok/s), the latency-load curves (or the note saying an
    older study has none), the trials table, a trial's detail, why this one, and its exports."""
    storage, name = searched
    exp = expected(storage, name)
    n, n_plot = len(exp["trials"]), len(exp["plotted"])
    target = exp["study"].user_attrs["latency_target_ms"]
    by_capacity = exp["x"] == "capacity.requests_per_s"
    assert n >= 3 and exp["complete"], [(t.number, t.state.name) for t in exp["trials"]]
    srv = tuner_dashboard(storage, tmp_path / "dashboard.log")
    try:
        import psutil

        listening = {c.laddr for c in psutil.Process(srv.proc.pid).net_connections("tcp") if c.status == "LISTEN"}
        assert listening == {("127.0.0.1", srv.port)}, listening  # local only unless --host says otherwise
        t0 = time.time()
        page.goto(f"{srv.url}/?study={name}")
        page.locator(".js-plotly-plot").first.wait_for()
        load_s = time.time() - t0
        if exp["recommended"] is not None:
            page.get_by_text("Recommended: trial", exact=False).wait_for()
        no_exception(page)

        # Pareto view: one point per trial, feasible vs infeasible, the front, the target line, the recommendation
        traces = plot_traces(page, 0)
        assert traces["feasible"] + traces["infeasible"] == n_plot, traces
        assert traces["feasible"] == len(exp["feasible"])
        if exp["recommended"] is not None and any(t.number == exp["recommended"] for t in exp["plotted"]):
            assert traces[f"recommended (trial {exp['recommended']})"] == 1
            assert traces.get("Pareto front (feasible)", 0) >= 1
        svg_points = page.evaluate(  # markers drawn in the SVG for the two trial traces
            "() => Array.from(document.querySelectorAll('.js-plotly-plot')[0].querySelectorAll('.scatterlayer "
            ".trace')).filter(g => ['feasible', 'infeasible'].includes(g.__data__[0].trace.name))"
            ".reduce((n, g) => n + g.querySelectorAll('path.point').length, 0)")
        assert svg_points == n_plot
        shapes = plot_shapes(page, 0)
        lat = default_xy(exp["study"].user_attrs, exp["trials"])
        if not by_capacity:  # the latency target, vertical on the latency axis
            assert [target, target] in [s[:2] for s in shapes]
            page.get_by_text("This study predates capacity measurement", exact=False).first.wait_for()
        elif lat[1] != "quality.score":  # capacity vs latency at capacity: the target is horizontal
            assert [target, target] in [s[2:] for s in shapes]
        if shapes:
            assert page.get_by_text(f"latency target {exp['study'].user_attrs['latency_metric']}<{target:g}ms",
                                    exact=False).count() >= 1
        if by_capacity:  # the capacity's interval as horizontal error bars
            err = page.evaluate("() => document.querySelectorAll('.js-plotly-plot')[0].data"
                                ".filter(t => ['feasible', 'infeasible'].includes(t.name)).map(t => t.error_x.visible)")
            assert True in err, err
        assert page.get_by_text(f"{n_plot} of {n} trials plotted", exact=False).count() == 1
        shot(page, "1-pareto")
        # clicking a point selects its trial
        clicked = next((t.number for t in exp["plotted"] if t.number != exp["recommended"]), exp["plotted"][0].number)
        page.mouse.click(*point_xy(page, clicked))
        selected(page, clicked)
        # any metric against any other
        pick(page, "x axis", "batch cap", re.compile(r"^batch cap$"))
        page.get_by_text("no front for these axes", exact=False).wait_for()
        assert sum(plot_traces(page, 0).get(k, 0) for k in ("feasible", "infeasible")) == sum(
            _leaf(t.user_attrs, exp["y"]) is not None and t.user_attrs.get("config") is not None
            for t in exp["trials"])
        if by_capacity and lat[1] == "quality.score":
            # quality was scored (the default y axis): capacity vs latency at capacity, chosen, shows the latency
            # target horizontal, as the default view of a study without quality does
            metric, stat = exp["study"].user_attrs["latency_metric"].split(":")
            label = f"{metric.upper()} {stat} (ms)"
            pick(page, "x axis", "capacity", re.compile(r"^capacity \(req/s\)$"))
            pick(page, "y axis", label[:-5], re.compile(rf"^{re.escape(label)}$"))
            page.wait_for_function("(l) => { const el = document.querySelectorAll('.js-plotly-plot')[0];"
                                   " return el.layout.yaxis.title.text === l && (el.layout.shapes || []).length > 0"
                                   " && el.layout.xaxis.title.text === 'capacity (req/s)'; }", arg=label)
            assert [target, target] in [s[2:] for s in plot_shapes(page, 0)]
            assert page.get_by_text(f"latency target {exp['study'].user_attrs['latency_metric']}<{target:g}ms",
                                    exact=False).count() >= 1
        no_exception(page)

        # latency-load curves of the recommendation and the baseline (or the note of an older study)
        if by_capacity:
            metric, stat = exp["study"].user_attrs["latency_metric"].split(":")
            check_curves(page, exp, target, f"{metric}_ms.{stat}")
        else:
            tab(page, "Latency–load")
            page.get_by_text("No latency-load curves", exact=False).first.wait_for()
        shot(page, "2-latency-load")

        # trials table: every trial, filterable
        tab(page, "Trials")
        page.get_by_text(f"{n} of {n} trials shown", exact=False).wait_for()
        assert table_rows_shown(page, n) == n
        if by_capacity:
            header = page.locator('[data-testid="stDataFrame"]:visible table').first.inner_text()
            assert "capacity req/s" in header and "SLO verdict" in header and "engine" in header, header[:500]
        pick(page, "Feasibility", "infeasible", re.compile(r"^infeasible$"))
        n_inf = n - sum(exp["ok"](t) for t in exp["trials"])
        page.get_by_text(f"{n_inf} of {n} trials shown", exact=False).wait_for()
        if n_inf:
            assert table_rows_shown(page, n_inf) == n_inf
        pick(page, "Feasibility", "all", re.compile(r"^all$"))
        page.get_by_text(f"{n} of {n} trials shown", exact=False).wait_for()
        shot(page, "3-trials")
        # clicking a row selects its trial (rows are in trial order; the first column holds the row checkboxes)
        row = next(i for i, t in enumerate(exp["trials"]) if t.number != clicked)
        grid = page.locator('[data-testid="stDataFrame"]:visible canvas').first.bounding_box()
        page.mouse.click(grid["x"] + 12, grid["y"] + ROW_PX * (row + 1) + ROW_PX / 2)
        selected(page, exp["trials"][row].number)

        # select a trial that is not the recommendation, look at it and export it
        others = [t for t in exp["complete"] if t.number != exp["recommended"]] or exp["complete"]
        other = max(others, key=lambda t: (t.user_attrs["config"]["batch_cap"], -t.number))
        cap = other.user_attrs["config"]["batch_cap"]
        pick(page, "Selected trial (also: click a point or a table row)", f"#{other.number} ",
             re.compile(rf"^#{other.number} ·"))
        tab(page, "Trial detail")
        page.get_by_text(f"Trial {other.number} — COMPLETE", exact=False).wait_for()
        assert page.get_by_text("capacity (req/s)").count() >= 1 and page.get_by_text("peak RSS").count() >= 1
        if by_capacity:  # a trial re-measured after the search (--confirm) shows the re-measure and its trial's
            again = (exp["study"].user_attrs.get("confirmed") or {}).get(str(other.number))
            rps = (again or other.user_attrs)["capacity"].get("requests_per_s")
            page.get_by_text(f"{rps:.3f}" if rps is not None else "—", exact=True).first.wait_for()
            if again:
                own = other.user_attrs["capacity"]["requests_per_s"]
                page.get_by_text(f"its trial measured {own:.3f} req/s", exact=False).first.wait_for()
        n_req = len(other.user_attrs.get("requests") or [])
        if n_req:  # per-request latencies, when the search keeps them
            cdf = page.locator('[data-testid="stPlotlyChart"]:visible .js-plotly-plot').first
            cdf.wait_for()
            counts = page.evaluate("(el) => Object.fromEntries(el.data.map(t => [t.name, t.x.length]))",
                                   cdf.element_handle())
            assert counts == {"TTFT": n_req, "E2E": n_req}
        else:
            page.get_by_text("No per-request latencies recorded", exact=False).wait_for()
        no_exception(page)
        shot(page, "4-trial-detail")

        tab(page, "Why this one")
        page.get_by_text("Parameter importance (fANOVA)").wait_for()
        if by_capacity and exp["recommended"] is not None:  # the answer, recomputed by tuner.search.answer.answer
            page.get_by_text("Binding constraint:", exact=False).wait_for()
            assert page.get_by_text("gain over baseline").count() >= 1
            assert page.get_by_text("capacity (req/s)").count() >= 1
        elif by_capacity:
            page.get_by_text("No feasible configuration yet.").wait_for()
        else:  # an older study: the recommendation its search stored, not recomputed
            page.get_by_text("it is not recomputed", exact=False).first.wait_for()
        no_exception(page)
        shot(page, "5-why")

        tab(page, "Export")
        page.get_by_text(f"Serving configs for trial {other.number}").wait_for()
        code = page.locator('[data-testid="stCode"]:visible').all_inner_texts()
        assert any(f"--max-num-seqs {cap}" in c for c in code), code[:3]
        assert any(f'"batch_cap": {cap}' in c for c in code)  # the trial config JSON
        assert page.get_by_role("button", name="Download config.json").count() == 1
        assert page.locator('[data-testid="stDownloadButton"]:visible').count() >= 3
        shot(page, "6-export")
        tab(page, "llamacpp")
        page.locator('[data-testid="stCode"]:visible').filter(has_text="llama-server").first.wait_for()
        no_exception(page)
        assert page.external == [], page.external  # nothing but the local server was contacted
        print(f"first page load {load_s:.1f}s; measured by capacity: {by_capacity}")
    finally:
        srv.stop()
    assert "Traceback" not in (tmp_path / "dashboard.log").read_text()


@pytest.mark.slow
def test_missing_then_empty_then_live_study(searched, page, tmp_path):
    """`streamlit run app.py -- --storage URL` on a database that does not exist yet: friendly messages while it
    is missing, empty, and has a study without finished trials; then trials appear without reloading the page,
    written by a worker the way `tuner search` writes them (ask, user attributes, tell). Then a study measured by
    capacity (latency-load curves) and one from before the capacity measure (the old view, with a note)."""
    import optuna

    src_storage, name = searched
    src = optuna.load_study(study_name=name, storage=src_storage)
    done = [t for t in src.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    assert done, "the searched study has no COMPLETE trial"
    url = f"sqlite:///{tmp_path / 'live.db'}"
    port = _free_port()
    srv = Server([sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.port", str(port),
                  "--", "--storage", url], port, tmp_path / "streamlit.log", cwd=REPO)  # .streamlit/config.toml applies
    try:
        page.goto(srv.url)
        page.get_by_text("No study database at", exact=False).wait_for()
        no_exception(page)
        shot(page, "7-missing-storage")
        page.get_by_text("checked ", exact=False).wait_for()  # the live watcher runs

        storage = optuna.storages.RDBStorage(url)  # an empty storage appears: the page notices by itself
        page.get_by_text("has no study yet", exact=False).wait_for()
        no_exception(page)
        shot(page, "8-empty-storage")

        study = optuna.create_study(study_name="live", storage=storage, directions=src.directions)
        for k, v in src.user_attrs.items():
            study.set_user_attr(k, v)
        page.get_by_text("has no finished trial yet", exact=False).wait_for()
        trial = study.ask()
        page.get_by_text("1 running", exact=False).wait_for()
        no_exception(page)
        shot(page, "9-no-finished-trial")

        for k, v in done[0].user_attrs.items():  # a real trial's measurements, finished by this worker
            trial.set_user_attr(k, v)
        study.tell(trial, done[0].values)
        page.locator(".js-plotly-plot").first.wait_for()
        x, y = default_xy(src.user_attrs, done)
        on_chart = [t for t in (done[0], done[1 % len(done)]) if _leaf(t.user_attrs, x) is not None
                    and _leaf(t.user_attrs, y) is not None]
        page.get_by_text(f"{len(on_chart[:1])} of 1 trials plotted", exact=False).wait_for()
        again = done[1 % len(done)]
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, values=again.values,
                                                  params=again.params, distributions=again.distributions,
                                                  user_attrs=again.user_attrs))
        page.get_by_text(f"{len(on_chart)} of 2 trials plotted", exact=False).wait_for()
        assert sum(plot_traces(page, 0).get(k, 0) for k in ("feasible", "infeasible")) == len(on_chart)
        no_exception(page)
        shot(page, "10-live")

        # a study measured by capacity, with infeasible, pruned and failed trials: listed, and shown when chosen
        _study(_mixed_specs(), storage=storage, name="mixed")
        pick(page, "Study", "mixed", re.compile(r"^mixed$"))
        page.get_by_text("5 of 7 trials plotted", exact=False).wait_for()
        traces = plot_traces(page, 0)
        assert (traces["feasible"], traces["infeasible"], traces["recommended (trial 1)"]) == (3, 2, 1), traces
        assert traces["Pareto front (feasible)"] == 2  # trials 4 and 1: capacity vs quality
        bars = page.evaluate("() => document.querySelectorAll('.js-plotly-plot')[0].data.filter(t => t.name === "
                             "'feasible').map(t => [t.error_x.arrayminus, t.error_x.array, t.error_y.array])[0]")
        assert bars[1] == pytest.approx([0.25, 1.0, 0.5]) and bars[2] == pytest.approx([0.05] * 3)  # 0, 1, 4
        page.get_by_text("capacity 2.00 req/s (95% CI 2.00–3.00) · meets", exact=False).first.wait_for()
        shot(page, "11-capacity-quality-pareto")

        # its latency-load curves: the recommendation (trial 1) and the baseline (trial 0) by default
        curve_chart(page)
        traces = plot_traces(page, "load_curves")
        assert (traces["trial 1 · transformers-cb"], traces["trial 0 · transformers-cb · baseline"]) == (3, 3), traces
        assert (traces["capacity (trial 1)"], traces["capacity (trial 0)"], traces["open CI (trial 1)"]) == (1, 1, 1)
        assert [s[2:] for s in plot_shapes(page, "load_curves")] == [[3000, 3000]]
        page.get_by_text("latency target ttft:p90<3000ms").first.wait_for()
        assert plot_traces(page, "throughput_curves")["achieved = offered"] == 2
        no_exception(page)
        shot(page, "12-latency-load")
        # add a trial to the comparison, and look at another percentile (the SLO bounds p90 only: no line)
        pick(page, "Trials to compare", "#4 ", re.compile(r"^#4 ·"))
        page.keyboard.press("Escape")
        page.wait_for_function("() => document.querySelector('.st-key-load_curves .js-plotly-plot').data"
                               ".some(t => t.name === 'trial 4 · transformers-assisted')")
        pick(page, "Latency", "TTFT p50", re.compile(r"^TTFT p50 \(ms\)$"))
        page.wait_for_function("() => (document.querySelector('.st-key-load_curves .js-plotly-plot').layout.shapes"
                               " || []).length === 0 && document.querySelector('.st-key-load_curves .js-plotly-plot')"
                               ".layout.yaxis.title.text === 'TTFT p50 (ms)'")
        assert plot_traces(page, "load_curves")["trial 4 · transformers-assisted"] == 3
        no_exception(page)
        shot(page, "13-latency-load-three-trials")

        tab(page, "Trials")
        page.get_by_text("7 of 7 trials shown", exact=False).wait_for()
        grid = page.locator('[data-testid="stDataFrame"]:visible table').first.inner_text()
        assert "stopped early: ttft:p90 over 3000ms" in grid and "out of memory" in grid
        assert "PRUNED" in grid and "FAIL" in grid and "transformers-assisted" in grid and "exceeds" in grid
        pick(page, "State", "FAIL", re.compile(r"^FAIL$"))
        page.keyboard.press("Escape")  # a multiselect stays open (and hides the rest of the page from roles)
        page.get_by_text("1 of 7 trials shown", exact=False).wait_for()
        shot(page, "14-failed-and-pruned")
        pick(page, "Selected trial (also: click a point or a table row)", "#6 ", re.compile(r"^#6 ·"))
        tab(page, "Trial detail")
        page.get_by_text("fail: out of memory", exact=False).wait_for()
        tab(page, "Export")
        page.get_by_text("only COMPLETE trials can be exported", exact=False).wait_for()
        no_exception(page)

        # a study from before the capacity measure: the old tok/s view, with a note, and no curves
        _legacy_study(storage=storage, name="old")
        pick(page, "Study", "old", re.compile(r"^old$"))
        page.get_by_text("3 of 3 trials plotted", exact=False).wait_for()
        page.get_by_text("This study predates capacity measurement", exact=False).first.wait_for()
        assert [3000, 3000] in [s[:2] for s in plot_shapes(page, 0)]  # the latency target on the latency axis
        shot(page, "15-old-study")
        tab(page, "Latency–load")
        page.get_by_text("No latency-load curves", exact=False).first.wait_for()
        no_exception(page)
        assert page.external == [], page.external
    finally:
        srv.stop()
    log = (tmp_path / "streamlit.log").read_text()
    assert "Traceback" not in log and "127.0.0.1" in log


def test_screenshot_dir_is_ignored_by_git():
    assert shutil.which("git") is None or subprocess.run(
        ["git", "check-ignore", "-q", "results/dashboard/x.png"], cwd=REPO).returncode == 0
