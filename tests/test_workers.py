"""Several workers on one study: `tuner search` processes started at the same moment and `tuner worker` joining
later share the --trials budget on SQLite and on a real PostgreSQL server: exactly N trials, contiguous numbers,
one baseline, no configuration sampled twice, every worker exits 0.

Two kinds of runs: real searches (real benches on smollm2-135m, marked slow) and a fast stress of the budget and
baseline logic (many workers, many trials, the objective replaced by a quick stand-in in each worker process)."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_reliability import SPACE, leftover_processes, tuner_argv

BASELINE = {"quant": "bf16", "batch_cap": 1, "kv_fraction": 0.01}


# ------------------------------------------------------------------------------------------- PostgreSQL --- #
def pg_bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(cands[-1]).parent if cands else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A real PostgreSQL server on 127.0.0.1 (a fresh cluster under /tmp, trust auth), stopped at teardown."""
    bindir = pg_bindir()
    if bindir is None or importlib.util.find_spec("psycopg2") is None:
        msg = ("a PostgreSQL server (Debian package postgresql) and psycopg2-binary are needed: "
               "scripts/system_deps.sh postgresql; pip install psycopg2-binary")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    import psycopg2

    root = Path(tempfile.mkdtemp(prefix="tuner-pg-"))
    as_user: dict = {}
    env = dict(os.environ)
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env["HOME"] = str(root)
    data = root / "data"
    subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                    "--no-sync"], cwd=root, env=env, check=True, capture_output=True, timeout=120, **as_user)
    port = free_port()
    log = open(root / "postgres.log", "w")
    proc = subprocess.Popen([str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
                             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=100"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env, start_new_session=True,
                            **as_user)
    try:
        deadline = time.time() + 60
        while True:
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
                break
            except psycopg2.OperationalError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("postgres did not start: " +
                                       (root / "postgres.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE tuner_test")
        conn.close()
        yield f"postgresql://postgres@127.0.0.1:{port}/tuner_test"
    finally:
        proc.send_signal(signal.SIGINT)  # fast shutdown
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def fresh_pg_db(url: str, name: str) -> str:
    import psycopg2

    base, _ = url.rsplit("/", 1)
    host_port = base.split("@", 1)[1]
    host, port = host_port.split(":")
    conn = psycopg2.connect(host=host, port=int(port), user="postgres", dbname="postgres")
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {name}")
    conn.close()
    return f"{base}/{name}"


# ------------------------------------------------------------------------------------------------ checks --- #
def check_study(storage: str, name: str, n_trials: int, min_workers: int = 2, all_complete: bool = True) -> list:
    import optuna

    from tuner.search.storage import open_storage

    study = optuna.load_study(study_name=name, storage=open_storage(storage, create=False))
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(n_trials)), [t.number for t in trials]
    states = [t.state.name for t in trials]
    assert set(states) <= ({"COMPLETE"} if all_complete else {"COMPLETE", "PRUNED", "FAIL"}), \
        [(t.number, t.state.name, t.user_attrs.get("reason")) for t in trials]
    baselines = [t.number for t in trials if t.user_attrs.get("baseline")]
    assert baselines == [0], baselines
    assert trials[0].params == BASELINE
    # kv_fraction is continuous: a configuration comes up twice only when a worker replays another's random draws
    # (the sampler not re-seeded per trial number). Checked: with tuner.search.optuna_private.reseed_sampler made a no-op, the
    # 6-worker SQLite stress run below repeats 3 configurations and fails here.
    keys = [tuple(sorted(t.params.items())) for t in trials]
    dups = {k for k in keys if keys.count(k) > 1}
    assert not dups, dups
    workers = {t.user_attrs.get("worker") for t in trials}
    assert None not in workers
    assert len(workers) >= min_workers, workers
    return trials


# --------------------------------------------------------------------------- fast stress of the budget --- #
# The real `tuner search` worker loop (study, lock, budget, sampling, trial guard, the pick's re-measure by the
# worker that ends last) with the measurements (each trial's and --confirm's) replaced by quick stand-ins.
# TUNER_TEST_BAD_SAMPLE=N injects a failure: trial N samples an invalid configuration.
STAND_IN = r'''
import argparse, os, random, sys, time
import tuner.search.loop as S
import tuner.search.space
from tuner.cli.search import add_arguments, build_context, make_results_dir
p = argparse.ArgumentParser(); add_arguments(p)
args = p.parse_args(sys.argv[1:])
ctx, storage, name, notes = build_context(args)
make_results_dir(ctx.results_dir)
def stand_in(trial, ctx):
    from tuner.search.space import suggest_config
    c = suggest_config(trial, ctx.space, ctx.model, ctx.device)
    time.sleep(float(os.environ.get('TUNER_TEST_TRIAL_S') or 0.05 + 0.3 * random.random()))
    trial.set_user_attr("config", c.to_dict())
    trial.set_user_attr("metrics", {"output_tokens_per_s": 1.0 + c.kv_fraction})
    trial.set_user_attr("constraints", [-1.0, 0.0])
    return (1.0 + c.kv_fraction, 100.0)
S.objective = stand_in
import tuner.search.confirm as C
def confirm_stand_in(config, ctx, trial_dir, plan=None):  # the pick's re-measure (--confirm): the trial's figure
    rps = 1.0 + config.kv_fraction
    point = {"rate_rps": rps, "ttft_ms": {"p50": 1.0}, "attainment": 1.0}
    return {"status": "ok", "metrics": {"capacity": {"requests_per_s": rps, "verdict": "meets", "probes": [point],
                                                     "output_tokens_per_s": rps}}}
C.measure = confirm_stand_in
bad = os.environ.get("TUNER_TEST_BAD_SAMPLE")
if bad:
    real = tuner.search.space.suggest_config
    def sample(trial, space, model, device):
        c = real(trial, space, model, device)
        return c.replace(kv_fraction=0.0) if trial.number == int(bad) else c  # TrialConfig raises TunerError
    tuner.search.space.suggest_config = sample
S.run_search(ctx, storage, name, args.trials, args.timeout, args.seed, progress=False)
'''


def stand_in_args(storage: str, n_trials: int, *extra: str) -> list[str]:
    # p50: the reliability space's 7:8 requests per probe can show it (a p90 needs 42 at its one probe's 2 looks)
    return ["--model", "smollm2-135m", "--space", SPACE, "--latency-metric", "ttft:p50", "--trials", str(n_trials),
            "--no-quality", "--study",
            "stress", "--storage", storage, "--seed", "0", "--device", "cpu", *extra]


def start_stand_in(args: list[str], results: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STAND_IN, *args, "--results-dir", str(results)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TUNER_HEARTBEAT_S": "1", **env})


def stress(tmp_path: Path, storage: str, workers: int, n_trials: int) -> None:
    args = stand_in_args(storage, n_trials, "--latency-target", "60s")
    procs = [start_stand_in(args, tmp_path / f"w{i}") for i in range(workers)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    check_study(storage, "stress", n_trials, min_workers=2)


def test_timeout_starts_no_trial_that_would_end_past_it(tmp_path):
    """--timeout 4s with trials of 1.5 s: two trials; a third would start at ~3 s and end past the 4 s (Optuna's own
    timeout starts it), so the search stops, and every trial has ended within the 4 s."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'timeout.db'}"
    args = stand_in_args(storage, 10, "--latency-target", "60s", "--timeout", "4s", "--confirm", "0")
    p = start_stand_in(args, tmp_path / "w", TUNER_TEST_TRIAL_S="1.5")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    trials = optuna.load_study(study_name="stress", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert (trials[-1].datetime_complete - trials[0].datetime_start).total_seconds() < 4.0


def test_budget_stress_sqlite(tmp_path):
    """6 workers started together, 30 trials: exactly 30, one baseline, no duplicate, no 'database is locked'."""
    stress(tmp_path, f"sqlite:///{tmp_path / 'shared.db'}", workers=6, n_trials=30)


def test_budget_stress_postgres(tmp_path, postgres_url):
    stress(tmp_path, fresh_pg_db(postgres_url, "stress"), workers=6, n_trials=30)


def test_invalid_sampled_config_fails_its_trial_and_the_search_goes_on(tmp_path):
    """Sampling runs inside the trial guard: trial 1's sampled configuration is invalid (injected), so that trial
    ends FAIL with the one-line reason and the next trials run."""
    storage = f"sqlite:///{tmp_path / 'one.db'}"
    proc = start_stand_in(stand_in_args(storage, 4, "--latency-target", "60s"), tmp_path / "w",
                          TUNER_TEST_BAD_SAMPLE="1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    trials = check_study(storage, "stress", 4, min_workers=1, all_complete=False)
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    why = trials[1].user_attrs.get("reason") or ""
    assert "KV fraction 0.0 is invalid" in why and "\n" not in why, why
    assert trials[1].params  # what was sampled before the failure is kept
    assert all(t.user_attrs.get("config") for t in trials if t.number != 1)


SLO_CHANGES = [
    pytest.param(["--latency-target", "60s"], ["--latency-target", "30s"],
                 "slo.bounds=['ttft:p50<60000ms'] (this run: ['ttft:p50<30000ms'])", id="target"),
    pytest.param(["--latency-target", "60s"], ["--latency-target", "60s", "--confidence", "0.9"],
                 "slo.confidence=0.95 (this run: 0.9)", id="confidence"),
    # attainments the space's 8 requests per probe can show (0.95 needs 86 over its 2 looks: refused before the SLO
    # is compared)
    pytest.param(["--slo", "ttft<60s", "--attainment", "0.5"], ["--slo", "ttft<60s", "--attainment", "0.55"],
                 "slo.attainment=0.5 (this run: 0.55)", id="attainment"),
]


def worker_with_another_slo(tmp_path: Path, storage: str, study_slo: list, worker_slo: list, needle: str) -> None:
    """A worker whose SLO differs from the study's is refused in one line before it runs or writes anything."""
    import optuna

    from tests.conftest import assert_one_line_error
    from tuner.search.storage import open_storage

    first = start_stand_in(stand_in_args(storage, 2, *study_slo), tmp_path / "w0")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    proc = subprocess.run(tuner_argv("worker", *stand_in_args(storage, 3, *worker_slo), "--results-dir",
                                     str(tmp_path / "joiner")), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert_one_line_error(proc, "study 'stress' already exists with ", needle)
    assert not (tmp_path / "joiner").exists()
    study = optuna.load_study(study_name="stress", storage=open_storage(storage, create=False))
    assert len(study.get_trials(deepcopy=False)) == 2


@pytest.mark.parametrize("study_slo,worker_slo,needle", SLO_CHANGES)
def test_worker_with_another_slo_is_refused(tmp_path, postgres_url, study_slo, worker_slo, needle):
    db = "slo_" + needle.split("=")[0].split(".")[1]
    worker_with_another_slo(tmp_path, fresh_pg_db(postgres_url, db), study_slo, worker_slo, needle)


def test_worker_with_another_slo_is_refused_on_sqlite(tmp_path):
    worker_with_another_slo(tmp_path, f"sqlite:///{tmp_path / 'shared.db'}", *SLO_CHANGES[0].values)


# ----------------------------------------------------------------------------------------- real workers --- #
def real_workers(tmp_path: Path, storage: str, searches: int, joiners: int, n_trials: int) -> None:
    common = ["--model", "smollm2-135m", "--space", SPACE, "--latency-target", "60s", "--latency-metric", "ttft:p50",
              "--trials", str(n_trials),
              "--no-quality", "--study", "shared", "--storage", storage, "--seed", "0", "--quiet",
              "--confirm", "0", "--strategy", "measure"]
    env = {**os.environ, "TUNER_HEARTBEAT_S": "2"}

    def start(cmd: str, i: int) -> subprocess.Popen:
        return subprocess.Popen(tuner_argv(cmd, *common, "--results-dir", str(tmp_path / f"{cmd}{i}")), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    procs = [start("search", i) for i in range(searches)]  # at the same moment: one study, one baseline
    if joiners:
        import optuna

        from tuner.search.storage import open_storage

        deadline = time.time() + 120
        while "shared" not in optuna.study.get_all_study_names(open_storage(storage)):
            assert time.time() < deadline
            time.sleep(0.5)
        procs += [start("worker", i) for i in range(joiners)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, (out[-2000:], err[-3000:])
        outs.append(out)
    trials = check_study(storage, "shared", n_trials, min_workers=2)
    assert all(t.user_attrs.get("metrics") for t in trials)
    assert any(f"{n_trials} trials, {n_trials} complete" in o for o in outs)  # the last one to finish saw them all
    assert not leftover_processes(tmp_path)


@pytest.mark.slow
def test_real_workers_sqlite_with_tuner_worker(tmp_path):
    """Two searches and a `tuner worker` share one SQLite file (the worker writes its trials into it)."""
    real_workers(tmp_path, f"sqlite:///{tmp_path / 'shared.db'}", searches=2, joiners=1, n_trials=4)


@pytest.mark.slow
def test_real_workers_postgres_with_tuner_worker(tmp_path, postgres_url):
    real_workers(tmp_path, fresh_pg_db(postgres_url, "real"), searches=2, joiners=1, n_trials=4)


def test_worker_refuses_a_missing_study(tmp_path, postgres_url):
    from tests.conftest import assert_one_line_error

    proc = subprocess.run(tuner_argv("worker", "--model", "smollm2-135m", "--latency-target", "1s", "--no-quality",
                                     "--study", "nosuch", "--storage", postgres_url,
                                     "--results-dir", str(tmp_path / "r")),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "study 'nosuch' does not exist")
    assert not (tmp_path / "r").exists()
