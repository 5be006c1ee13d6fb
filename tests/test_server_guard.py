"""The guard beside every server tuner launches (tuner/engines/guard.py): when the tuner process dies without stopping
its server, the server's whole process group is stopped -- what the server started too, which the parent-death
signal (it reaches the server only) left running. Real processes: a stand-in server (Python) that starts a child in
its group, as vLLM's API server starts its engine core and workers, launched by a real ServerProcess in a launcher
process that is then killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tuner.engines import guard

# a "server" that starts one child in its own process group and then sleeps (never healthy: it is not waited for)
SERVER = ("import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
LAUNCHER = """
import sys, time
from tuner.engines.server import ServerProcess
s = ServerProcess([sys.executable, '-c', {server!r}], port=int(sys.argv[1]), log_path=None)
s.launch()
if sys.argv[2] == "unguarded":  # the guard taken out: the parent-death signal alone
    s._guard.kill()
    s._guard.wait()
print(s.proc.pid, flush=True)
time.sleep(600)
"""


def launch(guarded: bool) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A launcher process holding a ServerProcess (guarded: as tuner launches; else with its guard killed), and the
    stand-in server's processes once its child is up."""
    from tests.conftest import free_port

    p = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(server=SERVER), str(free_port()),
                          "guarded" if guarded else "unguarded"], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).parent.parent)
    server = psutil.Process(int(p.stdout.readline()))
    deadline = time.time() + 30
    while time.time() < deadline and not server.children():
        time.sleep(0.05)
    return p, [server, *server.children()]


def alive(procs: list[psutil.Process]) -> list[int]:
    return [q.pid for q in procs if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_launcher_leaves_nothing_of_its_server():
    p, procs = launch(guarded=True)
    assert len(procs) == 2 and {os.getpgid(q.pid) for q in procs} == {procs[0].pid}  # the server's own group
    p.kill()
    p.wait()
    deadline = time.time() + 15
    while alive(procs) and time.time() < deadline:
        time.sleep(0.1)
    assert alive(procs) == []


def test_without_the_guard_the_servers_child_outlives_the_launcher():
    """The control: the same launcher with its guard killed (the parent-death signal alone) leaves the server's
    child running -- the check above can see an orphan."""
    p, procs = launch(guarded=False)
    try:
        p.kill()
        p.wait()
        time.sleep(3)
        assert alive(procs) == [procs[1].pid]  # the server died with its parent; its child did not
    finally:
        for q in procs:
            try:
                q.kill()
            except psutil.Error:
                pass


def test_a_group_number_that_is_another_process_s_now_is_left_alone():
    """Once the server's group number belongs to another process (its start time differs from the server's), none of
    its processes is the server's: the guard signals nothing."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = guard.stat(other.pid)[1]
        assert guard.members(other.pid, started) == [other.pid]
        guard.stop_group(other.pid, started - 1, 0.0)  # a server that started before this process
        time.sleep(0.2)
        assert other.poll() is None
        guard.stop_group(other.pid, started, 0.0)
        assert other.wait(timeout=10) == -signal.SIGTERM
    finally:
        other.kill()
        other.wait()
