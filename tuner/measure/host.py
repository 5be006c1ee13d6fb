"""The host's other load while a measurement runs: how much of its CPUs went to processes outside this one's tree
(another job, a neighbour on a shared machine) and to the hypervisor (steal: another tenant of the physical host).

A capacity moves with the speed of the engine that served it, and a busy host slows the engine: the canary (tuner.
capacity) sees a neighbour that came or went during a measurement, but not one present from its start to its end.
The CPU accounting sees both: `snapshot()` reads the host's CPU times (`/proc/stat` through psutil) and the CPU
time of this process and every descendant (the engine's server and its workers); `host_load(before, after)` is the
share of the host's CPU capacity the others and the hypervisor took in between. (On a GPU host this says what
competed with the engine's CPU side: the scheduler, tokenizer and HTTP server.)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

HOST_BUSY = 0.10  # others + steal, as a share of the host's CPU capacity, worth saying (a quiet host: <= 0.03)


@dataclass(frozen=True)
class Snapshot:
    t: float  # time.monotonic()
    busy_s: float  # the host's CPUs busy outside the idle loop (user, nice, system, irq, softirq), summed
    steal_s: float  # time the hypervisor gave the host's virtual CPUs to someone else
    own_s: dict[int, float]  # CPU time (user + system) per process of this one's tree, by pid


def own_tree_cpu() -> dict[int, float]:
    """CPU seconds so far of this process (with its children that ended and were waited for) and of each of its
    living descendants, by pid."""
    import psutil

    me = psutil.Process()
    out: dict[int, float] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system + (t.children_user + t.children_system if p is me else 0.0)
        except psutil.Error:  # it ended between the listing and the reading
            continue
    return out


def snapshot() -> Snapshot:
    import psutil

    c = psutil.cpu_times()
    busy = c.user + c.nice + c.system + getattr(c, "irq", 0.0) + getattr(c, "softirq", 0.0)
    return Snapshot(time.monotonic(), busy, getattr(c, "steal", 0.0), own_tree_cpu())


def host_load(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """Shares of the host's CPU capacity (wall time x CPUs) between two snapshots: `others_share` went to processes
    outside this tree, `steal_share` to the hypervisor, `own_share` to this tree (the harness and the engine).
    A descendant that ended in between without being waited for by this process takes its CPU time with it
    (counted as the others'): the shares are for windows in which the engine keeps running. Shares are clipped at 0
    (the host's counters tick at 10 ms, the processes' more finely)."""
    cpus = os.cpu_count() or 1
    capacity_s = max(after.t - before.t, 1e-9) * cpus
    own = sum(max(s - before.own_s.get(pid, 0.0), 0.0) for pid, s in after.own_s.items())
    others = after.busy_s - before.busy_s - own
    return {"cpus": cpus, "wall_s": after.t - before.t,
            "own_share": min(own / capacity_s, 1.0),
            "others_share": max(others / capacity_s, 0.0),
            "steal_share": max((after.steal_s - before.steal_s) / capacity_s, 0.0)}


def busy_share(load: dict[str, Any]) -> float:
    """What the engine did not get of the host: the others' share plus the hypervisor's."""
    return load["others_share"] + load["steal_share"]


def load_by_step(marks: list[tuple[str, Snapshot]], notes: list[str]) -> dict[str, Any]:
    """The host's other load over a measurement from its `marks` ((step that ended, snapshot) in order, the first
    the start): the whole measurement's shares, each step's, and the busiest step; a note when the others and the
    hypervisor together took more than `HOST_BUSY` of the host during a step."""
    steps = [dict(host_load(a, b), step=name) for (_, a), (name, b) in zip(marks, marks[1:])]
    if not steps:
        return {}
    whole = host_load(marks[0][1], marks[-1][1])
    keep = ("step", "others_share", "steal_share")
    worst = max(steps, key=busy_share)
    out = {"cpus": whole["cpus"], "others_share": whole["others_share"], "steal_share": whole["steal_share"],
           "own_share": whole["own_share"], "busiest": {k: worst[k] for k in keep},
           "steps": [{k: s[k] for k in keep} for s in steps]}
    if busy_share(worst) > HOST_BUSY:
        notes.append(f"the host was busy during {worst['step']}: other processes took {worst['others_share']:.0%} "
                     f"of its {whole['cpus']} CPUs, the hypervisor {worst['steal_share']:.0%} (over the whole "
                     f"measurement {whole['others_share']:.0%} and {whole['steal_share']:.0%}): the capacity is this "
                     "host's under that load, and a re-measure on a quieter host may differ")
    return out
