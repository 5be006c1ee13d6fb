"""A real neighbour on the host for tests of what the tool sees of one: processes spinning a CPU each, outside this
process's tree (started through a shell that exits at once, so they are not this process's descendants)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

SPIN = "while True: pass"


def spinners() -> int:
    """A quarter of the host's CPUs, one at least: a neighbour of 25-50% of the host, whatever its width."""
    return max(1, (os.cpu_count() or 1) // 4)


@contextlib.contextmanager
def neighbour(n: int | None = None) -> Iterator[Callable[[], None]]:
    """`n` (default `spinners()`) orphaned processes spinning a CPU each while the block runs; the value yielded
    stops them earlier."""
    n = n or spinners()
    cmd = "; ".join([f"{sys.executable} -c '{SPIN}' >/dev/null 2>&1 </dev/null & echo $!"] * n)
    pids = [int(p) for p in subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True)
            .stdout.split()]

    def stop() -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    try:
        yield stop
    finally:
        stop()
