"""tuner.measure.host on this machine's real CPU accounting: whose CPU time is whose."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.neighbour import neighbour, spinners
from tuner.measure.host import HOST_BUSY, busy_share, host_load, load_by_step, snapshot


def spin(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass


def window(work) -> dict:
    before = snapshot()
    work()
    return host_load(before, snapshot())


def test_a_neighbour_outside_this_tree_is_the_others_and_the_engine_inside_it_is_not():
    """Three 2 s windows: this process spinning a CPU (the in-process engine), a child process spinning one (a
    server engine, alive across the window), and a neighbour outside this process's tree spinning `spinners()`
    CPUs. The first two are this tree's share and not the others'; the neighbour is the others' and not this
    tree's (each ~ CPUs spun / the host's CPUs)."""
    cpus = os.cpu_count() or 1
    own = window(lambda: spin(2.0))
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic()\n"
                              "while time.monotonic() - t < 30: pass"])
    try:
        time.sleep(0.5)  # its interpreter started
        kid = window(lambda: time.sleep(2.0))
    finally:
        child.kill()
        child.wait()
    with neighbour():
        time.sleep(0.5)
        other = window(lambda: time.sleep(2.0))
    one_cpu = 1 / cpus
    assert own["own_share"] > 0.7 * one_cpu and own["others_share"] < 0.5 * one_cpu
    assert kid["own_share"] > 0.7 * one_cpu and kid["others_share"] < 0.5 * one_cpu
    assert other["others_share"] > 0.7 * spinners() * one_cpu and other["own_share"] < 0.3 * one_cpu
    assert busy_share(other) > HOST_BUSY


def test_the_busiest_step_is_named_and_said():
    """`load_by_step` over marks: a quiet step, a step with a neighbour, a quiet step -> the neighbour's step is the
    busiest, the note names it; quiet steps alone give no note."""
    notes: list[str] = []
    marks = [("", snapshot())]
    time.sleep(1.0)
    marks.append(("the warm-up", snapshot()))
    with neighbour():
        time.sleep(1.5)
        marks.append(("the saturation probe", snapshot()))
    time.sleep(1.0)
    marks.append(("the last canary", snapshot()))
    host = load_by_step(marks, notes)
    assert [s["step"] for s in host["steps"]] == ["the warm-up", "the saturation probe", "the last canary"]
    assert host["busiest"]["step"] == "the saturation probe"
    assert len(notes) == 1 and notes[0].startswith("the host was busy during the saturation probe")
    quiet_notes: list[str] = []
    load_by_step([marks[0], marks[1]], quiet_notes)
    assert quiet_notes == []
