"""Run one piece of heavy work (a bench, a quality score) in a child process with a time limit.

Whatever happens to the child (an exception, an out-of-memory kill, a segfault, a hang) comes back as data: a
return code and a one-line reason. The child is `python -m tuner.child --job FILE`, FILE a bench or eval job
(tuner.job) that it runs with the library functions `tuner bench` and `tuner eval` call (tuner.measure.run,
tuner.quality.run), writing the same result JSON and printing the same report into its log (tuner.measure.report,
tuner.quality.report); it never parses command-line text nor imports tuner.cli. Before it imports anything heavy it

  * asks the kernel to SIGKILL it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere a watchdog thread
    polls the parent pid), so a `kill -9` of `tuner search` leaves no orphan behind;
  * applies the trial's memory limit, if any, as `RLIMIT_AS` (address space), so a configuration that needs more
    memory than it is given fails inside the child (MemoryError, "can't allocate memory") instead of pushing the
    machine into the kernel's OOM killer;
  * turns SIGTERM into KeyboardInterrupt, so `finally` blocks and temp-file clean-ups run when it is stopped;
  * writes no core file when it crashes.

The child runs in its own session (process group). On timeout, Ctrl-C or any exception in the parent, the group is
sent SIGTERM, then SIGKILL after a short grace period, and reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MEMORY_ENV = "TUNER_CHILD_MEMORY_BYTES"  # address-space limit applied by the child at start
PARENT_ENV = "TUNER_CHILD_PARENT_PID"  # the pid the child must outlive no longer than
TERM_GRACE_S = 3.0  # SIGTERM -> SIGKILL
PR_SET_PDEATHSIG = 1

# Words in a child's log that say it ran out of memory (Python, torch's allocator, C++, OpenMP, glibc threads).
_OOM_MARKERS = ("memoryerror", "can't allocate memory", "cannot allocate memory", "out of memory", "bad_alloc",
                "unable to allocate", "failed to allocate", "can't start new thread", "resource temporarily "
                "unavailable", "mmap failed", "std::length_error")


@dataclass(frozen=True)
class ChildResult:
    returncode: int | None  # None: killed on timeout
    wall_s: float
    reason: str | None  # one line when the child did not succeed
    log_path: str


@dataclass
class Limits:
    """Defaults for every child started by this process (set once by `tuner search`)."""

    memory_bytes: int | None = None


limits = Limits()


def set_memory_limit(memory_bytes: int | None) -> None:
    """Limit the address space of every child started from now on (None: no limit)."""
    limits.memory_bytes = int(memory_bytes) if memory_bytes else None


def format_gb(n: int) -> str:
    return f"{n / 2**30:g} GB"


def describe_exit(code: int | None, timeout_s: float, last_line: str, memory_bytes: int | None = None,
                  log_text: str = "") -> str:
    """One line for a child that did not exit 0."""
    if code is None:
        return f"timed out after {timeout_s:g} s (trial time limit)" + (f"; last output: {last_line}" if last_line
                                                                         else "")
    oom = memory_bytes is not None and any(m in log_text.lower() for m in _OOM_MARKERS)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if oom:
            return f"out of memory (trial memory limit {format_gb(memory_bytes)}): killed by {name}" + (
                f"; last output: {last_line}" if last_line else "")
        hint = " (out of memory, or killed from outside)" if name == "SIGKILL" else \
            " (crashed)" if name in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE") else ""
        return f"killed by {name}{hint}" + (f"; last output: {last_line}" if last_line else "")
    if oom:
        return f"out of memory (trial memory limit {format_gb(memory_bytes)}): {last_line or f'exit code {code}'}"
    return last_line or f"exited with code {code}"


def last_meaningful_line(text: str) -> str:
    """The last error-looking line of a log (or its last line), trimmed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        low = ln.lower()
        if "error" in low or "memory" in low or ln.startswith(("Traceback", "Fatal Python error", "terminate called")):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def child_env(env: dict[str, str] | None, memory_bytes: int | None) -> dict[str, str]:
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), PARENT_ENV: str(os.getpid())}
    full.pop(MEMORY_ENV, None)
    if memory_bytes:
        full[MEMORY_ENV] = str(int(memory_bytes))
    return full


def run_child(job_path: Path, log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
              memory_bytes: int | None = None) -> ChildResult:
    """`python -m tuner.child --job <job_path>` (a job written with `tuner.job.write_job`) in a new session;
    stdout+stderr go to `log_path`. `memory_bytes` defaults to the limit set with `set_memory_limit`."""
    mem = memory_bytes if memory_bytes is not None else limits.memory_bytes
    return run_process([sys.executable, "-m", "tuner.child", "--job", str(job_path)], log_path, timeout_s,
                       child_env(env, mem), mem)


def run_process(argv: list[str], log_path: Path, timeout_s: float, env: dict[str, str],
                memory_bytes: int | None = None) -> ChildResult:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = None
        except BaseException:  # Ctrl-C or a crash of the parent: take the child down too
            stop_group(proc)
            raise
        finally:
            kill_leftovers(proc)
    wall = time.perf_counter() - t
    reason = None
    if code != 0:
        tail = log_path.read_text(errors="replace")[-20000:]
        reason = describe_exit(code, timeout_s, last_meaningful_line(tail), memory_bytes, tail)
    return ChildResult(code, wall, reason, str(log_path))


def stop_group(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # a second Ctrl-C during the grace period: no more waiting
        kill_group(proc)
        raise
    kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_leftovers(proc: subprocess.Popen) -> None:
    """Whatever the child started in its process group and left running dies with it."""
    if proc.returncode is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------------------- in the child --- #
def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (Linux: PR_SET_PDEATHSIG; elsewhere a polling thread). On Linux the
    signal follows the parent *thread* that started the child: call `run_child` from a thread that outlives it
    (the search calls it from its main thread)."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(137)
    if armed:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def limit_memory(memory_bytes: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        memory_bytes = min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def no_core_dumps() -> None:
    """A crashing trial (SIGSEGV, SIGABRT) must not leave a multi-GB core file in the working directory."""
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ValueError, OSError):
        pass


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def run_job(path: str) -> int:
    """Read the job in `path` and run it; a bad job or a user error is one line and exit 2, as the command line
    reports them (`tuner bench: error: ...`: the trial's failure reason)."""
    from tuner.errors import TunerError
    from tuner.job import BenchJob, read_job
    from tuner.quiet import quiet_libraries

    quiet_libraries()
    try:
        job = read_job(path)
    except TunerError as e:
        print(f"tuner.child: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        if isinstance(job, BenchJob):
            from tuner.measure.run import run_bench_job

            return run_bench_job(job)
        from tuner.quality.run import run_eval_job

        return run_eval_job(job)
    except TunerError as e:
        print(f"tuner {job.kind}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"tuner {job.kind}: interrupted", file=sys.stderr)
        return 130


def child_main(argv: list[str]) -> int:
    parent = os.environ.pop(PARENT_ENV, None)
    if parent and parent.isdigit():
        die_with_parent(int(parent))
    mem = os.environ.pop(MEMORY_ENV, None)
    if mem and mem.isdigit():
        limit_memory(int(mem))
    no_core_dumps()
    signal.signal(signal.SIGTERM, _terminate)
    if len(argv) != 2 or argv[0] != "--job":
        print(f"tuner.child: error: arguments {' '.join(argv)!r} are invalid: expected --job FILE (a job written by "
              "tuner.job)", file=sys.stderr)
        return 2
    return run_job(argv[1])


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
