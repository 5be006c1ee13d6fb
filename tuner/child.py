"""Run one piece of heavy work (a bench, a quality score) in a child process with a time limit.

Whatever happens to the child (an exception, an out-of-memory kill, a segfault, a hang) comes back as data: a
return code and a one-line reason. The child runs in its own process group, which is killed on timeout and on
Ctrl-C, so no orphan survives the parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChildResult:
    returncode: int | None  # None: killed on timeout
    wall_s: float
    reason: str | None  # one line when the child did not succeed
    log_path: str


def describe_exit(code: int | None, timeout_s: float, last_line: str) -> str:
    if code is None:
        return f"timed out after {timeout_s:.0f} s (trial time limit)"
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory?)" if name == "SIGKILL" else " (crashed)" if name in ("SIGSEGV", "SIGABRT", "SIGBUS") else ""
        return f"killed by {name}{hint}" + (f"; last output: {last_line}" if last_line else "")
    return last_line or f"exited with code {code}"


def last_meaningful_line(text: str) -> str:
    """The last error-looking line of a log (or its last line), trimmed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or ln.startswith(("Traceback", "RuntimeError", "ValueError")):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def run_child(args: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
    """`python -m tuner <args>` in a new session; stdout+stderr go to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tuner", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            code = None
        except BaseException:  # Ctrl-C or a crash of the parent: take the child down too
            kill_group(proc)
            raise
    wall = time.perf_counter() - t
    reason = None
    if code != 0:
        tail = log_path.read_text(errors="replace")[-20000:]
        reason = describe_exit(code, timeout_s, last_meaningful_line(tail))
    return ChildResult(code, wall, reason, str(log_path))


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
