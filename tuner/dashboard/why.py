"""Why this one: `tuner.search.answer.answer` over the trials so far (the recommendation, its gain over the baseline,
the binding constraint, runners-up; or the closest miss), the constraint table, and Optuna's fANOVA parameter
importances. A study from before the capacity measure keeps the recommendation its search stored."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.dashboard.curves import LEGACY_NOTE, capacity_summary, pct
from tuner.dashboard.study import StudyInfo, TrialView, has_capacity, state_name
from tuner.dashboard.views import first_line
from tuner.search.answer import answer


def study_answer(views: Sequence[TrialView], info: StudyInfo) -> dict[str, Any] | None:
    """`tuner.search.answer.answer` over the trials so far. None when the study was not written by `tuner search`, or
    predates the capacity measure (the answer is now computed from capacities: an older study keeps the
    recommendation its search stored)."""
    if not info.from_search or not has_capacity(views):
        return None
    baseline = next((v.number for v in views if v.baseline), 0)
    return answer([v.row for v in views], list(info.constraint_names), baseline_number=baseline)


def latency_at(v: TrialView, info: StudyInfo) -> float | None:
    """The study's latency metric in the trial's metrics (at its capacity point), ms."""
    if not info.latency_field:
        return None
    key, stat = info.latency_field.split(".")
    return pct(v.row.metrics, key, stat)


def recommended_number(ans: Mapping[str, Any] | None, info: StudyInfo) -> int | None:
    """The recommendation computed from the trials so far, else the one the search stored."""
    if ans and ans.get("recommendation"):
        return int(ans["recommendation"]["trial"])
    return info.recommended_trial


def constraint_table(names: Sequence[str], values: Sequence[float] | None) -> list[dict[str, Any]]:
    """Each constraint with its value (<= 0 satisfied) and slack."""
    out = []
    for n, c in zip(names, values or []):
        ok = c <= 0
        out.append({"constraint": n, "value": c if math.isfinite(c) else None, "satisfied": ok,
                    "slack": -c if math.isfinite(c) else None})
    return out


def param_importances(trials: Sequence[Any], directions: Sequence[Any] | None = None, min_trials: int = 3,
                      seed: int = 0) -> dict[str, dict[str, Any]]:
    """Optuna's fANOVA parameter importances for each objective over the COMPLETE trials with finite values:
    capacity and quality in a study measured by capacity (2 objectives), throughput and latency in an older
    study (3 objectives: tok/s, latency, quality). Returns {target: {"importances": {param: share}} or
    {"message": why not}}; never raises (too few trials, a constant search space... are messages)."""

    import optuna

    n_obj = len(directions) if directions else max((len(t.values) for t in trials
                                                    if getattr(t, "values", None)), default=3)
    targets = importance_targets(n_obj)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" lines
    try:
        return _importances(trials, targets, directions, min_trials, seed)
    finally:
        optuna.logging.set_verbosity(verbosity)


def importance_targets(n_objectives: int) -> dict[str, int]:
    """Label -> objective index of the importances shown for a study with that many objectives."""
    return {"capacity": 0, "quality": 1} if n_objectives == 2 else {"throughput": 0, "latency": 1}


def _importances(trials: Sequence[Any], targets: Mapping[str, int], directions: Sequence[Any] | None,
                 min_trials: int, seed: int) -> dict[str, dict[str, Any]]:
    import warnings

    import optuna

    done = [t for t in trials if state_name(t) == "COMPLETE" and t.values is not None
            and len(t.values) > max(targets.values())]
    out: dict[str, dict[str, Any]] = {}
    for label, i in targets.items():
        usable = [t for t in done if math.isfinite(t.values[i])]
        if len(usable) < min_trials:
            out[label] = {"message": f"needs at least {min_trials} completed trials with a {label} value "
                                     f"(has {len(usable)})"}
            continue
        try:
            n = len(usable[0].values)
            study = optuna.create_study(directions=list(directions) if directions else
                                        ["maximize"] * 2 if n == 2 else ["maximize", "minimize", "maximize"][:n])
            study.add_trials(usable)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imp = optuna.importance.get_param_importances(
                    study, target=lambda t, i=i: t.values[i],
                    evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed))
        except Exception as e:  # optuna raises ValueError/RuntimeError for degenerate inputs
            msg = first_line(str(e), 200) or type(e).__name__
            out[label] = {"message": f"cannot be computed yet: {msg}"}
            continue
        imp = {k: float(v) for k, v in imp.items() if math.isfinite(v)}
        if not imp:
            out[label] = {"message": "cannot be computed yet: no parameter varies across the completed trials"}
        else:
            out[label] = {"importances": imp}
    return out


def why(views: Sequence[TrialView], info: StudyInfo) -> dict[str, Any]:
    """The answer of `tuner.search.answer.answer` (the recommendation, its gain over the baseline, the binding
    constraint, runners-up; or the closest miss), the constraint table of the recommended (or closest) trial, and the
    recommendation's and the baseline's capacity summaries (`capacity`). A study from before the capacity measure
    gets `legacy` (a note), its stored recommendation and that trial's constraints: its answer is not recomputed."""
    if not info.from_search:
        return {"message": "this study was not written by `tuner search` (no SLO or constraint names in its "
                           "attributes): no recommendation"}
    by_number = {v.number: v for v in views}
    if not has_capacity(views):
        best = by_number.get(info.recommended_trial) if info.recommended_trial is not None else None
        return {"legacy": LEGACY_NOTE + " Its recommendation is the one its search stored (the feasible trial with "
                                        "the highest output tok/s); it is not recomputed.",
                "recommended": best.number if best else None,
                "constraints": constraint_table(info.constraint_names, best.row.constraints) if best else []}
    ans = study_answer(views, info) or {}
    out: dict[str, Any] = {"answer": ans}
    rec = ans.get("recommendation")
    if rec and rec.get("trial") in by_number:
        best = by_number[rec["trial"]]
        out["constraints"] = constraint_table(info.constraint_names, best.row.constraints)
        base = by_number.get((ans.get("baseline") or {}).get("trial"))
        out["capacity"] = {"recommended": capacity_summary(best.capacity),
                           "baseline": capacity_summary(base.capacity) if base else None}
    elif (ans.get("closest") or {}).get("trial") in by_number:
        c = by_number[ans["closest"]["trial"]]
        out["constraints"] = constraint_table(info.constraint_names, c.row.constraints)
    return out
