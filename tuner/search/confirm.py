"""Confirm the pick: re-measure the recommended configuration once more after the last trial.

The best of N noisy measurements is biased upward (the winner's curse): the trial that wins is, among near-equal
configurations, the one whose measurement happened to run high. A fresh measurement of the winner, made after the
search with nothing selected on it, is an unbiased figure of what the user will get; it is the one the answer
reports. The re-measure is judged the way its trial was (tuner.search.objective.slo_constraints: every SLO term at the
re-measure's capacity point, "SLO shown to hold"; the quality term is the weights', which a re-measure does not
change) and its cost is the re-measure's: a pick whose re-measure meets the SLO at no rate (capacity 0, verdict
misses or indeterminate) is infeasible and not recommended on its trial's figure. When the re-measured pick falls
below another feasible trial (or out of the feasible set), that trial is re-measured too, up to `max_measures`;
when the budget is spent with the first-ranked trial not re-measured, no configuration is confirmed (said).

Confirmations are a study user attribute (tuner.search.answer.CONFIRMED: trial number -> {capacity, metrics, constraints,
cost_per_million_tokens, wall_s}), so every worker, the dashboard and `tuner export` see them; the trial's own
figure stays on the trial.
"""

from __future__ import annotations

import time
from typing import Any

from tuner.config import TrialConfig
from tuner.search.answer import CONFIRMED, Row, rows_from_study, why_not
from tuner.search.objective import SearchContext, cost_per_million, measure, slo_constraints
from tuner.stats import INDETERMINATE


def next_to_confirm(rows: list[Row]) -> Row | None:
    """The feasible row ranked first (confirmed figures where they exist), if it is not confirmed yet."""
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -r.rps)
    if not feasible or feasible[0].trial_capacity is not None:
        return None
    return feasible[0]


def rejudge(row: Row, capacity: dict[str, Any], ctx: SearchContext) -> list[float]:
    """The trial's constraints with its SLO terms judged on the re-measure; the quality term (the weights') kept."""
    slo = slo_constraints(capacity, ctx)
    return slo + list((row.constraints or [])[len(slo):])


def confirm_best(study: Any, ctx: SearchContext, max_measures: int, log: Any = print) -> None:
    """Re-measure the pick (and, if it drops below another or out of the feasible set, the next) the way its trial
    was measured, and judge each on its re-measure."""
    failed: list[int] = []
    k = 0
    for k in range(1, max_measures + 1):
        row = next_to_confirm(rows_from_study(study))
        if row is None:
            break
        log(f"confirming trial {row.number} ({row.rps:.3g} req/s in its trial): re-measuring it after the search")
        t0 = time.monotonic()
        plan = next((t.user_attrs.get("capacity_plan") for t in study.get_trials(deepcopy=False)
                     if t.number == row.number), None)  # --strategy predict's tail verification: at its figure
        where = ctx.study_dir / "trials" / f"{row.number:04d}" / f"confirm-{k}"
        bench = (measure(TrialConfig.from_dict(row.config), ctx, where, dict(plan, start_rps=row.rps))
                 if plan and row.rps > 0 else measure(TrialConfig.from_dict(row.config), ctx, where))
        metrics = dict(bench.get("metrics") or {})
        capacity = metrics.pop("capacity", None) if bench.get("status") == "ok" else None
        if capacity is None:  # a re-measure that fails says the pick cannot be reproduced: no rate was shown to
            # meet the SLO (verdict indeterminate, capacity 0), so it is infeasible; why is in `failed`
            reason = bench.get("reason") or "the re-measurement wrote no result"
            capacity = {"requests_per_s": 0.0, "requests_per_s_ci": [0.0, 0.0], "verdict": INDETERMINATE,
                        "failed": reason, "notes": [f"re-measure failed: {reason}"]}
        constraints = rejudge(row, capacity, ctx)
        confirmed = dict(study.user_attrs.get(CONFIRMED) or {})
        confirmed[str(row.number)] = {
            "capacity": capacity, "metrics": metrics, "constraints": constraints,
            "cost_per_million_tokens": cost_per_million(capacity.get("output_tokens_per_s"), ctx.cost_per_hour),
            "wall_s": time.monotonic() - t0}
        study.set_user_attr(CONFIRMED, confirmed)
        rps = float(capacity.get("requests_per_s") or 0.0)
        if all(c <= 0 for c in constraints):
            log(f"trial {row.number} re-measured: {rps:.3g} req/s within the SLO")
        else:
            failed.append(row.number)
            log(f"trial {row.number} re-measured: {why_not(capacity)}: not recommended on its trial's figure"
                + ("; re-measuring the next candidate" if k < max_measures else ""))
    rows = rows_from_study(study)
    left = next_to_confirm(rows)
    if left is not None and k == max_measures:
        log(f"no configuration confirmed: the --confirm budget ({max_measures}) is spent and trial {left.number}, "
            "now ranked first, was not re-measured")
    elif failed and not any(r.feasible for r in rows):
        log("no configuration confirmed: no feasible trial is left after its re-measure")
