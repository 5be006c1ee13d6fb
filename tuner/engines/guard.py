"""Stopping a server's process group, and the guard that does it when the tuner that launched the server dies.

A server tuner launches leads a process group of its own; what it starts joins it (vLLM's engine core and workers).
`members(group, leader_start)` are the processes of that group, read from /proc: while one of them lives the kernel
gives its number to no other process, and once the number is another process's again (its start time differs from the
leader's) none is ours. `stop_group` sends them SIGTERM, then SIGKILL to what is left after `grace_s`.

Run as a script (`python -S guard.py GROUP LEADER_START GRACE_S`, standard library only: it starts in milliseconds),
this is the guard: it reads its stdin until EOF -- the pipe only the launching tuner process holds, closed by the
kernel when that process dies however it dies -- then stops the group. The tuner kills the guard once it has stopped
the server itself (tuner.engines.server).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def stat(pid: int) -> tuple[int, int, str] | None:
    """(process group, start time in clock ticks since boot, state) of `pid` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ... starttime (22nd field)
    return int(fields[2]), int(fields[19]), fields[0].decode()


def members(group: int, leader_start: int) -> list[int]:
    """The live processes of the server's group `group` (its leader started at `leader_start`); none once the number
    is another process's."""
    leader = stat(group)
    if leader is not None and leader[1] != leader_start:
        return []
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(int(name))
            if s is not None and s[0] == group and s[2] != "Z":
                out.append(int(name))
    return out


def stop_group(group: int, leader_start: int, grace_s: float, terminate: bool = True) -> None:
    """SIGTERM to every member of the group (`terminate`; else they are left to stop on their own, as the server's
    children do once it has stopped), then SIGKILL to those left after `grace_s` seconds."""
    for sig in (signal.SIGTERM if terminate else 0, signal.SIGKILL):
        pids = members(group, leader_start)
        if not pids:
            return
        for pid in pids if sig else ():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + (grace_s if sig != signal.SIGKILL else 5.0)
        while members(group, leader_start) and time.monotonic() < end:
            time.sleep(0.1)


if __name__ == "__main__":
    sys.stdin.buffer.read()
    stop_group(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
