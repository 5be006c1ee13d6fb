"""Run (or resume, or join) an Optuna study over the four knobs and write its answer.

Study: two objectives (capacity in req/s within the SLO -> max, quality -> max) with normalised constraints, a
seeded TPE sampler, the engine-default baseline enqueued as trial 0 and measured the same way, and a trial budget
that counts the whole study. Resuming or joining a study with any study-defining setting different (workload,
space, SLO, quality budget, tasks, limit, capacity settings) is refused.

Reliability contract:
  * every trial's heavy work runs in a child process (`tuner.child`); whatever goes wrong in a trial (the child
    crashing, running out of its memory, hanging past its time limit, an exception anywhere in the objective)
    ends that trial as FAIL (or PRUNED) with a one-line `reason` user attr, and the search goes on;
  * a worker that dies mid-trial (`kill -9`, a lost machine) leaves a RUNNING trial that the next worker marks
    FAIL with a reason: at once when the dead worker ran on this host (its pid is gone), else when its heartbeat
    is older than the grace period (RDB storages, `TUNER_HEARTBEAT_S`; tuner.search.workers);
  * several workers (`tuner search` / `tuner worker` on the same --study and --storage) share the budget: a
    storage-wide lock (a file lock next to a SQLite or journal file, a PostgreSQL advisory lock) is held while a
    worker counts the study's trials, creates its trial and samples its configuration, so N workers together
    create exactly --trials trials, the baseline is enqueued once, and no two workers sample while blind to each
    other (TPE's constant liar sees every running trial's parameters). The sampler's random state is re-seeded from
    (seed, trial number), so resumed runs and parallel workers never replay the same random draws
    (tuner.search.storage.StorageLock, tuner.search.samplers).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import signal
import sys
import time
from typing import Any

from tuner.errors import TunerError, one_line
from tuner.search.answer import answer, rows_from_study, trials_csv
from tuner.search.objective import SearchContext, TrialFailed, constraint_names, objective, quality_key
from tuner.search.samplers import make_sampler
from tuner.search.storage import StorageLock, open_storage
from tuner.search.workers import fail_dead_trials, local_worker_gone, warn_same_host, worker_tag

DIRECTIONS = ["maximize", "maximize"]  # capacity (req/s within the SLO), quality score


def study_attrs(ctx: SearchContext) -> dict[str, Any]:
    p = ctx.primary
    return {"settings": ctx.settings(), "model": ctx.model, "device": ctx.device, "slo": ctx.slo.to_dict(),
            "primary": str(p) if p else None, "bounds": [str(b) for b in ctx.slo.bounds],
            "constraint_names": constraint_names(ctx), "space": ctx.space.path,
            "max_quality_drop": ctx.max_quality_drop, "workload": ctx.workload.to_dict(),
            "quality": {"tasks": list(ctx.quality_tasks), "limit": ctx.quality_limit, "scored": ctx.score_quality},
            "latency_metric": p.key if p else None, "latency_target_ms": p.limit_ms if p else None,
            "objectives": ["capacity_requests_per_s", "quality_score"]}


def settings_differ(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> str | None:
    """The first study-defining setting that differs, as 'key: old -> new' (None when all equal)."""
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = settings_differ(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}={a!r} (this run: {b!r})"
    return None


# --------------------------------------------------------------------------------------- study, trials --- #
def open_study(ctx: SearchContext, storage_url: str, name: str, seed: int, n_trials: int,
               join: bool = False, start: bool = True) -> Any:
    """Create or load the study (call with the storage lock held). `join`: the study must exist already. `start`:
    enqueue a new study's start-up trials (`--strategy predict` enqueues its own, the baseline first)."""
    import optuna

    storage = open_storage(storage_url, create=not join, read_only=False)
    sampler = make_sampler(seed, ctx.space)
    if join and name not in optuna.study.get_all_study_names(storage):
        raise TunerError(f"study {name!r} does not exist in {storage_url}: start it with `tuner search --study "
                         f"{name} --storage ...` (a worker only joins an existing study)")
    try:
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, load_if_exists=True,
                                    directions=DIRECTIONS)
    except ValueError as e:
        raise TunerError(f"study {name!r} cannot be opened: {e}") from None
    if [d.name.lower() for d in study.directions] != DIRECTIONS:
        raise TunerError(f"study {name!r} was made by another version of tuner (objectives "
                         f"{[d.name.lower() for d in study.directions]}): expected a new --study name")
    attrs = study_attrs(ctx)
    old = study.user_attrs
    if old:
        diff = settings_differ(old.get("settings") or {}, attrs["settings"])
        if diff:
            raise TunerError(f"study {name!r} already exists with {diff}: expected the same settings to resume "
                             "or join, or a new --study name")
    else:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
    if start and not study.get_trials(deepcopy=False):
        enqueue_start(study, ctx.space, seed, n_trials)
    return study


def enqueue_start(study: Any, space: Any, seed: int, n_trials: int) -> None:
    """A new study's first trials: the engine default (the baseline), every other engine's default in a study
    across engines, then the format sweep at the top of the increasing knobs (tuner.search.space.startup_sweep) when the
    whole sweep fits in half of the trials left (a short search, like `make demo`'s 8 trials on 6 formats, has none:
    a format that serves slowly at the top batch cap takes a whole capacity budget)."""
    from tuner.search.space import startup_sweep

    study.enqueue_trial(dict(space.baseline), user_attrs={"baseline": True})
    for other in space.engines[1:]:  # across engines: every engine's default is measured first
        study.enqueue_trial({"engine": other.engine, **{f"{other.engine}.{k}": other.baseline[k]
                                                         for k in other.knobs}},
                            user_attrs={"engine_default": True})
    defaults = max(1, len(space.engines))
    sweep = startup_sweep(space, seed, n_trials)
    if len(sweep) <= (n_trials - defaults) // 2:  # a sweep cut short is a random start-up that costs more
        for params in sweep:
            study.enqueue_trial(params, user_attrs={"startup": "format sweep"})


def memory_note(reason: str, memory_bytes: int | None) -> str:
    """Say so when a failure is the trial's memory limit at work."""
    from tuner.child import _OOM_MARKERS, format_gb

    if memory_bytes and "trial memory limit" not in reason and any(m in reason.lower() for m in _OOM_MARKERS):
        return f"out of memory (trial memory limit {format_gb(memory_bytes)}): {reason}"
    return reason


def guarded_objective(trial: Any, ctx: SearchContext, memory_bytes: int | None,
                      sample: Any = None) -> Any:
    """`objective` (after `sample`, the configuration's sampling), with every way a trial can go wrong turned into
    FAIL/PRUNED plus a one-line `reason`."""
    import optuna

    try:
        if sample is not None:
            sample()
        return objective(trial, ctx)
    except optuna.TrialPruned:
        raise
    except TrialFailed as e:
        reason = trial.user_attrs.get("reason") or str(e) or "trial failed"
        fixed = memory_note(reason, memory_bytes)
        if fixed != reason or not trial.user_attrs.get("reason"):
            trial.set_user_attr("reason", fixed)
        raise TrialFailed(fixed) from None
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            trial.set_user_attr("reason", "interrupted (Ctrl-C or SIGTERM to the search)")
        raise
    except Exception as e:  # a bug or a storage hiccup in the objective: this trial fails, the search goes on
        reason = f"trial crashed in the search process: {one_line(e)}"
        logging.getLogger("tuner").debug("trial %s crashed", trial.number, exc_info=True)
        trial.set_user_attr("reason", reason)
        raise TrialFailed(reason) from None


@contextlib.contextmanager
def sigterm_as_interrupt() -> Any:
    """SIGTERM to the search behaves like Ctrl-C: the running child is stopped, what finished is summarized."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_search(ctx: SearchContext, storage_url: str, name: str, n_trials: int, timeout: str | None, seed: int,
               progress: bool = True, join: bool = False, trial_memory_bytes: int | None = None,
               strategy: Any = None, said: dict[str, Any] | None = None) -> dict[str, Any]:
    """`strategy` (tuner.predict.strategy.PredictStrategy, `--strategy predict`) chooses each trial's configuration
    and when to stop; None: Optuna's sampler does (`--strategy measure`). `said`: added to the answer as is (the
    strategy that ran and why, tuner.cli.search.choose_strategy)."""
    import warnings

    import optuna
    from tqdm import tqdm

    from tuner.child import set_memory_limit
    from tuner.search.space import suggest_config
    from tuner.slo import parse_duration_s

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("optuna").setLevel(logging.ERROR)
    set_memory_limit(trial_memory_bytes)
    deadline = time.monotonic() + parse_duration_s(timeout) if timeout else None
    lock = StorageLock(storage_url)
    try:
        with lock:
            study = open_study(ctx, storage_url, name, seed, n_trials, join=join, start=strategy is None)
    except BaseException:
        lock.close(remove_if_created=True)
        raise
    done_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    me = worker_tag()
    warn_same_host(study, ctx.device)
    t0 = time.time()
    run_start = datetime.datetime.now()
    bar = None
    try:
        with sigterm_as_interrupt():
            ctx.study_dir.mkdir(parents=True, exist_ok=True)
            if strategy is not None:  # predict every configuration first (profiles what the time affords)
                strategy.prepare(ctx, None if deadline is None else deadline - time.monotonic())
            bar = tqdm(total=n_trials, initial=len(study.get_trials(deepcopy=False, states=done_states)),
                       desc="trials", unit="trial", disable=not progress)

            def on_trial(study: Any, trial: Any) -> None:
                bar.n = min(n_trials, len(study.get_trials(deepcopy=False, states=done_states)))
                feas = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                        if all(c <= 0 for c in t.user_attrs.get("constraints", [1]))]
                best = max((t.values[0] for t in feas), default=None)
                state = trial.state.name.lower()
                reason = trial.user_attrs.get("reason")
                bar.set_postfix_str(f"last {state}" + (f" ({reason[:40]})" if reason else "") +
                                    (f", best feasible {best:.3f} req/s" if best is not None else
                                     ", none feasible yet"))

            def func(trial: Any) -> Any:
                # with the lock held (taken before the trial was created): tag it and sample its configuration,
                # so the next worker's sampler sees this trial's parameters; a sampling error fails this trial
                def sample() -> None:
                    try:
                        trial.set_user_attr("worker", me)
                        suggest_config(trial, ctx.space, ctx.model, ctx.device)
                    finally:
                        lock.release()

                return guarded_objective(trial, ctx, trial_memory_bytes, sample)

            while deadline is None or time.monotonic() < deadline:
                with lock:
                    fail_dead_trials(study)
                    trials = study.get_trials(deepcopy=False)
                    # the budget counts every trial started (RUNNING ones of other workers included); a WAITING
                    # (enqueued) trial becomes the next trial started, it adds none
                    if sum(t.state != optuna.trial.TrialState.WAITING for t in trials) >= n_trials:
                        break
                    remember_quality(ctx, trials)
                    if deadline is not None:
                        late = past_deadline(trials, me, run_start, ctx.confirm, deadline - time.monotonic())
                        if late:
                            if progress:
                                print(f"\ntuner search: --timeout {timeout}: {late}", file=sys.stderr)
                            break
                    if strategy is not None and not strategy.enqueue_next(study, ctx.space):
                        if progress:
                            print(f"\ntuner search: --strategy predict stops: {strategy.stopped}", file=sys.stderr)
                        break
                    try:
                        study.optimize(func, n_trials=1, catch=(TrialFailed,), callbacks=[on_trial],
                                       gc_after_trial=True)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        pass  # our trial was failed by another worker (missed heartbeats): go on
            bar.close()
            left_s = None if deadline is None else deadline - time.monotonic()
            confirm_pick(study, ctx, lock, me, progress, left_s, run_start, timeout)
    except KeyboardInterrupt:
        lock.release()
        if bar is not None:
            bar.close()
        with contextlib.suppress(Exception), lock:  # what finished is kept and summarized
            fail_dead_trials(study)
            write_answer(study, ctx, storage_url, time.time() - t0, strategy, said)
        lock.close()
        raise
    except BaseException:
        lock.close()
        raise
    bar.close()
    try:
        with lock:
            return write_answer(study, ctx, storage_url, time.time() - t0, strategy, said)
    finally:
        lock.close()


def past_deadline(trials: list[Any], me: str, since: Any, confirm: int, left_s: float) -> str | None:
    """Why no trial should start with `left_s` seconds of `--timeout` left, or None: the next trial is expected to
    take as long as the longest this worker ran in this run, and the re-measures of the pick (`--confirm`) as long as
    the longest capacity measurement; before any trial finished, one starts while time is left."""
    mine = [t for t in trials if t.user_attrs.get("worker") == me and t.datetime_start and t.datetime_complete
            and t.datetime_start >= since]
    trial_s = max(((t.datetime_complete - t.datetime_start).total_seconds() for t in mine), default=0.0)
    confirm_s = confirm * remeasure_s(mine, me, since)
    if left_s > trial_s + confirm_s:
        return None
    what = f"the longest trial took {trial_s:.0f} s" + (f", re-measuring the pick ~{confirm_s:.0f} s" if confirm_s
                                                       else "")
    return f"no new trial: {max(left_s, 0.0):.0f} s left ({what})"


def remeasure_s(trials: list[Any], me: str, since: Any) -> float:
    """What one re-measure of the pick is expected to take: the longest capacity measurement (child) this worker
    ran in this run."""
    return max((float(t.user_attrs.get("child_wall_s") or 0.0) for t in trials
                if t.user_attrs.get("worker") == me and t.datetime_start and t.datetime_start >= since), default=0.0)


def confirm_pick(study: Any, ctx: SearchContext, lock: StorageLock, me: str, progress: bool,
                 left_s: float | None = None, since: Any = None, timeout: str | None = None) -> None:
    """Re-measure the pick after the last trial (tuner.search.confirm), by one worker, when no trial is running: a
    measurement beside another trial on the same machine would not be the figure the user gets. With `left_s` of
    --timeout left and less than one re-measure's expected time, none starts: the answer says the figure is the
    trial's own (study attribute `confirm_skipped`)."""
    if ctx.confirm <= 0:
        return
    if left_s is not None:
        need = remeasure_s(study.get_trials(deepcopy=False), me, since)
        if left_s < need:
            why = (f"--timeout {timeout}: {max(left_s, 0.0):.0f} s left, a re-measure takes ~{need:.0f} s (its "
                   "trial's measurement)")
            if progress:
                print(f"tuner search: the pick is not re-measured: {why}", file=sys.stderr)
            with lock:
                study.set_user_attr("confirm_skipped", why)
            return
    with lock:
        study.set_user_attr("confirm_skipped", None)
    from tuner.search.confirm import confirm_best

    with lock:
        fail_dead_trials(study)
        busy = [t.number for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
        owner = study.user_attrs.get("confirming")
        if busy or (owner and owner != me and not local_worker_gone(owner)):
            return  # the worker that ends last confirms
        study.set_user_attr("confirming", me)
    try:
        confirm_best(study, ctx, ctx.confirm, log=lambda s: print(s, file=sys.stderr) if progress else None)
    finally:
        with lock:
            study.set_user_attr("confirming", None)


def remember_quality(ctx: SearchContext, trials: list[Any]) -> None:
    """Quality already measured in this study (per format, by any worker) is reused, not re-scored."""
    for t in trials:
        if t.state.name != "COMPLETE":
            continue
        q, c = t.user_attrs.get("quality"), t.user_attrs.get("config") or {}
        if q and c.get("quant") and "score" in q:
            ctx.quality_memo.setdefault(quality_key(c), q)


def write_answer(study: Any, ctx: SearchContext, storage_url: str, wall_s: float, strategy: Any = None,
                 said: dict[str, Any] | None = None) -> dict[str, Any]:
    from tuner.files import write_json_atomic, write_text_atomic

    rows = rows_from_study(study)
    baseline = next((t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("baseline")), 0)
    a = answer(rows, constraint_names(ctx), baseline, cost_per_hour=ctx.cost_per_hour,
               target_rate=ctx.target_rate)
    a["slo"] = ctx.slo.to_dict()
    a["workload"] = ctx.workload.to_dict()
    a["n_running"] = sum(r.state in ("RUNNING", "WAITING") for r in rows)
    a["confirm_skipped"] = study.user_attrs.get("confirm_skipped")
    a.update(said or {})
    if strategy is not None:
        a.update(strategy.report(study))
    if a.get("recommendation"):
        study.set_user_attr("recommended_trial", a["recommendation"]["trial"])
    ctx.study_dir.mkdir(parents=True, exist_ok=True)
    csv_path = ctx.study_dir / "trials.csv"
    write_text_atomic(csv_path, trials_csv(rows))
    rec_path = ctx.study_dir / "recommendation.json"
    write_json_atomic(rec_path, {"study": study.study_name, "storage": storage_url, **a})
    return {"study": study.study_name, "storage": storage_url, "answer": a, "csv": str(csv_path),
            "recommendation_path": str(rec_path), "wall_s": wall_s}
