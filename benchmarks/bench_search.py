"""Search benchmarks for `tuner search` on smollm2-135m (figures as ratios from one run).

  grid    measure every config of a small space once, for real, and record the surface (JSON)
  replay  replay Optuna (the search's own sampler set-up) vs random vs grid order on the recorded surface for
          10 seeds: median trials to reach 95% of the grid's best feasible throughput
  gain    re-measure a recommended config and the engine-default baseline side by side (alternating, 3 rounds),
          at the same workload and SLO: median output tok/s ratio

Usage:
  .venv/bin/python benchmarks/bench_search.py grid --out results/bench/grid.json
  .venv/bin/python benchmarks/bench_search.py replay --grid results/bench/grid.json
  .venv/bin/python benchmarks/bench_search.py gain --recommendation results/<study>/recommendation.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

MODEL = "smollm2-135m"
QUANTS = ["fp32", "bf16", "bnb-nf4", "torchao-int8wo", "gptq-int4"]
CAPS = [1, 2, 4, 8, 16]
KVS = [0.005, 0.02]
DRAFTS = ["none", "ngram:3"]


def grid_configs() -> list[dict]:
    out = []
    for q, cap, kv, d in itertools.product(QUANTS, CAPS, KVS, DRAFTS):
        if d != "none" and cap != 1:
            continue
        out.append({"quant": q, "batch_cap": cap, "kv_fraction": kv, "draft": d})
    return out


def workload():
    from tuner.workload import WorkloadSpec

    return WorkloadSpec(requests=12, rate=4.0, input_len=(64, 128), output_len=(16, 32), seed=0)


def cmd_grid(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tuner.bench import BenchOptions, run_bench
    from tuner.config import TrialConfig

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(out.read_text()) if out.is_file() else []
    seen = {json.dumps(r["knobs"], sort_keys=True) for r in done}
    opts = BenchOptions(workload=workload(), measure_bandwidth=False, progress=False, keep_requests=False,
                        verify_draft=0)
    for knobs in tqdm(grid_configs(), desc="grid"):
        if json.dumps(knobs, sort_keys=True) in seen:
            continue
        res = run_bench(TrialConfig(model=MODEL, device="cpu", **knobs), opts)
        m = res.get("metrics") or {}
        done.append({"knobs": knobs, "status": res["status"], "reason": res["reason"],
                     "output_tokens_per_s": m.get("output_tokens_per_s"),
                     "ttft_p99_ms": (m.get("ttft_ms") or {}).get("p99"), "failed": m.get("failed")})
        out.write_text(json.dumps(done, indent=1))  # nothing finished is lost
    print(f"recorded {len(done)} configs in {out}")
    return 0


def feasible_best(surface: dict, target_ms: float) -> float:
    return max(r["output_tokens_per_s"] for r in surface.values() if is_feasible(r, target_ms))


def is_feasible(r: dict, target_ms: float) -> bool:
    return r["status"] == "ok" and not r["failed"] and r["ttft_p99_ms"] is not None and r["ttft_p99_ms"] <= target_ms


def trials_to_reach(order: list[dict], target_ms: float, goal: float) -> int:
    for i, r in enumerate(order, 1):
        if is_feasible(r, target_ms) and r["output_tokens_per_s"] >= goal:
            return i
    return len(order) + 1


def optuna_order(surface: dict, target_ms: float, seed: int, budget: int) -> list[dict]:
    import warnings

    import optuna

    from tuner.search import make_sampler

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    sampler = make_sampler(seed, budget)
    study = optuna.create_study(directions=["maximize", "minimize", "maximize"], sampler=sampler)
    study.enqueue_trial({"quant": "fp32", "batch_cap": 1, "kv_fraction": 0.005, "draft": "none"})
    order: list[dict] = []

    def objective(trial):
        q = trial.suggest_categorical("quant", QUANTS)
        cap = trial.suggest_categorical("batch_cap", CAPS)
        kv = trial.suggest_categorical("kv_fraction", KVS)
        d = trial.suggest_categorical("draft", DRAFTS) if cap == 1 else "none"
        r = surface[key({"quant": q, "batch_cap": cap, "kv_fraction": kv, "draft": d})]
        order.append(r)
        if r["status"] != "ok":
            trial.set_constraint("ttft", 1e12)
            return 0.0, 1e9, 0.0
        trial.set_constraint("ttft", r["ttft_p99_ms"] - target_ms)
        trial.set_constraint("failed", float(r["failed"] or 0))
        return r["output_tokens_per_s"], r["ttft_p99_ms"], 0.0

    study.optimize(objective, n_trials=budget)
    return order


def key(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True)


def cmd_replay(args: argparse.Namespace) -> int:
    rows = json.loads(Path(args.grid).read_text())
    surface = {key(r["knobs"]): r for r in rows}
    ok = sorted(r["ttft_p99_ms"] for r in rows if r["status"] == "ok" and not r["failed"])
    target = args.target_ms or ok[len(ok) // 2]  # default: half of the grid meets the target
    best = feasible_best(surface, target)
    goal = 0.95 * best
    n = len(rows)
    grid_n = trials_to_reach(rows, target, goal)
    res = {"optuna": [], "random": []}
    for seed in range(10):
        res["optuna"].append(trials_to_reach(optuna_order(surface, target, seed, n), target, goal))
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        res["random"].append(trials_to_reach(shuffled, target, goal))
    wins = sum(o < r for o, r in zip(res["optuna"], res["random"]))
    print(f"grid: {n} configs, target ttft:p99 <= {target:.0f} ms, best feasible {best:.2f} out tok/s, "
          f"goal 95% = {goal:.2f}")
    print(f"trials to reach the goal (10 seeds): optuna {res['optuna']}, random {res['random']}, grid order {grid_n}")
    print(f"median: optuna {statistics.median(res['optuna']):.1f} "
          f"({100 * statistics.median(res['optuna']) / n:.0f}% of the grid), random "
          f"{statistics.median(res['random']):.1f}, grid order {grid_n}; optuna better than random in {wins}/10 "
          "seeds (goal: <= 20% of the grid and >= 8/10)")
    return 0


def cmd_gain(args: argparse.Namespace) -> int:
    from tuner.bench import BenchOptions, run_bench
    from tuner.config import TrialConfig
    from tuner.workload import WorkloadSpec

    rec = json.loads(Path(args.recommendation).read_text())
    best = TrialConfig.from_dict(rec["recommendation"]["config"])
    base = TrialConfig.from_dict(rec["baseline"]["config"])
    w = rec.get("workload") or {}
    spec = WorkloadSpec(requests=args.requests, rate=args.rate, input_len=(64, 192), output_len=(24, 48), seed=0) \
        if not w else WorkloadSpec(**{**w, "input_len": tuple(w["input_len"]), "output_len": tuple(w["output_len"])})
    opts = BenchOptions(workload=spec, measure_bandwidth=False, progress=False, keep_requests=False, verify_draft=0)
    ratios, tb, tr = [], [], []
    for i in range(args.rounds):
        b = run_bench(base, opts)["metrics"]
        r = run_bench(best, opts)["metrics"]
        tb.append(b["output_tokens_per_s"])
        tr.append(r["output_tokens_per_s"])
        ratios.append(r["output_tokens_per_s"] / b["output_tokens_per_s"])
        print(f"round {i + 1}: baseline {tb[-1]:.2f} tok/s (ttft p99 {b['ttft_ms']['p99']:.0f} ms), recommended "
              f"{tr[-1]:.2f} tok/s (ttft p99 {r['ttft_ms']['p99']:.0f} ms) -> {ratios[-1]:.2f}x", flush=True)
    print(f"gain: recommended {best.quant} cap {best.batch_cap} draft {best.draft} vs baseline {base.quant} cap "
          f"{base.batch_cap}: median {statistics.median(ratios):.2f}x output tok/s (goal >= 3x)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--out", default="results/bench/grid.json")
    r = sub.add_parser("replay")
    r.add_argument("--grid", default="results/bench/grid.json")
    r.add_argument("--target-ms", type=float)
    gn = sub.add_parser("gain")
    gn.add_argument("--recommendation", required=True)
    gn.add_argument("--rounds", type=int, default=3)
    gn.add_argument("--requests", type=int, default=16)
    gn.add_argument("--rate", type=float, default=2.0)
    args = ap.parse_args()
    return {"grid": cmd_grid, "replay": cmd_replay, "gain": cmd_gain}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
