"""The dashboard: the pure data shaping (tuner/dashboard.py), `tuner dashboard`'s input checks, and the real app
(app.py served by Streamlit) in a real headless Chromium driven by Playwright, on a study written by a real
`tuner search`. Screenshots go to results/dashboard/ for a person to look at.

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
from tuner import dashboard as dash
from tuner.errors import TunerError

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = REPO / "results" / "dashboard"
SPACE = str(REPO / "tests" / "data" / "tiny_space.yaml")
ROW_PX = 35  # Streamlit's data frame row (and header) height
LOAD_S = 120  # first page load imports optuna, plotly, transformers' config... on a busy 2-core machine


# ============================================================================== pure functions (in-memory) === #
def _metrics(tok_s: float, ttft_p99: float, e2e_p99: float, **extra):
    pct = lambda v: {"p50": v / 2, "p90": v * 0.9, "p95": v * 0.95, "p99": v, "mean": v / 2}  # noqa: E731
    return {"output_tokens_per_s": tok_s, "requests_per_s": tok_s / 10, "ttft_ms": pct(ttft_p99),
            "tpot_ms": pct(40.0), "itl_ms": pct(40.0), "e2e_ms": pct(e2e_p99), "completed": 4, "failed": 0,
            "peak_rss_mb": 800.0, "peak_cuda_mb": None, "roofline": {"percent_of_bound": 12.5}, **extra}


def _config(quant="bf16", batch_cap=4, kv=0.01, draft="none"):
    return {"model": "smollm2-135m", "quant": quant, "batch_cap": batch_cap, "kv_fraction": kv, "draft": draft,
            "device": "cpu"}


NAMES = ["ttft:p99<3000ms", "quality drop<=1pp", "failed requests=0"]
ATTRS = {"model": "smollm2-135m", "primary": "ttft:p99<3000ms", "bounds": ["ttft:p99<3000ms"],
         "constraint_names": NAMES, "latency_metric": "ttft:p99", "latency_target_ms": 3000.0,
         "max_quality_drop": 1.0}


def _study(specs, storage=None, name=None):
    """An Optuna study (in memory unless `storage`) with trials shaped like `tuner search` writes them."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize", "maximize"], storage=storage, study_name=name)
    for k, v in ATTRS.items():
        study.set_user_attr(k, v)
    dists = {"quant": CategoricalDistribution(["fp32", "bf16", "bnb-nf4"]),
             "batch_cap": CategoricalDistribution([1, 2, 4, 8]), "kv_fraction": FloatDistribution(0.001, 0.1, log=True),
             "draft": CategoricalDistribution(["none", "ngram:3"])}
    for i, s in enumerate(specs):
        cfg = _config(s.get("quant", "bf16"), s.get("batch_cap", 4), s.get("kv", 0.01), s.get("draft", "none"))
        ua = {"config": cfg, **({"baseline": True} if i == 0 else {})}
        state = s.get("state", TrialState.COMPLETE)
        values = None
        if "tok" in s:
            m = _metrics(s["tok"], s["ttft"], s["ttft"] + 500, **s.get("extra", {}))
            q = {"score": s.get("q", 0.5), "score_stderr": 0.05, "drop_pp": s.get("drop", 0.0), "limit": 8,
                 "seed": 1, "tasks": {"arc_easy": {"acc": s.get("q", 0.5), "acc_stderr": 0.05}}}
            ua.update(metrics=m, quality=q, requests=[{"ttft_ms": s["ttft"] * f, "e2e_ms": s["ttft"] * f + 500,
                                                        "tpot_ms": 40.0, "output_tokens": 10, "error": None}
                                                       for f in (0.2, 0.5, 1.0)],
                      engine={"name": "transformers-cb", "versions": {"transformers": "5.24.0"}, "device": "cpu"})
            if state == TrialState.COMPLETE:
                ua["constraints"] = [s["ttft"] - 3000, s.get("drop", 0.0) - 1.0, 0.0]
                values = [s["tok"], s["ttft"], s.get("q", 0.5)]
        if s.get("reason"):
            ua["reason"] = s["reason"]
        params = {"quant": cfg["quant"], "batch_cap": cfg["batch_cap"], "kv_fraction": cfg["kv_fraction"],
                  "draft": cfg["draft"]}
        study.add_trial(create_trial(state=state, values=values, params=params, distributions=dists, user_attrs=ua))
    return study


def _mixed_specs():
    from optuna.trial import TrialState

    return [
        {"quant": "fp32", "batch_cap": 1, "tok": 5.0, "ttft": 2000},  # 0 baseline, feasible
        {"quant": "bf16", "batch_cap": 4, "tok": 20.0, "ttft": 1500, "q": 0.55},  # 1 feasible, best
        {"quant": "bf16", "batch_cap": 8, "tok": 30.0, "ttft": 5000},  # 2 infeasible (latency)
        {"quant": "bnb-nf4", "batch_cap": 2, "tok": 12.0, "ttft": 900, "q": 0.40, "drop": 3.0},  # 3 infeasible quality
        {"quant": "bf16", "batch_cap": 2, "draft": "ngram:3", "tok": 10.0, "ttft": 800,
         "extra": {"acceptance_rate": 0.4}},  # 4 feasible, on the 2-D front (lowest latency)
        {"quant": "bnb-nf4", "state": TrialState.PRUNED, "reason": "stopped early: ttft:p99 over 3000ms"},  # 5
        {"quant": "fp32", "batch_cap": 8, "state": TrialState.FAIL, "reason": "out of memory\ntraceback..."},  # 6
    ]


@pytest.fixture(scope="module")
def mixed():
    study = _study(_mixed_specs())
    info = dash.study_info("mixed", study.user_attrs)
    return study, info, dash.trial_views(study.get_trials(deepcopy=False))


def test_storage_url_from_args_env_default():
    assert dash.storage_from_argv(["--storage", "sqlite:///a.db"], {"TUNER_STORAGE": "sqlite:///b.db"}) == \
        "sqlite:///a.db"
    assert dash.storage_from_argv(["--other", "x"], {"TUNER_STORAGE": "sqlite:///b.db"}) == "sqlite:///b.db"
    assert dash.storage_from_argv([], {}) == "sqlite:///results/tuner.db"


@pytest.mark.parametrize("url,needle", [
    ("not a url", "is invalid"), ("nosuch://x", "unusable"), ("sqlite:////nonexistent/dir/x.db", "does not exist"),
])
def test_check_storage_url_rejects(url, needle):
    with pytest.raises(TunerError, match=needle):
        dash.check_storage_url(url)


def test_display_url_masks_password():
    assert dash.display_url("postgresql://me:secret@db.local/tuner") == "postgresql://me:***@db.local/tuner"
    assert dash.display_url("sqlite:///results/tuner.db") == "sqlite:///results/tuner.db"


def test_check_storage_url_accepts_missing_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'later.db'}"
    assert dash.check_storage_url(url) == url
    assert not (tmp_path / "later.db").exists()  # nothing created
    with pytest.raises(TunerError, match="no such database file"):
        dash.open_storage_readonly(url)
    assert not (tmp_path / "later.db").exists()


def test_study_info_and_target_lines(mixed):
    _, info, _ = mixed
    assert info.latency_field == "ttft_ms.p99" and info.latency_target_ms == 3000.0 and info.from_search
    assert dash.target_lines(info, "ttft_ms.p99", "output_tokens_per_s") == [
        {"axis": "x", "value": 3000.0, "label": "latency target ttft:p99<3000ms"}]
    assert dash.target_lines(info, "output_tokens_per_s", "ttft_ms.p99")[0]["axis"] == "y"
    assert dash.target_lines(info, "e2e_ms.p99", "output_tokens_per_s") == []
    assert dash.metric_field("tpot:p50") == "tpot_ms.p50" and dash.metric_field("nonsense") is None


def test_table_has_every_trial_with_reasons_and_filters(mixed):
    _, info, views = mixed
    rows = dash.table_rows(views, info, recommended=1)
    assert [r["number"] for r in rows] == list(range(7))
    assert [r["state"] for r in rows] == ["COMPLETE"] * 5 + ["PRUNED", "FAIL"]
    assert [r["feasible"] for r in rows] == [True, True, False, False, True, None, None]
    assert rows[1]["recommended"] and rows[0]["baseline"]
    assert rows[5]["reason"].startswith("stopped early") and rows[6]["reason"] == "out of memory"
    assert rows[1]["ttft_p99_ms"] == 1500 and rows[4]["acceptance_rate"] == 0.4 and rows[3]["drop_pp"] == 3.0
    assert [r["number"] for r in dash.filter_rows(rows, feasible="feasible")] == [0, 1, 4]
    assert [r["number"] for r in dash.filter_rows(rows, feasible="infeasible")] == [2, 3, 5, 6]
    assert [r["number"] for r in dash.filter_rows(rows, formats=["bnb-nf4"])] == [3, 5]
    assert [r["number"] for r in dash.filter_rows(rows, states=["PRUNED", "FAIL"])] == [5, 6]
    assert dash.filter_rows(rows, formats=["bf16"], feasible="feasible", states=["COMPLETE"])[0]["number"] == 1
    with pytest.raises(ValueError):
        dash.filter_rows(rows, feasible="maybe")


def test_axis_fields_labels_directions(mixed):
    _, info, views = mixed
    fields = dash.axis_fields(views, info)
    assert fields[:2] == ["output_tokens_per_s", "ttft_ms.p99"]
    assert {"quality.score", "config.batch_cap", "config.kv_fraction", "roofline.percent_of_bound",
            "quality.tasks.arc_easy.acc", "e2e_ms.p50"} <= set(fields)
    assert not any(f.endswith(("_stderr", ".seed", ".limit")) for f in fields)
    assert dash.field_label("ttft_ms.p99") == "TTFT p99 (ms)" and dash.field_label("config.batch_cap") == "batch cap"
    assert dash.field_label("output_tokens_per_s") == "output tok/s"
    assert (dash.direction("output_tokens_per_s"), dash.direction("e2e_ms.mean"), dash.direction("peak_rss_mb"),
            dash.direction("quality.score"), dash.direction("config.batch_cap")) == ("max", "min", "min", "max", None)


def test_chart_points_and_pareto_line(mixed):
    _, info, views = mixed
    pts = dash.chart_points(views, "ttft_ms.p99", "output_tokens_per_s", info, recommended=1)
    assert [p["number"] for p in pts] == [0, 1, 2, 3, 4]  # pruned/failed trials have no metrics here
    assert [p["feasible"] for p in pts] == [True, True, False, False, True]
    assert [p["number"] for p in pts if p["recommended"]] == [1]
    assert "batch cap 4" in pts[1]["hover"] and "bf16" in pts[1]["hover"] and "quality 0.550" in pts[1]["hover"]
    front = dash.pareto_line(pts, dash.direction("ttft_ms.p99"), dash.direction("output_tokens_per_s"))
    # latency min, tok/s max among feasible (0, 1, 4): 4 (800 ms, 10) and 1 (1500 ms, 20); 0 is dominated by 1
    assert [(p["number"], p["x"], p["y"]) for p in front] == [(4, 800, 10.0), (1, 1500, 20.0)]
    assert dash.pareto_line(pts, None, "max") == []
    assert dash.quality_range(pts) == (0.4, 0.55)
    assert dash.quality_range([{"quality": None}]) is None
    # any metric against any metric
    assert len(dash.chart_points(views, "config.batch_cap", "peak_rss_mb")) == 5


def test_detail_latencies_quality_tasks(mixed):
    _, info, views = mixed
    d = dash.detail(views[4])
    assert d["uses_draft"] and d["acceptance_rate"] == 0.4 and d["peak_rss_mb"] == 800.0
    assert d["tasks"] == [{"task": "arc_easy", "acc": 0.5, "acc_stderr": 0.05}]
    assert d["percentiles"]["ttft_ms"]["p99"] == 800
    s = dash.latency_samples(views[4].requests + [{"ttft_ms": 1.0, "e2e_ms": 2.0, "error": "boom"}])
    assert s["ttft_ms"] == [160.0, 400.0, 800.0] and len(s["e2e_ms"]) == 3
    assert dash.ecdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    assert not dash.detail(views[0])["uses_draft"]
    assert dash.detail(views[6])["reason"].startswith("out of memory")


def test_why_reuses_the_search_answer(mixed):
    from tuner.study import answer, rows_from_study
    from tuner.targets import parse_slo

    study, info, views = mixed
    w = dash.why(views, info)
    expected = answer(rows_from_study(study), NAMES, parse_slo("ttft:p99<3000ms")[0], 0)
    assert w["answer"] == expected
    rec = w["answer"]["recommendation"]
    assert rec["trial"] == 1 and rec["gain_over_baseline"] == pytest.approx(4.0)
    assert "ttft:p99<3000ms" in rec["binding_constraint"]  # trial 2 was faster and broke the latency target
    assert dash.recommended_number(w["answer"], info) == 1
    assert [c["satisfied"] for c in w["constraints"]] == [True, True, True]
    assert dash.why(views, dash.study_info("foreign", {}))["message"].startswith("this study was not written")


def test_param_importances_and_too_few_trials(mixed):
    study, _, _ = mixed
    trials = study.get_trials(deepcopy=False)
    imp = dash.param_importances(trials, study.directions)
    assert set(imp) == {"throughput", "latency"}
    for res in imp.values():
        assert set(res["importances"]) <= {"quant", "batch_cap", "kv_fraction", "draft"}
        assert sum(res["importances"].values()) == pytest.approx(1.0)
    few = dash.param_importances(trials[:2], study.directions)
    assert few["throughput"] == {"message": "needs at least 3 completed trials with a throughput value (has 2)"}
    assert dash.param_importances([], None)["latency"]["message"].startswith("needs at least")


def test_exports_for_every_target(mixed):
    from tuner.export import TARGETS

    study, _, views = mixed
    exps = dash.exports(views[1], "mixed")
    assert [e["target"] for e in exps] == list(TARGETS)
    vllm = exps[0]
    assert "error" not in vllm and "--max-num-seqs 4" in vllm["command"]
    assert any("--max-num-seqs 4" in text for text in vllm["files"].values())
    assert json.loads(vllm["json"])["source"] == {"study": "mixed", "trial": 1}
    assert json.loads(dash.config_json(views[1]))["batch_cap"] == 4
    with pytest.raises(TunerError, match="PRUNED"):
        dash.exports(views[5], "mixed")


def test_signature_and_counts(mixed):
    study, _, views = mixed
    sig = dash.signature(study.get_trials(deepcopy=False))
    assert sig[0] == (0, "COMPLETE") and sig[5] == (5, "PRUNED") and len(sig) == 7
    c = dash.state_counts(views)
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
def searched(tmp_path_factory):
    """(storage URL, study name) of a study written by a real `tuner search` (3 trials, no quality scoring)."""
    if os.environ.get("TUNER_TEST_STORAGE"):
        return os.environ["TUNER_TEST_STORAGE"], os.environ.get("TUNER_TEST_STUDY", "tiny")
    _need_browser()  # no point searching when the browser tests cannot run
    d = tmp_path_factory.mktemp("dash-search")
    proc = run_tuner("search", "--model", "smollm2-135m", "--space", SPACE, "--latency-target", "120s",
                     "--trials", "3", "--no-quality", "--results-dir", str(d), "--study", "tiny", "--seed", "0",
                     "--quiet", timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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


def plot_traces(pg, index: int) -> dict:
    """name -> number of points of each trace of the index-th Plotly chart on the page."""
    return pg.evaluate(
        "(i) => { const el = document.querySelectorAll('.js-plotly-plot')[i];"
        " const out = {}; (el.data || []).forEach(t => { out[t.name || ''] = (t.x || []).filter(v => v !== null)"
        ".length; }); return out; }", index)


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


def table_rows_shown(pg) -> int:
    """Data rows of the visible Streamlit data frame (its accessibility table; aria-rowcount counts the header)."""
    grid = pg.locator('[data-testid="stDataFrame"]:visible table[aria-rowcount]').first
    return int(grid.get_attribute("aria-rowcount")) - 1


def expected(storage: str, name: str) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    plotted = [t for t in trials if (t.user_attrs.get("metrics") or {}).get("output_tokens_per_s") is not None
               and ((t.user_attrs.get("metrics") or {}).get("ttft_ms") or {}).get("p99") is not None]
    feasible = [t for t in trials if t.state.name == "COMPLETE" and t.user_attrs.get("constraints") is not None
                and all(c <= 0 for c in t.user_attrs["constraints"])]
    return {"study": study, "trials": trials, "plotted": plotted, "feasible": feasible,
            "complete": [t for t in trials if t.state.name == "COMPLETE"],
            "recommended": study.user_attrs.get("recommended_trial")}


@pytest.mark.slow
def test_dashboard_in_a_real_browser(searched, page, tmp_path):
    storage, name = searched
    exp = expected(storage, name)
    n, n_plot = len(exp["trials"]), len(exp["plotted"])
    target = exp["study"].user_attrs["latency_target_ms"]
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
        if exp["recommended"] is not None:
            assert traces[f"recommended (trial {exp['recommended']})"] == 1
            assert traces.get("Pareto front (feasible)", 0) >= 1
        svg_points = page.evaluate(  # markers drawn in the SVG for the two trial traces
            "() => Array.from(document.querySelectorAll('.js-plotly-plot')[0].querySelectorAll('.scatterlayer "
            ".trace')).filter(g => ['feasible', 'infeasible'].includes(g.__data__[0].trace.name))"
            ".reduce((n, g) => n + g.querySelectorAll('path.point').length, 0)")
        assert svg_points == n_plot
        shapes = page.evaluate("() => document.querySelectorAll('.js-plotly-plot')[0].layout.shapes"
                               ".map(s => [s.x0, s.x1])")
        assert [target, target] in shapes  # the latency target, vertical on the TTFT p99 axis
        assert page.get_by_text(f"latency target ttft:p99<{target:g}ms").count() >= 1
        assert page.get_by_text(f"{n_plot} of {n} trials plotted", exact=False).count() == 1
        shot(page, "1-pareto")
        # clicking a point selects its trial
        clicked = next((t.number for t in exp["plotted"] if t.number != exp["recommended"]), exp["plotted"][0].number)
        page.mouse.click(*point_xy(page, clicked))
        selected(page, clicked)
        # any metric against any other
        pick(page, "x axis", "batch cap", re.compile(r"^batch cap$"))
        page.get_by_text("no front for these axes", exact=False).wait_for()
        assert sum(plot_traces(page, 0).get(k, 0) for k in ("feasible", "infeasible")) == n_plot
        no_exception(page)

        # trials table: every trial, filterable
        tab(page, "Trials")
        page.get_by_text(f"{n} of {n} trials shown", exact=False).wait_for()
        assert table_rows_shown(page) == n
        pick(page, "Feasibility", "infeasible", re.compile(r"^infeasible$"))
        n_inf = n - len(exp["feasible"])
        page.get_by_text(f"{n_inf} of {n} trials shown", exact=False).wait_for()
        if n_inf:
            assert table_rows_shown(page) == n_inf
        pick(page, "Feasibility", "all", re.compile(r"^all$"))
        page.get_by_text(f"{n} of {n} trials shown", exact=False).wait_for()
        shot(page, "2-trials")
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
        cdf = page.locator('[data-testid="stPlotlyChart"]:visible .js-plotly-plot').first
        cdf.wait_for()
        n_req = len(other.user_attrs["requests"])
        counts = page.evaluate("(el) => Object.fromEntries(el.data.map(t => [t.name, t.x.length]))",
                               cdf.element_handle())
        assert counts == {"TTFT": n_req, "E2E": n_req}
        assert page.get_by_text("peak RSS").count() >= 1
        no_exception(page)
        shot(page, "3-trial-detail")

        tab(page, "Why this one")
        page.get_by_text("Binding constraint:", exact=False).wait_for()
        page.get_by_text("Parameter importance (fANOVA)").wait_for()
        assert page.get_by_text("gain over baseline").count() >= 1
        no_exception(page)
        shot(page, "4-why")

        tab(page, "Export")
        page.get_by_text(f"Serving configs for trial {other.number}").wait_for()
        code = page.locator('[data-testid="stCode"]:visible').all_inner_texts()
        assert any(f"--max-num-seqs {cap}" in c for c in code), code[:3]
        assert any(f'"batch_cap": {cap}' in c for c in code)  # the trial config JSON
        assert page.get_by_role("button", name="Download config.json").count() == 1
        assert page.locator('[data-testid="stDownloadButton"]:visible').count() >= 3
        shot(page, "5-export")
        tab(page, "llamacpp")
        page.locator('[data-testid="stCode"]:visible').filter(has_text="llama-server").first.wait_for()
        no_exception(page)
        assert page.external == [], page.external  # nothing but the local server was contacted
        print(f"first page load {load_s:.1f}s")
    finally:
        srv.stop()
    assert "Traceback" not in (tmp_path / "dashboard.log").read_text()


@pytest.mark.slow
def test_missing_then_empty_then_live_study(searched, page, tmp_path):
    """`streamlit run app.py -- --storage URL` on a database that does not exist yet: friendly messages while it
    is missing, empty, and has a study without finished trials; then trials appear without reloading the page,
    written by a worker the way `tuner search` writes them (ask, user attributes, tell)."""
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
        shot(page, "6-missing-storage")
        page.get_by_text("checked ", exact=False).wait_for()  # the live watcher runs

        storage = optuna.storages.RDBStorage(url)  # an empty storage appears: the page notices by itself
        page.get_by_text("has no study yet", exact=False).wait_for()
        no_exception(page)
        shot(page, "7-empty-storage")

        study = optuna.create_study(study_name="live", storage=storage, directions=src.directions)
        for k, v in src.user_attrs.items():
            study.set_user_attr(k, v)
        page.get_by_text("has no finished trial yet", exact=False).wait_for()
        trial = study.ask()
        page.get_by_text("1 running", exact=False).wait_for()
        no_exception(page)
        shot(page, "8-no-finished-trial")

        for k, v in done[0].user_attrs.items():  # a real trial's measurements, finished by this worker
            trial.set_user_attr(k, v)
        study.tell(trial, done[0].values)
        page.locator(".js-plotly-plot").first.wait_for()
        page.get_by_text("1 of 1 trials plotted", exact=False).wait_for()
        again = done[1 % len(done)]
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, values=again.values,
                                                  params=again.params, distributions=again.distributions,
                                                  user_attrs=again.user_attrs))
        page.get_by_text("2 of 2 trials plotted", exact=False).wait_for()
        assert sum(plot_traces(page, 0).get(k, 0) for k in ("feasible", "infeasible")) == 2
        no_exception(page)
        shot(page, "9-live")

        # a second study in the storage, with infeasible, pruned and failed trials: listed, and shown when chosen
        _study(_mixed_specs(), storage=storage, name="mixed")
        pick(page, "Study", "mixed", re.compile(r"^mixed$"))
        page.get_by_text("5 of 7 trials plotted", exact=False).wait_for()
        traces = plot_traces(page, 0)
        assert (traces["feasible"], traces["infeasible"], traces["recommended (trial 1)"]) == (3, 2, 1), traces
        assert [3000, 3000] in page.evaluate(
            "() => document.querySelectorAll('.js-plotly-plot')[0].layout.shapes.map(s => [s.x0, s.x1])")
        shot(page, "10-infeasible-pareto")
        tab(page, "Trials")
        page.get_by_text("7 of 7 trials shown", exact=False).wait_for()
        grid = page.locator('[data-testid="stDataFrame"]:visible table').first.inner_text()
        assert "stopped early: ttft:p99 over 3000ms" in grid and "out of memory" in grid
        assert "PRUNED" in grid and "FAIL" in grid
        pick(page, "State", "FAIL", re.compile(r"^FAIL$"))
        page.keyboard.press("Escape")  # a multiselect stays open (and hides the rest of the page from roles)
        page.get_by_text("1 of 7 trials shown", exact=False).wait_for()
        shot(page, "11-failed-and-pruned")
        pick(page, "Selected trial (also: click a point or a table row)", "#6 ", re.compile(r"^#6 ·"))
        tab(page, "Trial detail")
        page.get_by_text("fail: out of memory", exact=False).wait_for()
        tab(page, "Export")
        page.get_by_text("only COMPLETE trials can be exported", exact=False).wait_for()
        no_exception(page)
        assert page.external == [], page.external
    finally:
        srv.stop()
    log = (tmp_path / "streamlit.log").read_text()
    assert "Traceback" not in log and "127.0.0.1" in log


def test_screenshot_dir_is_ignored_by_git():
    assert shutil.which("git") is None or subprocess.run(
        ["git", "check-ignore", "-q", "results/dashboard/x.png"], cwd=REPO).returncode == 0
