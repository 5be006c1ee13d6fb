"""Fault containment, crash/resume and clean-up of `tuner search`, each fault injected for real:

* a trial child killed with SIGKILL and one killed with SIGSEGV (the test finds the bench child and signals it),
* a configuration that runs out of the memory it is given (--trial-memory, RLIMIT_AS in the child),
* a trial that does not finish within --trial-timeout (a real, long workload),
* an exception while a format is applied (GPTQ quantization of a damaged checkpoint),
* a KV cache too small for any request (the engine returns no token for any of them),
* `kill -9` of the search mid-trial, then the same command again (resume),
* Ctrl-C (SIGINT) to the search mid-trial.

Each ends as a FAIL (or PRUNED) trial with a one-line reason in the study, the search goes on, and no process
or temp file is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SPACE = str(REPO / "tests" / "data" / "reliability_space.yaml")
SLOW_SPACE = str(REPO / "tests" / "data" / "reliability_slow.yaml")
SMALL_KV_SPACE = str(REPO / "tests" / "data" / "reliability_small_kv.yaml")
GPTQ_SPACE = str(REPO / "tests" / "data" / "reliability_gptq.yaml")

# `tuner worker` through the command registry; the shim registers it if tuner/cli/__init__.py does not yet.
_WORKER_SHIM = ("import sys; from tuner.cli import COMMANDS, main; "
                "COMMANDS.setdefault('worker', ('tuner.cli.worker', 'join an existing search study')); "
                "sys.exit(main(sys.argv[1:]))")


def tuner_argv(*args: str) -> list[str]:
    if args and args[0] == "worker":
        return [sys.executable, "-c", _WORKER_SHIM, *args]
    return [sys.executable, "-m", "tuner", *args]


def leftover_processes(tag: Path | str) -> list[str]:
    """Processes (other than this one) whose command line mentions `tag` (a test's tmp dir)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(tag) in cmd and p.pid != os.getpid():
            out.append(f"{p.pid}: {cmd[:200]}")
    return out


def assert_clean(tmp: Path) -> None:
    """No process left, no temp file in TMPDIR (torch's empty compile-cache folder aside) or the results."""
    deadline = time.time() + 10
    while leftover_processes(tmp) and time.time() < deadline:
        time.sleep(0.2)
    assert not leftover_processes(tmp), leftover_processes(tmp)
    tmpdir = tmp / "tmpdir"
    junk = [p for p in tmpdir.rglob("*") if not (p.is_dir() and p.name.startswith("torchinductor_"))]
    assert not junk, junk
    assert not [p for p in (tmp / "res").rglob("*") if p.name.endswith((".tmp", ".part"))]
    assert not list(REPO.glob("core*"))


def search_argv(tmp: Path, *extra: str, space: str = SPACE, model: str = "smollm2-135m", trials: int = 1) -> list:
    # p50: the spaces' few requests per probe can show it met (a p99 would need 299 requests per probe)
    return tuner_argv("search", "--model", model, "--space", space, "--latency-target", "60s", "--latency-metric",
                      "ttft:p50", "--no-quality", "--trials", str(trials), "--results-dir", str(tmp / "res"),
                      "--study", "rel", "--seed", "0", "--quiet", "--confirm", "0", "--strategy", "measure", *extra)


def search_env(tmp: Path, **extra: str) -> dict:
    (tmp / "tmpdir").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmpdir"), "TUNER_HEARTBEAT_S": "1", **extra}


def run_search(tmp: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(search_argv(tmp, *extra, **kw), cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=env or search_env(tmp))


def start_search(tmp: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(search_argv(tmp, *extra, **kw), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or search_env(tmp))


def trials_of(tmp: Path, storage: str | None = None) -> list:
    import optuna

    from tuner.search.storage import open_storage

    storage = storage or f"sqlite:///{tmp / 'res' / 'tuner.db'}"
    return optuna.load_study(study_name="rel", storage=open_storage(storage, create=False)).get_trials(deepcopy=False)


def bench_child(search_pid: int, not_pid: int | None = None, timeout: float = 300):
    """The bench child (`tuner.child --job .../bench_job.json`) started by `search_pid` (another one than `not_pid`),
    and its trial number.
    Direct children only: a fork the bench child makes (a library running a helper command) carries the same
    command line for a moment, and signalling it instead would test nothing."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            kids = psutil.Process(search_pid).children(recursive=False)
        except psutil.NoSuchProcess:
            break
        for k in kids:
            try:
                cmd = k.cmdline()
            except psutil.Error:
                continue
            job = cmd[cmd.index("--job") + 1] if "tuner.child" in cmd and "--job" in cmd[:-1] else ""
            if Path(job).name == "bench_job.json" and k.pid != not_pid:
                return k, int(Path(job).parent.name)
        time.sleep(0.1)
    raise AssertionError(f"no bench child appeared under {search_pid}")


def reason(t) -> str:
    r = t.user_attrs.get("reason") or ""
    assert "\n" not in r and r, (t.number, t.state, r)
    return r


# ---------------------------------------------------------------------------------------- fast units --- #
def test_segfault_and_exit_codes_come_back_as_one_line(tmp_path):
    from tuner.child import child_env, run_process

    seg = run_process([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], tmp_path / "seg.log", 60,
                      child_env(None, None))
    assert seg.returncode == -signal.SIGSEGV and seg.reason.startswith("killed by SIGSEGV (crashed)")
    err = run_process([sys.executable, "-c", "raise ValueError('boom')"], tmp_path / "err.log", 60,
                      child_env(None, None))
    assert err.returncode == 1 and err.reason == "ValueError: boom"
    hang = run_process([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "hang.log", 1,
                       child_env(None, None))
    assert hang.returncode is None and hang.reason.startswith("timed out after 1 s")
    oom = run_process([sys.executable, "-c", "import resource; n = 400 << 20; "
                                             "resource.setrlimit(resource.RLIMIT_AS, (n, n)); b = bytearray(n)"],
                      tmp_path / "oom.log", 60, child_env(None, None), memory_bytes=400 << 20)
    assert oom.returncode == 1 and oom.reason.startswith("out of memory (trial memory limit 0.390625 GB)")


_PARENT = r'''
import sys
from pathlib import Path
from tuner.child import child_env, run_process
child = "import os, time; from tuner.child import die_with_parent; " \
        "die_with_parent(int(os.environ['TUNER_CHILD_PARENT_PID'])); print(os.getpid(), flush=True); time.sleep(300)"
run_process([sys.executable, "-c", child], Path(sys.argv[1]), 600, child_env(None, None))
'''


def test_child_dies_with_its_parent(tmp_path):
    """kill -9 of the parent takes the child (in its own session) down: PR_SET_PDEATHSIG."""
    import psutil

    log = tmp_path / "child.log"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(log)], cwd=REPO)
    deadline = time.time() + 60
    while not (log.is_file() and log.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)
    child = psutil.Process(int(log.read_text().split()[0]))
    assert child.ppid() == parent.pid
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive


def test_dead_workers_trials_are_failed_with_a_reason(tmp_path, monkeypatch):
    """A RUNNING trial whose worker is gone: failed at once when the worker ran here (pid gone), after the heartbeat
    grace period when it ran elsewhere; a live worker's trial is left alone."""
    import optuna

    from tuner.search.storage import open_storage
    from tuner.search.workers import fail_dead_trials, worker_tag

    monkeypatch.setenv("TUNER_HEARTBEAT_S", "1")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name="s", storage=open_storage(f"sqlite:///{tmp_path / 'db.sqlite'}"),
                                directions=["maximize", "maximize"])
    dead = subprocess.run([sys.executable, "-c", "from tuner.search.workers import worker_tag; print(worker_tag())"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    tags = [dead, "another-host:123:456", worker_tag()]
    ids = []
    for tag in tags:
        t = study.ask()
        t.set_user_attr("worker", tag)
        study._storage.record_heartbeat(t._trial_id)
        ids.append(t._trial_id)
    assert fail_dead_trials(study) == [0]  # the local dead pid at once; the remote one still within its grace
    time.sleep(5)  # grace 3 s; SQLite's clock has whole seconds
    study._storage.record_heartbeat(ids[2])  # this (live) worker keeps beating
    assert fail_dead_trials(study) == [1]
    trials = study.get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "RUNNING"]
    assert "died during the trial (process gone)" in reason(trials[0])
    assert "no heartbeat from its worker another-host:123:456 for over 3 s" in reason(trials[1])


def test_trust_remote_code_is_never_enabled(tmp_path):
    """A checkpoint that asks for its own Python code (auto_map) is refused without running that code."""
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    marker = tmp_path / "code-ran"
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "evil-net", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    (ckpt / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = subprocess.run(tuner_argv("bench", "--model", str(ckpt), "--quant", "bf16", "--requests", "1",
                                     "--quiet", "--no-bandwidth"), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "status: FAILED: loading bf16 failed" in proc.stdout and "trust_remote_code" in proc.stdout
    assert not marker.exists()


def test_dashboard_binds_to_localhost_by_default():
    import argparse

    from tuner.cli import dashboard

    p = argparse.ArgumentParser()
    dashboard.add_parser(p.add_subparsers())
    args = p.parse_args(["dashboard"])
    assert args.host == "127.0.0.1"
    argv = dashboard.streamlit_argv(dashboard.APP, "sqlite:///x.db", args.host, args.port)
    assert argv[argv.index("--server.address") + 1] == "127.0.0.1"


# ------------------------------------------------------------------------------------ real fault runs --- #
@pytest.mark.slow
def test_killed_children_fail_their_trials_and_the_search_goes_on(tmp_path):
    """Trial 0's bench child gets SIGKILL, trial 1's SIGSEGV; trial 2 runs normally; the search ends with exit 0."""
    proc = start_search(tmp_path, trials=3)
    try:
        child, number = bench_child(proc.pid)
        assert number == 0
        time.sleep(1.5)
        child.send_signal(signal.SIGKILL)
        child2, number = bench_child(proc.pid, not_pid=child.pid)
        assert number == 1
        time.sleep(1.5)
        child2.send_signal(signal.SIGSEGV)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    t = trials_of(tmp_path)
    assert [x.state.name for x in t] == ["FAIL", "FAIL", "COMPLETE"]
    assert reason(t[0]).startswith("killed by SIGKILL")
    assert reason(t[1]).startswith("killed by SIGSEGV (crashed)")
    assert "3 trials, 1 complete, 1 feasible, 0 pruned, 2 failed" in out
    assert_clean(tmp_path)


@pytest.mark.slow
def test_config_that_runs_out_of_its_memory_fails(tmp_path):
    """1.5 GB of address space holds Python + torch + transformers but not the model: a real allocation failure."""
    proc = run_search(tmp_path, "--trial-memory", "1.5", trials=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = trials_of(tmp_path)
    assert [x.state.name for x in t] == ["FAIL", "FAIL"]
    for x in t:
        r = reason(x)  # on this machine: "...: loading bf16 failed: RuntimeError: unable to mmap ... (12)"
        assert r.startswith("out of memory (trial memory limit 1.5 GB): "), r
    assert "NO FEASIBLE CONFIGURATION" in proc.stdout
    assert_clean(tmp_path)


@pytest.mark.slow
def test_trial_past_its_time_limit_is_stopped(tmp_path):
    """A workload of 2 x 4000 output tokens cannot finish in 8 s: the trial is stopped and failed, and the search
    goes on to its next trial."""
    proc = run_search(tmp_path, "--trial-timeout", "8s", space=SLOW_SPACE, trials=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = trials_of(tmp_path)
    assert [x.state.name for x in t] == ["FAIL", "FAIL"]
    assert all(reason(x).startswith("timed out after 8 s (trial time limit)") for x in t)
    assert_clean(tmp_path)


@pytest.mark.slow
def test_exception_while_quantizing_fails_the_trial(tmp_path):
    """gptq-int4 of a checkpoint whose weights file is damaged: GPTQModel raises while preparing the quantization;
    the trial fails with that one line and no half-written quantization is left in the cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tuner.models import checkpoint_dir

    ckpt = tmp_path / "damaged"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=49152, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint_dir("smollm2-135m") / f, ckpt)
    weights = ckpt / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    cache = tmp_path / "cache"
    proc = run_search(tmp_path, space=GPTQ_SPACE, model=str(ckpt), env=search_env(tmp_path, TUNER_CACHE=str(cache)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (t,) = trials_of(tmp_path)
    assert t.state.name == "FAIL"
    assert reason(t).startswith("loading gptq-int4 failed: "), reason(t)
    assert not [p for p in (cache / "quant").rglob("*")]  # the temp dir of the failed quantization is gone
    assert_clean(tmp_path)


@pytest.mark.slow
def test_kv_cache_too_small_for_every_request(tmp_path):
    """No request fits in the KV cache: the engine gives back no token, already in the warm-up; the trial is failed
    with the reason, not recorded as a fast configuration."""
    proc = run_search(tmp_path, space=SMALL_KV_SPACE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (t,) = trials_of(tmp_path)
    assert t.state.name == "FAIL"
    r = reason(t)
    assert "every warm-up request failed" in r, r  # found before any rate is probed
    assert_clean(tmp_path)


@pytest.mark.slow
def test_kill_9_mid_trial_then_resume(tmp_path):
    """kill -9 of `tuner search` while trial 1 runs: its bench child dies with it; the same command again keeps
    trial 0, marks trial 1 failed with the reason, and runs trial 2 (budget 3)."""
    import psutil

    proc = start_search(tmp_path, trials=3)
    try:
        child, number = bench_child(proc.pid)
        assert number == 0
        child2, number = bench_child(proc.pid, not_pid=child.pid)
        assert number == 1
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    gone, alive = psutil.wait_procs([child2], timeout=10)
    assert not alive, "the bench child outlived its killed parent"
    before = trials_of(tmp_path)
    assert [x.state.name for x in before] == ["COMPLETE", "RUNNING"]
    first = (before[0].params, before[0].values, before[0].user_attrs["metrics"])

    again = run_search(tmp_path, trials=3)
    assert again.returncode == 0, again.stderr[-3000:]
    t = trials_of(tmp_path)
    assert [x.state.name for x in t] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert (t[0].params, t[0].values, t[0].user_attrs["metrics"]) == first
    assert reason(t[1]).startswith("interrupted: its worker"), reason(t[1])
    assert t[1].params and t[2].params != t[1].params
    assert "3 trials, 2 complete" in again.stdout
    assert_clean(tmp_path)


@pytest.mark.slow
def test_ctrl_c_stops_the_child_and_keeps_what_finished(tmp_path):
    proc = start_search(tmp_path, trials=3)
    try:
        child, _ = bench_child(proc.pid)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "tuner search: interrupted"
    assert "Traceback" not in err
    (t,) = trials_of(tmp_path)
    assert t.state.name == "FAIL" and reason(t).startswith("interrupted")
    assert json.loads((tmp_path / "res" / "rel" / "recommendation.json").read_text())["n_trials"] == 1
    assert not child.is_running()
    assert_clean(tmp_path)
