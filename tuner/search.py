"""Run (or resume) an Optuna study over the four knobs and write its answer.

Study: three objectives (output tok/s max, primary latency min, quality max) with constraints, a seeded TPE
sampler, the engine-default baseline enqueued as trial 0, heartbeats so a killed worker's trial is marked failed,
and a trial budget that counts the whole study (re-running the same command resumes up to the budget).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tuner.errors import TunerError
from tuner.objective import SearchContext, TrialFailed, constraint_names, objective
from tuner.study import answer, open_storage, rows_from_study, trials_csv

STUDY_KEYS = ("model", "primary", "bounds", "device")


def study_attrs(ctx: SearchContext) -> dict[str, Any]:
    return {"model": ctx.model, "primary": str(ctx.primary), "bounds": [str(b) for b in ctx.bounds],
            "device": ctx.device, "constraint_names": constraint_names(ctx), "space": ctx.space.path,
            "max_quality_drop": ctx.max_quality_drop, "workload": ctx.workload.to_dict(),
            "quality": {"tasks": list(ctx.quality_tasks), "limit": ctx.quality_limit,
                        "scored": ctx.score_quality},
            "latency_metric": ctx.primary.key, "latency_target_ms": ctx.primary.limit_ms}


def make_sampler(seed: int, n_trials: int) -> Any:
    """Seeded multivariate TPE; constraints come from each trial's `set_constraint`; constant liar so parallel
    workers do not pick the same config while one is running."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(3, n_trials // 3)),
                                      multivariate=True, group=True, constant_liar=True)


def open_study(ctx: SearchContext, storage_url: str, name: str, seed: int, n_trials: int) -> Any:
    import optuna

    storage = open_storage(storage_url)
    sampler = make_sampler(seed, n_trials)
    try:
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, load_if_exists=True,
                                    directions=["maximize", "minimize", "maximize"])
    except ValueError as e:
        raise TunerError(f"study {name!r} cannot be opened: {e}") from None
    attrs = study_attrs(ctx)
    old = study.user_attrs
    if old:
        for key in STUDY_KEYS:
            if key in old and old[key] != attrs[key]:
                raise TunerError(f"study {name!r} already exists with {key}={old[key]!r} (this run: {attrs[key]!r}): "
                                 "expected the same settings to resume, or a new --study name")
    else:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
    if not study.trials:
        study.enqueue_trial(dict(ctx.space.baseline), user_attrs={"baseline": True})
    return study


def run_search(ctx: SearchContext, storage_url: str, name: str, n_trials: int, timeout: str | None, seed: int,
               progress: bool = True) -> dict[str, Any]:
    import warnings

    import optuna
    from tqdm import tqdm

    from tuner.targets import parse_duration_s

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("optuna").setLevel(logging.ERROR)
    study = open_study(ctx, storage_url, name, seed, n_trials)
    ctx.study_dir.mkdir(parents=True, exist_ok=True)
    # quality already measured in this study (per format) is reused, not re-scored
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        q, c = t.user_attrs.get("quality"), t.user_attrs.get("config") or {}
        if q and c.get("quant") and "score" in q:
            ctx.quality_memo.setdefault(c["quant"], q)
    done_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    finished = len(study.get_trials(deepcopy=False, states=done_states))
    remaining = max(0, n_trials - finished)
    bar = tqdm(total=n_trials, initial=finished, desc="trials", unit="trial", disable=not progress)

    def on_trial(study: Any, trial: Any) -> None:
        bar.update(1)
        feas = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if all(c <= 0 for c in t.user_attrs.get("constraints", [1]))]
        best = max((t.values[0] for t in feas), default=None)
        state = trial.state.name.lower()
        reason = trial.user_attrs.get("reason")
        bar.set_postfix_str(f"last {state}" + (f" ({reason[:40]})" if reason else "") +
                            (f", best feasible {best:.2f} tok/s" if best is not None else ", none feasible yet"))

    callbacks = [on_trial, optuna.study.MaxTrialsCallback(n_trials, states=None)]
    t0 = time.time()
    try:
        if remaining:
            study.optimize(lambda t: objective(t, ctx), n_trials=remaining,
                           timeout=parse_duration_s(timeout) if timeout else None, catch=(TrialFailed,),
                           callbacks=callbacks, gc_after_trial=True)
    except KeyboardInterrupt:
        bar.close()
        write_answer(study, ctx, storage_url, time.time() - t0)  # what finished is kept and summarized
        raise
    bar.close()
    return write_answer(study, ctx, storage_url, time.time() - t0)


def write_answer(study: Any, ctx: SearchContext, storage_url: str, wall_s: float) -> dict[str, Any]:
    from tuner.cli.common import write_json_atomic

    rows = rows_from_study(study)
    baseline = next((t.number for t in study.trials if t.user_attrs.get("baseline")), 0)
    a = answer(rows, constraint_names(ctx), ctx.primary, baseline)
    if a.get("recommendation"):
        study.set_user_attr("recommended_trial", a["recommendation"]["trial"])
    ctx.study_dir.mkdir(parents=True, exist_ok=True)
    csv_path = ctx.study_dir / "trials.csv"
    tmp = csv_path.with_suffix(".csv.tmp")
    tmp.write_text(trials_csv(rows))
    tmp.replace(csv_path)
    rec_path = ctx.study_dir / "recommendation.json"
    write_json_atomic(rec_path, {"study": study.study_name, "storage": storage_url, **a})
    return {"study": study.study_name, "storage": storage_url, "answer": a, "csv": str(csv_path),
            "recommendation_path": str(rec_path), "wall_s": wall_s}


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())
