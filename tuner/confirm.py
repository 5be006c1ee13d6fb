"""Confirm the pick: re-measure the recommended configuration once more after the last trial.

The best of N noisy measurements is biased upward (the winner's curse): the trial that wins is, among near-equal
configurations, the one whose measurement happened to run high. A fresh measurement of the winner, made after the
search with nothing selected on it, is an unbiased figure of what the user will get; it is the one the answer
reports. When the re-measured figure falls below another feasible trial's, that trial is re-measured too (up to
`max_measures`), so the pick is made on confirmed figures wherever the ranking depends on them.

Confirmations are study user attributes (`confirmed`: trial number -> {capacity, metrics, wall_s}), so every worker
and `tuner export` see them; the trial's own figure stays on the trial.
"""

from __future__ import annotations

import time
from typing import Any

from tuner.config import TrialConfig
from tuner.objective import SearchContext, measure
from tuner.study import Row, rows_from_study

CONFIRMED = "confirmed"


def next_to_confirm(rows: list[Row]) -> Row | None:
    """The feasible row ranked first (confirmed figures where they exist), if it is not confirmed yet."""
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -r.rps)
    if not feasible or feasible[0].trial_capacity is not None:
        return None
    return feasible[0]


def confirm_best(study: Any, ctx: SearchContext, max_measures: int, log: Any = print) -> list[dict[str, Any]]:
    """Re-measure the pick (and, if it drops below another, that one) in the study's own way. Returns what was done
    (one entry per measurement: trial, figure in its trial, confirmed figure or the failure reason)."""
    done: list[dict[str, Any]] = []
    for _ in range(max_measures):
        row = next_to_confirm(rows_from_study(study))
        if row is None:
            break
        log(f"confirming trial {row.number} ({row.rps:.3g} req/s in its trial): re-measuring it after the search")
        trial_dir = ctx.study_dir / "trials" / f"{row.number:04d}" / f"confirm-{len(done) + 1}"
        t0 = time.monotonic()
        bench = measure(TrialConfig.from_dict(row.config), ctx, trial_dir)
        capacity = (bench.get("metrics") or {}).get("capacity") if bench.get("status") == "ok" else None
        entry: dict[str, Any] = {"trial": row.number, "in_trial_requests_per_s": row.rps,
                                 "wall_s": time.monotonic() - t0}
        if capacity is None:  # a re-measure that fails says the pick cannot be reproduced: it ranks last
            reason = bench.get("reason") or "the re-measurement wrote no result"
            capacity = {"requests_per_s": 0.0, "requests_per_s_ci": [0.0, 0.0], "verdict": "failed",
                        "notes": [f"re-measure failed: {reason}"]}
            entry["reason"] = reason
        metrics = {k: v for k, v in (bench.get("metrics") or {}).items() if k != "capacity"}
        entry["confirmed_requests_per_s"] = capacity.get("requests_per_s")
        confirmed = dict(study.user_attrs.get(CONFIRMED) or {})
        confirmed[str(row.number)] = {"capacity": capacity, "metrics": metrics, "wall_s": entry["wall_s"]}
        study.set_user_attr(CONFIRMED, confirmed)
        log(f"trial {row.number} re-measured: {entry['confirmed_requests_per_s'] or 0:.3g} req/s")
        done.append(entry)
    return done
