"""Search benchmark of `tuner search --strategy predict` (issue 26): real measurements to reach 95% of a measured
grid's best feasible capacity, 10 seeds; goal: median <= 3 (the measure loop's figure on the same grid: bench_search.py
replay).

The strategy runs as `tuner search` runs it (tuner.predict.strategy.PredictStrategy: prepare predicts every
configuration of the grid's space from this host's engine profiles -- cached, or measured once here -- then
enqueue_next chooses each configuration to measure with its own choosing rule and stop rule), on an Optuna study
whose trials are scored by the real objective's functions (tuner.search.objective.apply_quality / apply_capacity,
as bench_search.py's replay does) on the grid's **measured** capacities and quality verdicts: nothing is re-measured
and nothing is re-implemented; the seed changes the strategy's seed (its simulations' and profile order's).

The grid's workload and capacity settings (bench_search.py grid's defaults: input 32:128, output 16:32 tokens, 3
probes, 90 s) are the predictions' too; its probes of 30:45 requests are not: under today's rule they cannot show a
p90 at 95% confidence over 6 looks (53 needed), so a prediction with them is 0 everywhere; the predictions use the
probes `tuner search` sizes for the SLO (tuner.measure.capacity.probe_requests_for).
Configurations the strategy cannot predict (a draft) are never chosen; if the grid's best were one, the goal is not
reached and the run says so. Every figure printed is labelled measured (the grid's) or predicted.

Usage: .venv/bin/python benchmarks/bench_search_predict.py [--grid benchmarks/data/capacity-grid-smollm2-cpu.json]
       [--engine transformers] [--seeds 10] [--max-quality-drop 5] [--json out.json]
Needs an engine profile of --engine (tuner profile; the registry's `profiled`): one line and exit 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_search: the grid's space, key and feasibility

GRID_DEVICE = "auto"  # the grid's configurations' device (a profile is keyed by it: the same one is reused)
GRID_WORKLOAD = {"input_len": (32, 128), "output_len": (16, 32)}  # bench_search.py grid's defaults
GRID_CAPACITY = {"max_probes": 3, "capacity_timeout_s": 90.0}  # its probes (30:45) cannot show p90 under today's rule
GOAL_SHARE = 0.95
GOAL_MEDIAN = 3


def grid_space_file(data: dict[str, Any], path: Path) -> Path:
    """The grid's own configurations as a search-space file: bench_search.py's space for its grid; for a grid written
    by bench_predict_accuracy.py --write-grid (it names its workload) the quant x batch cap of its rows, baseline the
    first format at its smallest cap (the engine default of bench_search's grid: fp32 at the smallest cap)."""
    from bench_search import space_file

    if "workload" not in data:
        return space_file(path)
    knobs = [r["knobs"] for r in data["rows"]]
    quants = list(dict.fromkeys(k["quant"] for k in knobs))
    caps = sorted({k["batch_cap"] for k in knobs})
    kvs = sorted({k["kv_fraction"] for k in knobs})
    baseline = {"quant": quants[0], "batch_cap": caps[0], "draft": "none", "kv_fraction": kvs[0]}
    path.write_text("knobs:\n"
                    f"  quant: {{choices: {json.dumps(quants)}}}\n"
                    f"  batch_cap: {{choices: {json.dumps(caps)}, increasing: true}}\n"
                    f"  kv_fraction: {{choices: {json.dumps(kvs)}}}\n"
                    f"baseline: {json.dumps(baseline)}\n")
    return path


def context(data: dict[str, Any], space_path: Path, engine: str) -> Any:
    """The search's context for the grid: its space (engine set), SLO, workload and capacity settings (a grid that
    names its own, bench_predict_accuracy.py --write-grid's, is predicted with them, probe sizes included: they are
    the ones its capacities were measured with)."""
    from dataclasses import replace

    from bench_search import search_context

    from tuner.measure.workload import WorkloadSpec
    from tuner.slo import parse_duration_s

    text = space_path.read_text()
    space_path.write_text(f"engine: {engine}\n{text}")
    from tuner.measure.capacity import probe_requests_for

    ctx = search_context(data, space_path)
    if "workload" in data:
        w, c = data["workload"], data["capacity_settings"]
        return replace(ctx, device=GRID_DEVICE, workload=WorkloadSpec(
            requests=48, input_len=tuple(w["input_len"]), output_len=tuple(w["output_len"]), seed=w["seed"]),
            probe_requests=tuple(c["probe_requests"]), max_probes=c["max_probes"],
            capacity_timeout_s=parse_duration_s(c["capacity_timeout"], "capacity_timeout"))
    probes = probe_requests_for(ctx.slo, GRID_CAPACITY["max_probes"], None)
    return replace(ctx, device=GRID_DEVICE, workload=WorkloadSpec(requests=48, **GRID_WORKLOAD), probe_requests=probes,
                   **GRID_CAPACITY)


def pool_maker(ctx: Any) -> Any:
    """The capacity pool `tuner bench --capacity` builds for a configuration (tuner.cli.search's for the strategy)."""
    from tuner.cli.predict import capacity_pool
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    tokenizer = load_tokenizer(checkpoint_dir(ctx.model))
    return lambda config, options: capacity_pool(config, ctx.workload, options, tokenizer)


def replay_predict(data: dict[str, Any], ctx: Any, seed: int, pool_for: Any, band_every: bool = False
                   ) -> tuple[list[dict[str, Any]], Any]:
    """The strategy's measurement order on the grid (its own prepare, enqueue_next and stop rule) and the strategy."""
    import warnings

    import optuna
    from bench_search import MODEL, key

    from tuner.predict.strategy import PredictStrategy
    from tuner.search.loop import DIRECTIONS
    from tuner.search.objective import TrialFailed, apply_capacity, apply_quality
    from tuner.search.space import suggest_config

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    surface = {key(r["knobs"]): r for r in data["rows"]}
    strategy = PredictStrategy(pool_for, seed=seed, **({"band_every": True} if band_every else {}))
    strategy.prepare(ctx, None)
    study = optuna.create_study(directions=DIRECTIONS)
    order: list[dict[str, Any]] = []

    def objective(trial: Any) -> Any:
        config = suggest_config(trial, ctx.space, MODEL, ctx.device)
        r = surface[key(config.to_dict())]
        order.append(r)
        trial.set_user_attr("config", config.to_dict())
        apply_quality(trial, ctx, config, data["quality"][config.quant])
        if r["status"] != "ok" or not r.get("capacity"):
            raise TrialFailed(r.get("reason") or "failed")
        trial.set_user_attr("capacity", r["capacity"])
        return apply_capacity(trial, ctx, r["capacity"], data["quality"][config.quant])

    for _ in range(len(data["rows"])):
        if not strategy.enqueue_next(study, ctx.space):
            break
        study.optimize(objective, n_trials=1, catch=(TrialFailed,))
    return order, strategy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="benchmarks/data/capacity-grid-smollm2-cpu.json")
    ap.add_argument("--engine", default="transformers", help="the engine the grid was measured on")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-quality-drop", type=float, default=5.0)
    ap.add_argument("--band-every", action="store_true",
                    help="every band computed at the start (the rule before 2026-12-06), beside the default where "
                         "each is computed when the choosing rule needs it: both orders printed per seed")
    ap.add_argument("--json", help="write the per-seed figures here")
    args = ap.parse_args()
    from bench_search import feasible_capacity

    from tuner.engines.registry import backend, names, spoken

    if not backend(args.engine).profiled:
        print(f"bench_search_predict: engine {args.engine} has no engine profile yet (profiled: "
              f"{spoken(names(profiled=True))}): expected --engine with a profile and a grid measured on it",
              file=sys.stderr)
        return 2
    data = json.loads(Path(args.grid).read_text())
    data["max_quality_drop"] = args.max_quality_drop
    with tempfile.TemporaryDirectory() as d:
        ctx = context(data, grid_space_file(data, Path(d) / "space.yaml"), args.engine)
    best = max(feasible_capacity(r, data, ctx) for r in data["rows"])
    if best <= 0:
        print("no feasible configuration in the grid: nothing to reach", file=sys.stderr)
        return 1
    goal = GOAL_SHARE * best
    pool_for = pool_maker(ctx)
    runs = []
    for seed in range(args.seeds):
        t = time.perf_counter()
        order, strategy = replay_predict(data, ctx, seed, pool_for)
        wall_s = time.perf_counter() - t
        every = replay_predict(data, ctx, seed, pool_for, band_every=True)[0] if args.band_every else None
        caps = [feasible_capacity(r, data, ctx) for r in order]
        reached = next((i for i, c in enumerate(caps, 1) if c >= goal), None)
        pred = {json.dumps(p.config.get("quant")) + str(p.config.get("batch_cap")): p.rps
                for p in strategy.predictions}
        runs.append({"seed": seed, "measured_to_goal": reached, "measured": len(order), "stopped": strategy.stopped,
                     "n_predicted": len(strategy.predictions), "left_out": strategy.left_out,
                     "order": [{**r["knobs"], "measured_rps": c,
                                "predicted_rps": pred.get(json.dumps(r["knobs"]["quant"]) + str(r["knobs"]["batch_cap"]))}
                               for r, c in zip(order, caps)],
                     "wall_s": wall_s,
                     "bands": sum(getattr(p, "banded", True) for p in strategy.predictions),
                     "same_order_every_band": None if every is None else [r["knobs"] for r in every] == [
                         r["knobs"] for r in order]})
        print(f"seed {seed}: goal reached after {reached or '-'} of {len(order)} measured "
              f"({'stopped: ' + strategy.stopped if strategy.stopped else 'grid exhausted'}); "
              f"order (predicted -> measured req/s): "
              + ", ".join(f"{o['quant']} cap {o['batch_cap']}{' ' + o['draft'] if o['draft'] != 'none' else ''} "
                          f"{o['predicted_rps'] or 0:.2f}->{o['measured_rps']:.2f}" for o in runs[-1]["order"])
              + f" [{runs[-1]['wall_s']:.0f} s; {runs[-1]['bands']} of {len(strategy.predictions)} with a band"
              + ("" if every is None else "; every band at the start: "
                 + ("the same order" if runs[-1]["same_order_every_band"] else
                    "ANOTHER order: " + ", ".join(f"{r['knobs']['quant']} cap {r['knobs']['batch_cap']}" for r in every)))
              + "]", flush=True)
    counts = [r["measured_to_goal"] for r in runs]
    reached_all = all(c is not None for c in counts)
    med = statistics.median(counts) if reached_all else None
    print(f"grid {args.grid}: {len(data['rows'])} configurations (measured), SLO {data['slo']}, quality budget "
          f"{args.max_quality_drop} pp; best feasible {best:.3f} req/s (measured), goal {GOAL_SHARE:.0%} = {goal:.3f}")
    print(f"measurements to reach the goal ({args.seeds} seeds): {counts}; median "
          f"{med if med is not None else 'not reached in every seed'} (goal <= {GOAL_MEDIAN}); "
          f"predicted {runs[0]['n_predicted']} per seed, left out {runs[0]['left_out']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"grid": args.grid, "goal_rps": goal, "best_rps": best, "runs": runs},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
