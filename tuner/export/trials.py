"""Read one trial of an Optuna study (written by `tuner search`) for export.

Contract with the search: a COMPLETE trial carries user_attrs `config` (TrialConfig.to_dict()), `metrics` (the bench
metrics) and `engine` ({"name", "versions", "device"}); the study carries user_attr `recommended_trial` once the
search has a recommendation. Nothing is written: a missing SQLite file is an error, not a new database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.search.answer import remeasure_of
from tuner.search.storage import DEFAULT_STORAGE


@dataclass(frozen=True)
class TrialRecord:
    study: str
    number: int
    config: TrialConfig
    engine: dict[str, Any] | None
    metrics: dict[str, Any] | None
    workload: dict[str, Any] | None = None  # the load the figures were measured under


def open_study(name: str, storage: str) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not re.match(r"^[a-z][a-z0-9+]*://", storage or ""):
        raise TunerError(f"storage {storage!r} is invalid: expected an Optuna storage URL such as {DEFAULT_STORAGE}")
    if storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///"):])
        if not path.is_file():
            raise TunerError(f"storage {storage!r}: no such database file {str(path)!r} (run `tuner search` first "
                             "or pass --storage)")
    from tuner.search.storage import open_storage

    rdb = open_storage(storage, create=False)
    try:
        return optuna.load_study(study_name=name, storage=rdb)
    except KeyError:
        names = sorted(s.study_name for s in optuna.get_all_study_summaries(rdb, include_best_trial=False))
        known = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "") if names else "none"
        raise TunerError(f"no study {name!r} in {storage} (studies there: {known})") from None


def load_trial(study_name: str, storage: str = DEFAULT_STORAGE, number: int | None = None,
               best: bool = False) -> TrialRecord:
    """Trial `number`, or the search's recommendation when `best`; one-line TunerError for anything unusable."""
    study = open_study(study_name, storage)
    if best:
        rec = study.user_attrs.get("recommended_trial")
        if rec is None:
            raise TunerError(f"study {study_name!r} has no recommendation (no feasible trial yet, or the search has "
                             "not finished): pass --trial N")
        number = int(rec)
    if number is None:
        raise TunerError("give --trial N or --best")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if number not in trials:
        last = max(trials) if trials else None
        span = f"trials 0..{last}" if last is not None else "no trials"
        raise TunerError(f"study {study_name!r} has no trial {number} ({span})")
    trial = trials[number]
    if trial.state.name != "COMPLETE":
        reason = trial.user_attrs.get("reason")
        why = f" ({str(reason).splitlines()[0][:160]})" if reason else ""
        raise TunerError(f"trial {number} of study {study_name!r} is {trial.state.name}{why}: only COMPLETE trials "
                         "can be exported")
    config = trial.user_attrs.get("config")
    if not isinstance(config, dict):
        raise TunerError(f"trial {number} of study {study_name!r} has no 'config' attribute: it was not written by "
                         "`tuner search` and cannot be exported")
    engine = trial.user_attrs.get("engine")
    metrics = trial.user_attrs.get("metrics")
    capacity = trial.user_attrs.get("capacity")
    again = remeasure_of(study, number)  # re-measured after the search: the figure the answer reports
    if again:
        metrics = again.get("metrics") or metrics
        capacity = {**again["capacity"], "in_trial_requests_per_s": (capacity or {}).get("requests_per_s")}
    if isinstance(metrics, dict) and isinstance(capacity, dict):  # the measure the search ranked it by, with its SLO
        metrics = {**metrics, "capacity": capacity}
    workload = trial.user_attrs.get("workload")
    return TrialRecord(study_name, number, TrialConfig.from_dict(dict(config)),
                       engine if isinstance(engine, dict) else None, metrics if isinstance(metrics, dict) else None,
                       workload if isinstance(workload, dict) else None)
