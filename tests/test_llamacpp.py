"""The llama.cpp engine end to end: `tuner bench --engine llamacpp` launches a real llama-server with exactly the
argv `tuner export --to llamacpp` writes, and every failure is data or one line. The build comes from
`make llamacpp` (make test builds it first)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner
from tuner.config import TrialConfig

MODEL = "smollm2-135m"
SMALL = ["--requests", "8", "--concurrency", "2", "--input-len", "16:32", "--output-len", "8:12", "--no-bandwidth",
         "--quiet"]


@pytest.fixture(autouse=True, scope="module")
def _built():
    from tuner.engines.llamacpp import availability

    ok, why = availability()
    if not ok:
        pytest.fail(why)


def servers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server"]


def test_bench_then_export_is_the_argv_that_ran_and_bench_config_reproduces_it(tmp_path):
    b = tmp_path / "b.json"
    proc = run_tuner("bench", "--engine", "llamacpp", "--model", MODEL, "--quant", "Q8_0", "--batch-cap", "2",
                     "--kv-fraction", "0.002", "--kv-type", "q8_0", "--threads", "1", "--ubatch", "128", *SMALL,
                     "--json", str(b))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(b.read_text())
    assert res["config"]["engine"] == "llamacpp" and res["metrics"]["completed"] == 8
    ran = res["engine"]["info"]["argv"]
    assert Path(ran[0]).name == "llama-server" and res["engine"]["info"]["startup_s"] > 0
    assert ran[ran.index("-np") + 1] == "2" and ran[ran.index("-ctk") + 1] == "q8_0"
    assert ran[ran.index("-t") + 1] == "1" and ran[ran.index("-ub") + 1] == "128"  # the server accepted them
    h = res["engine"]["harness_check"]  # the client's TTFT cannot be shorter than the server's own prompt time
    assert h["n"] == 8 and h["ttft_minus_server_prompt_ms_p50"] >= 0, h
    e = tmp_path / "e.json"
    proc = run_tuner("export", "--config", str(b), "--to", "llamacpp", "-o", str(e))
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(e.read_text())
    assert exported["argv"][1:] == ran[1:]  # the same flags and files; only the binary's location differs
    assert not [n for n in exported["notes"] if "approximated" in n or "dropped" in n]
    b2, log = tmp_path / "b2.json", tmp_path / "server.log"
    proc = run_tuner("bench", "--config", str(e), *SMALL, "--json", str(b2), "--server-log", str(log))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(b2.read_text())["engine"]["info"]["argv"] == ran
    assert "listening on http://127.0.0.1:" in log.read_text(errors="replace")  # the server's own output, kept
    assert servers() == []


def test_kv_fraction_maps_monotonically_to_context_tokens():
    """Knob -> effect: a larger KV fraction gives the server more KV tokens (-c), as the server reports them. The
    fractions resolve above -c's floor (256 a slot) on any host with 6 GiB or more available (23,040 bytes a KV token
    here): 0.0005 and 0.001 resolved to the floor alike once a host had under 17.7 GB available (2026-12-07)."""
    import urllib.request

    from tuner.engines.llamacpp import LlamaCppEngine

    seen = []
    for kv in (0.002, 0.004, 0.008):
        e = LlamaCppEngine(TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=2, kv_fraction=kv))
        e.start()
        try:
            with urllib.request.urlopen(e.server.url + "/props", timeout=10) as r:
                props = json.loads(r.read())
        finally:
            e.stop()
        n_ctx = props["default_generation_settings"]["n_ctx"]  # per slot, as the server resolved it
        seen.append((e.ctx_tokens, n_ctx))
    assert [c for c, _ in seen] == sorted({c for c, _ in seen}), seen
    assert [n for _, n in seen] == sorted({n for _, n in seen}), seen


def test_a_server_that_dies_mid_run_fails_its_requests_with_the_reason():
    from tuner.engines.llamacpp import LlamaCppEngine
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import WorkloadSpec, build_workload, with_arrivals
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    tok = load_tokenizer(checkpoint_dir(MODEL))
    reqs = with_arrivals(build_workload(WorkloadSpec(requests=6, rate=None, concurrency=2, input_len=(16, 32),
                                                     output_len=(200, 200)), tok), None, "poisson", 0)
    e = LlamaCppEngine(TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=2, kv_fraction=0.002))
    e.start()
    pid = e.server.proc.pid
    killer = __import__("threading").Timer(2.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        load = run_load(e, reqs, concurrency=2, timeout_s=120, progress=False)
    finally:
        e.stop()
    errors = [r.error for r in load.results if r.error]
    assert errors and all("server exited with code -9" in err for err in errors), errors
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_open_with_launch_runs_the_server_while_the_tokenizer_loads_and_a_failure_there_stops_it(monkeypatch):
    """`Backend.open(..., launch=True)` (what a vLLM profile uses): the server is already running when open returns
    (its start-up overlapped the tokenizer's load), `start()` waits for it and serves; and when the tokenizer's load
    fails after the launch (failure injection), open raises and the launched server is gone."""
    import tuner.quantize
    from tuner.engines.registry import backend
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import Request

    config = TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=2, kv_fraction=0.002)
    engine, model, tok = backend("llamacpp").open(config, True, launch=True)
    try:
        assert model is None and engine.server is not None and engine.server.alive()
        assert engine.client is None  # launched, not yet started
        engine.start()
        ids = tok("The capital of France is")["input_ids"]
        (r,) = run_load(engine, [Request(0, "", tuple(ids), 5, None)], concurrency=1, timeout_s=60,
                        progress=False).results
        assert r.ok and r.output_tokens == 5, r
    finally:
        engine.stop(drain=False)
    assert not engine.server.alive()

    before, launched = {p.pid for p in servers()}, []

    def failing_tokenizer(path):
        launched.extend(p.pid for p in servers() if p.pid not in before)
        raise OSError(f"tokenizer at {path} unreadable (injected)")

    monkeypatch.setattr(tuner.quantize, "load_tokenizer", failing_tokenizer)
    with pytest.raises(OSError, match="injected"):
        backend("llamacpp").open(config, True, launch=True)
    assert launched, "no llama-server was running while the tokenizer loaded"
    alive = [pid for pid in launched if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def test_a_server_that_fails_at_start_is_a_failed_run_with_its_own_last_line(tmp_path):
    """Failure injection: a llama-server that prints an error and exits (the real llama-quantize stays)."""
    from tuner.engines.llamacpp import bin_dir

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "llama-server").write_text("#!/bin/sh\necho 'main: error: unsupported model architecture: foo' >&2\n"
                                       "exit 1\n")
    (fake / "llama-server").chmod(0o755)
    (fake / "llama-quantize").symlink_to(bin_dir() / "llama-quantize")
    out, log = tmp_path / "b.json", tmp_path / "server.log"
    log.write_text("main: error: an older run's failure\n")  # an appended log: only this server's lines count
    proc = run_tuner("bench", "--engine", "llamacpp", "--model", MODEL, "--quant", "Q8_0", *SMALL, "--json",
                     str(out), "--server-log", str(log), env={"TUNER_LLAMACPP_BIN": str(fake)})
    assert proc.returncode == 1, proc.stderr
    assert "unsupported model architecture: foo" in log.read_text()
    res = json.loads(out.read_text())
    assert res["status"] == "failed"
    assert "exited with code 1 at start" in res["reason"] and "unsupported model architecture: foo" in res["reason"]


def test_ctrl_c_leaves_no_server_running(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "tuner", "bench", "--engine", "llamacpp", "--model", MODEL,
                          "--quant", "Q8_0", "--requests", "40", "--concurrency", "2", "--output-len", "200:200",
                          "--no-bandwidth", "--quiet"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not servers() and time.time() < deadline:
        time.sleep(0.2)
    assert servers(), "the server never started"
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    time.sleep(1)
    assert [s for s in servers() if s.status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.parametrize("args, needles", [
    (["--engine", "vllm-typo"], ["'vllm-typo'", "transformers, llamacpp, vllm"]),
    (["--engine", "llamacpp", "--quant", "bf16"], ["'bf16'", "Q8_0"]),
    (["--kv-type", "q8_0"], ["'q8_0'", "transformers"]),
    (["--engine", "llamacpp", "--kv-type", "q3"], ["'q3'", "q4_0"]),
    (["--engine", "llamacpp", "--draft", "early-exit:4"], ["early-exit:4", "ngram:K"]),
    (["--threads", "2"], ["threads 2 is a knob of engine llamacpp (-t, decoding threads)", "engine transformers"]),
    (["--engine", "llamacpp", "--ubatch", "-8"], ["ubatch -8 is invalid", "integer >= 0"]),
])
def test_bad_engine_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(run_tuner("bench", "--model", MODEL, *args, *SMALL), *needles)


def test_capacity_sends_every_prompt_once_so_the_prompt_cache_never_serves_it():
    """llama-server caches prompts (slot reuse and its host prompt cache): a capacity search that re-sent its
    prompts would measure cache hits, not traffic. The server's own `timings.cache_n` (prompt tokens it took from
    its cache) shows it: near zero for every request of the search, most of the prompt when the same prompts are
    sent again (the control, proving the check can see a cache hit). The canary (copies of the warm-up's first prompt, on
    purpose) is left out."""
    from tuner.engines.llamacpp import LlamaCppEngine
    from tuner.measure.capacity import CANARY_RUNS, CapacityOptions, CapacitySearch
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import WorkloadSpec, build_workload, with_arrivals
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer
    from tuner.slo import SLO, parse_slo

    opts = CapacityOptions(slo=SLO(tuple(parse_slo("ttft:p50<10s"))), probe_requests=(8, 8), max_probes=2,
                           max_requests=16, saturation_requests=8)
    tok = load_tokenizer(checkpoint_dir(MODEL))
    pool = build_workload(WorkloadSpec(requests=opts.pool_size(2), input_len=(48, 96), output_len=(4, 8)), tok)
    e = LlamaCppEngine(TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=2, kv_fraction=0.002))
    e.start()
    timings: list[dict] = []  # the server's per-request timings, read after each load (ids restart per load)
    try:
        def run(reqs, concurrency, timeout_s, should_stop=None):
            load = run_load(e, reqs, concurrency, timeout_s, should_stop, progress=False)
            done = e.request_timings()
            if len({r.prompt_ids for r in reqs}) > 1 or len(reqs) == 1:  # not the canary's copies of one prompt
                timings.extend(done[f"r{r.index}"] for r in reqs)
            return load

        search = CapacitySearch(run, pool, 2, opts)
        cap = search.search()
        searched = list(timings)
        # the control: the prompt the slots hold last (the canary's, sent after the last probe) sent again, alone --
        # the server serves it from its slot's cache (the host prompt cache is off, `--cache-ram 0`, so an older
        # prompt has nothing left to be served from)
        run(with_arrivals([pool[0]], None, "poisson", 0), 2, 120)
        again = timings[len(searched):]
    finally:
        e.stop(drain=False)
    assert cap["cost"]["requests"] - len(cap["canary"]["at"]) * CANARY_RUNS == search.cursor == len(searched) <= len(pool)
    assert not any("repeat" in n for n in cap["notes"])
    # a request cut off by a probe's early stop or time limit ends without the server's timings: it is not a
    # measurement of the cache either way, but most of the search's requests must have finished
    finished = [t for t in searched if "cache_n" in t]
    assert len(finished) >= len(searched) // 2, (len(finished), len(searched))
    reused = [t["cache_n"] / (t["cache_n"] + t["prompt_n"]) for t in finished]
    assert max(reused) < 0.2, sorted(reused)[-5:]
    assert len(again) == 1 and all("cache_n" in t for t in again)
    assert min(t["cache_n"] / (t["cache_n"] + t["prompt_n"]) for t in again) > 0.5
