"""Confirm the pick: re-measure the recommended configuration once more after the last trial.

The best of N noisy measurements is biased upward (the winner's curse): the trial that wins is, among near-equal
configurations, the one whose measurement happened to run high. A fresh measurement of the winner, made after the
search with nothing selected on it, is an unbiased figure of what the user will get; it is the one the answer
reports. When the re-measured figure falls below another feasible trial's, that trial is re-measured too (up to
`max_measures`), so the pick is made on confirmed figures wherever the ranking depends on them.

Confirmations are a study user attribute (tuner.study.CONFIRMED: trial number -> {capacity, metrics, wall_s}), so
every worker, the dashboard and `tuner export` see them; the trial's own figure stays on the trial.
"""

from __future__ import annotations

import time
from typing import Any

from tuner.config import TrialConfig
from tuner.objective import SearchContext, measure
from tuner.stats import INDETERMINATE
from tuner.study import CONFIRMED, Row, rows_from_study


def next_to_confirm(rows: list[Row]) -> Row | None:
    """The feasible row ranked first (confirmed figures where they exist), if it is not confirmed yet."""
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -r.rps)
    if not feasible or feasible[0].trial_capacity is not None:
        return None
    return feasible[0]


def confirm_best(study: Any, ctx: SearchContext, max_measures: int, log: Any = print) -> None:
    """Re-measure the pick (and, if it drops below another, that one) the way its trial was measured."""
    for k in range(1, max_measures + 1):
        row = next_to_confirm(rows_from_study(study))
        if row is None:
            return
        log(f"confirming trial {row.number} ({row.rps:.3g} req/s in its trial): re-measuring it after the search")
        t0 = time.monotonic()
        bench = measure(TrialConfig.from_dict(row.config), ctx,
                        ctx.study_dir / "trials" / f"{row.number:04d}" / f"confirm-{k}")
        metrics = dict(bench.get("metrics") or {})
        capacity = metrics.pop("capacity", None) if bench.get("status") == "ok" else None
        if capacity is None:  # a re-measure that fails says the pick cannot be reproduced: no rate was shown to
            # meet the SLO (verdict indeterminate, capacity 0), so it ranks last; why is in `failed`
            reason = bench.get("reason") or "the re-measurement wrote no result"
            capacity = {"requests_per_s": 0.0, "requests_per_s_ci": [0.0, 0.0], "verdict": INDETERMINATE,
                        "failed": reason, "notes": [f"re-measure failed: {reason}"]}
        confirmed = dict(study.user_attrs.get(CONFIRMED) or {})
        confirmed[str(row.number)] = {"capacity": capacity, "metrics": metrics, "wall_s": time.monotonic() - t0}
        study.set_user_attr(CONFIRMED, confirmed)
        log(f"trial {row.number} re-measured: {capacity.get('requests_per_s') or 0:.3g} req/s")
