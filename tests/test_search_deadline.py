"""`--timeout` near its end: no trial starts that the time left cannot hold, and the pick's re-measure after the
search starts only when it fits; otherwise the answer says the figure is its trial's own (a real Optuna study on
SQLite, trials recorded as a search records them)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import optuna

from tuner.search.loop import confirm_pick, past_deadline, remeasure_s
from tuner.search.storage import StorageLock


def study_with_one_trial(url: str, child_wall_s: float) -> optuna.Study:
    study = optuna.create_study(storage=url, study_name="s", directions=["maximize"])
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"worker": "me", "child_wall_s": child_wall_s}))
    return study


def test_a_pick_whose_re_measure_would_outlast_the_timeout_is_not_re_measured(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    since = datetime.datetime.now() - datetime.timedelta(hours=1)
    study = study_with_one_trial(url, child_wall_s=365.0)
    trials = study.get_trials(deepcopy=False)
    assert remeasure_s(trials, "me", since) == 365.0
    assert remeasure_s(trials, "another worker", since) == 0.0
    ctx = SimpleNamespace(confirm=2)  # confirm_pick reads only this before it would measure
    lock = StorageLock(url)
    try:
        confirm_pick(study, ctx, lock, "me", True, left_s=70.0, since=since, timeout="15m")
    finally:
        lock.close()
    why = study.user_attrs["confirm_skipped"]
    assert why == "--timeout 15m: 70 s left, a re-measure takes ~365 s (its trial's measurement)"
    assert "the pick is not re-measured" in capsys.readouterr().err
    assert "confirmed" not in study.user_attrs  # nothing was measured


def test_no_new_trial_when_the_time_left_cannot_hold_one_and_its_re_measures(tmp_path) -> None:
    since = datetime.datetime.now() - datetime.timedelta(hours=1)
    study = study_with_one_trial(f"sqlite:///{tmp_path / 'study.db'}", child_wall_s=300.0)
    trials = study.get_trials(deepcopy=False)
    assert past_deadline(trials, "me", since, confirm=0, left_s=600.0) is None
    assert past_deadline(trials, "me", since, confirm=2, left_s=600.0).startswith("no new trial: 600 s left")
