from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
