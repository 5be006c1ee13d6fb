"""A serving engine's own process, shared by every server engine: launch an argv on a free local port, wait for its
health endpoint, keep its output in a log, stop it (and everything it started).

No orphan survives the tuner: the server runs in a process group of its own, which everything it starts joins (vLLM's
engine core and workers), with a guard beside it (tuner/engines/guard.py, run as a script in a session of its own,
blocked on a pipe only this tuner process holds open); `stop()` terminates the server, then kills it and whatever is
left of its group, then ends the guard. When the tuner dies without stopping it (SIGKILL, an out-of-memory kill, a SIGTERM to a
process that does not catch it) the kernel closes the pipe, and the guard terminates the server's group, then kills
it. The server is also asked to die with its parent (Linux `PR_SET_PDEATHSIG`), which alone left vLLM's engine core
and workers running when the tuner was killed while vLLM started (3 processes, ~5 GB, still there 20 s later).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

from tuner.errors import TunerError


class ServerFailed(RuntimeError):
    """The server did not start or died; the message is one line ending with the server's own last error line."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


GUARD_GRACE_S = 5.0  # the guard's SIGTERM -> SIGKILL (tuner.engines.guard)


def last_error_line(lines: list[str]) -> str:
    """The line of a server log that best says why it failed: the last one naming an error, else the last line."""
    for line in reversed(lines):
        low = line.lower()
        if any(w in low for w in ("error", "failed", "invalid", "unknown", "cannot", "abort")):
            return line.strip()
    return lines[-1].strip() if lines else "no output"


class ServerProcess:
    """`argv` launched as is (the caller puts host and port in it); `health_path` answered 200 means ready."""

    def __init__(self, argv: list[str], port: int, health_path: str = "/health", log_path: Path | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 300.0) -> None:
        self.argv, self.port, self.health_path = list(argv), port, health_path
        self.log_path, self.env = log_path, env
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.last_lines: list[str] = []
        self._log_file: Any = None
        self._owned_log = False  # a temporary log made here is removed at stop (its last lines are read before)
        self._log_start = 0  # where this server's output begins in a shared (appended) log
        self._t0 = 0.0  # when it was launched (perf_counter)
        self._guard: subprocess.Popen | None = None  # stops the server's group if this process dies (guard.py)
        self._leader_start = -1  # the server's start time (clock ticks since boot): its group is known by it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 20) -> list[str]:
        if self.log_path is None or not self.log_path.is_file():
            return self.last_lines[-n:]
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_start)
            return [ln.rstrip("\n") for ln in deque(f, maxlen=n)]

    def start(self) -> float:
        """Launch and wait until healthy; returns the start-up seconds. Raises ServerFailed (one line)."""
        self.launch()
        return self.wait()

    def launch(self) -> None:
        """Start the process and return at once (`wait` waits for its health)."""
        if not Path(self.argv[0]).is_file():
            raise TunerError(f"server binary {self.argv[0]!r} does not exist: expected a built binary (make llamacpp)")
        if port_in_use(self.port):
            raise ServerFailed(f"port {self.port} is already in use: expected a free port")
        if self.log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix="tuner-server.", suffix=".log")
            os.close(fd)
            self.log_path, self._owned_log = Path(name), True
        self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.seek(0, os.SEEK_END)
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
                                     preexec_fn=_die_with_parent, start_new_session=True)
        from tuner.engines import guard

        self._leader_start = (guard.stat(self.proc.pid) or (0, -1, ""))[1]
        try:  # its own session too: a kill of the tuner's process group leaves it to do its work
            self._guard = subprocess.Popen([sys.executable, "-S", guard.__file__, str(self.proc.pid),
                                            str(self._leader_start), str(GUARD_GRACE_S)],
                                           stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            self.stop()
            raise

    def wait(self) -> float:
        """Wait until the launched process answers its health path; the seconds since its launch. Raises
        ServerFailed (one line) when it exits first or is not healthy within `startup_timeout_s` of its launch."""
        if self.proc is None:
            raise ServerFailed(f"{Path(self.argv[0]).name} was not launched: expected launch() before wait()")
        t0 = self._t0
        deadline = t0 + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._close_log()
                raise ServerFailed(f"{Path(self.argv[0]).name} exited with code {code} at start: "
                                   f"{last_error_line(self.tail())}")
            if self._healthy():
                self.startup_s = time.perf_counter() - t0
                return self.startup_s
            if time.perf_counter() > deadline:
                self.stop()
                raise ServerFailed(f"{Path(self.argv[0]).name} not healthy after {self.startup_timeout_s:g}s: "
                                   f"{last_error_line(self.tail())}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def death_reason(self) -> str | None:
        """None while running; else one line with the exit code and the server's last error line."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"server exited with code {self.proc.returncode}: {last_error_line(self.tail())}"

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; idempotent. Keeps `last_lines` of the log."""
        from tuner.engines.guard import stop_group

        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:  # not stopping (vLLM stopped while it starts): its whole group at once
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.wait(timeout=10)
        if proc is not None:  # what it started (vLLM: its engine core and workers) stops with it, or is killed
            stop_group(proc.pid, self._leader_start, grace_s, terminate=False)
        self._end_guard()
        self._close_log()
        if self._owned_log and self.log_path is not None:
            self.last_lines = self.tail()
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._owned_log = None, False

    def _end_guard(self) -> None:
        """The server is stopped: the guard is killed before its pipe closes (it must not signal a group id that
        could be another's by then)."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        guard.kill()
        guard.wait(timeout=10)
        try:
            guard.stdin.close()
        except OSError:
            pass

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
