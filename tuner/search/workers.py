"""The workers of a study and the trials they leave behind.

Each worker tags the trials it runs with `worker_tag()` (host:pid:start-time). A worker that dies mid-trial
(`kill -9`, a lost machine) leaves a RUNNING trial that the next worker marks FAIL with a reason
(`fail_dead_trials`): at once when the dead worker ran on this host (its pid is gone), else when its heartbeat is
older than the grace period (RDB storages, `TUNER_HEARTBEAT_S`). Such a trial, like one stopped by Ctrl-C, is
`interrupted`: it says nothing about its configuration.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from tuner.search.optuna_private import stale_trial_ids, storage_of, trial_id


def worker_tag() -> str:
    """host:pid:start-time of this process (the start time tells a reused pid apart)."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{int(psutil.Process().create_time())}"


def local_worker_gone(tag: Any) -> bool:
    """True when `tag` names a process of this host that no longer exists."""
    import psutil

    try:
        host, pid, started = str(tag).rsplit(":", 2)
        pid_i, started_i = int(pid), int(started)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    try:
        return int(psutil.Process(pid_i).create_time()) != started_i
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def interrupted(trial: Any) -> bool:
    """A FAIL trial stopped from outside (its worker died or lost its heartbeat, Ctrl-C or SIGTERM to the search):
    says nothing about its configuration, which may be proposed again. Every other failure is the configuration's."""
    return trial.state.name == "FAIL" and str(trial.user_attrs.get("reason") or "").startswith("interrupted")


def fail_trial(study: Any, trial: Any, reason: str) -> None:
    """Mark a RUNNING trial (not ours) FAIL with a reason."""
    from optuna.trial import TrialState

    storage = storage_of(study)
    storage.set_trial_user_attr(trial_id(trial), "reason", reason)
    storage.set_trial_state_values(trial_id(trial), TrialState.FAIL)


def fail_dead_trials(study: Any) -> list[int]:
    """Mark FAIL (with a reason) the RUNNING trials whose worker is gone: on this host at once (pid check), on any
    host once its heartbeat is older than the grace period. Returns the trial numbers failed."""
    import optuna
    from optuna.trial import TrialState

    stale, grace = stale_trial_ids(study)
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if local_worker_gone(worker):
            why = f"interrupted: its worker {worker} died during the trial (process gone)"
        elif trial_id(t) in stale:
            why = (f"interrupted: no heartbeat from its worker {worker or '(unknown)'} for over {grace} s "
                   "(worker killed or lost)")
        else:
            continue
        try:
            fail_trial(study, t, why)
            failed.append(t.number)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # finished (or failed by another worker) in the meantime
    return failed


def warn_same_host(study: Any, device: str) -> None:
    """Two workers on one host and device share its cores (or GPU): each one's measurements slow the other's, so
    capacities are understated and noisy. Said once, on stderr, when another live worker of this study runs here."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    others = {t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    others = {w for w in others if w and str(w).startswith(host + ":") and not local_worker_gone(w)}
    if others:
        print(f"warning: another worker of study {study.study_name!r} is running on this host ({sorted(others)[0]}): "
              f"trials on the same {device} share its cores and measure each other's load; run one worker per "
              "machine for figures you will rely on", file=sys.stderr)
