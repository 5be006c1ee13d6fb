"""Search-efficiency benchmark for `tuner search` on smollm2-135m, on the capacity objective.

  grid    measure every config of a small space for real, once: its capacity within the SLO (tuner.measure.capacity, in a
          fresh process per config) and its format's quality gate (tuner eval, cached per format). JSON, resumable.
  replay  replay the real search on the recorded surface -- the search's own sampler (tuner.search.samplers.make_sampler),
          directions, space handling (tuner.search.space.suggest_config, conditional knobs), quality pruning and
          normalised constraints (tuner.search.objective.apply_quality / apply_capacity) -- against random search at equal
          budget, for 10 seeds: trials to reach 95% of the grid's best feasible capacity.

Usage:
  .venv/bin/python benchmarks/bench_search.py grid --out results/bench/capacity-grid.json --slo "ttft:p90<2s"
  .venv/bin/python benchmarks/bench_search.py replay [--grid results/bench/capacity-grid.json]
  (default grid: benchmarks/data/capacity-grid-smollm2-cpu.json, measured here with the defaults above, ~45 min)
Goal: median trials <= 20% of the grid, and better than random in >= 8 of 10 seeds. Also printed: TPE alone (no
start-up sweep, no no-repeat rule: tuner.search.loop.enqueue_start, tuner.search.samplers.no_repeat_tpe). `replay --mirror-caps` replays on
the grid with its batch caps reversed, where the start-up sweep's prior (capacity grows with the cap) is wrong.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "smollm2-135m"
QUANTS = ["fp32", "bf16", "bnb-nf4", "torchao-int8wo"]
CAPS = [1, 2, 4, 8, 16]
KVS = [0.02]  # one value, to keep the grid (measured for real, ~2 min a config) near an hour
DRAFTS = ["none", "ngram:3"]
BASELINE = {"quant": "fp32", "batch_cap": 1, "draft": "none", "kv_fraction": 0.02}


def grid_configs() -> list[dict]:
    out = []
    for q, cap, d, kv in itertools.product(QUANTS, CAPS, DRAFTS, KVS):
        if d != "none" and (cap != 1 or kv != KVS[-1]):
            continue  # drafts only at cap 1; the KV fraction does not apply to them (conditional knob)
        out.append({"quant": q, "batch_cap": cap, "draft": d, "kv_fraction": kv})
    return out


def key(knobs: dict) -> str:
    return json.dumps({k: knobs[k] for k in ("quant", "batch_cap", "draft", "kv_fraction")}, sort_keys=True)


def space_file(path: Path) -> Path:
    """The grid as a search-space file, so the replay samples through the real space code."""
    path.write_text(
        "knobs:\n"
        f"  quant: {{choices: {json.dumps(QUANTS)}}}\n"
        f"  batch_cap: {{choices: {json.dumps(CAPS)}, increasing: true}}\n"
        f"  draft: {{choices: {json.dumps(DRAFTS)}, when: {{batch_cap: [1]}}}}\n"
        f"  kv_fraction: {{choices: {json.dumps(KVS)}, when: {{draft: [none]}}}}\n"
        f"baseline: {json.dumps(BASELINE)}\n")
    return path


def cmd_grid(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.is_file() else {"slo": args.slo, "rows": [], "quality": {}}
    if data["slo"] != args.slo:
        print(f"{out} was measured with SLO {data['slo']!r}: use another --out", file=sys.stderr)
        return 2
    seen = {key(r["knobs"]) for r in data["rows"]}
    for knobs in grid_configs():
        if knobs["quant"] not in data["quality"]:
            data["quality"][knobs["quant"]] = quality_of(knobs["quant"], args)
            out.write_text(json.dumps(data, indent=1))
        if key(knobs) in seen:
            continue
        data["rows"].append({"knobs": knobs, **capacity_of(knobs, args)})
        r = data["rows"][-1]
        print(f"{key(knobs)}: {r.get('capacity', {}).get('requests_per_s')} req/s {r['status']}", flush=True)
        out.write_text(json.dumps(data, indent=1))  # nothing finished is lost
    print(f"recorded {len(data['rows'])} configs in {out}")
    return 0


def capacity_of(knobs: dict, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b.json"
        proc = subprocess.run([sys.executable, "-m", "tuner", "bench", "--model", MODEL, "--quant", knobs["quant"],
                               "--batch-cap", str(knobs["batch_cap"]), "--kv-fraction", str(knobs["kv_fraction"]),
                               "--draft", knobs["draft"], "--capacity", "--slo", args.slo, "--input-len",
                               args.input_len, "--output-len", args.output_len, "--probe-requests",
                               args.probe_requests, "--max-probes", str(args.max_probes), "--capacity-timeout",
                               args.capacity_timeout, "--no-bandwidth",
                               "--quiet", "--json", str(path)], capture_output=True, text=True)
        if not path.is_file():
            return {"status": "failed", "reason": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        res = json.loads(path.read_text())
    cap = (res.get("metrics") or {}).get("capacity")
    return {"status": res["status"], "reason": res.get("reason"), "capacity": cap}


def quality_of(quant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "q.json"
        subprocess.run([sys.executable, "-m", "tuner", "eval", "--model", MODEL, "--quant", quant, "--tasks",
                        args.tasks, "--limit", str(args.limit), "--max-quality-drop", str(args.max_quality_drop),
                        "--max-limit", str(4 * args.limit), "--json", str(path)], capture_output=True, text=True)
        return json.loads(path.read_text()) if path.is_file() else {"error": "quality scoring failed"}


# ---------------------------------------------------------------------------------------------- replay --- #
def search_context(data: dict, space_path: Path):
    from tuner.measure.workload import WorkloadSpec
    from tuner.search.objective import SearchContext
    from tuner.search.space import load_space
    from tuner.slo import build_slo

    _, slo = build_slo(None, "ttft:p99", data["slo"])
    return SearchContext(model=MODEL, device="cpu", space=load_space(space_path), primary=None, slo=slo,
                         max_quality_drop=data.get("max_quality_drop", 2.0), workload=WorkloadSpec(),
                         quality_tasks=("arc_easy",), quality_limit=50)


def replay_search(data: dict, ctx, seed: int, budget: int, no_repeat: bool = True) -> list[dict]:
    """The real search's decisions on recorded measurements: the order in which it measured configs
    (`no_repeat=False`: TPE alone, without the sampler's rule against measuring a configuration twice)."""
    import warnings

    import optuna

    from tuner.search.loop import DIRECTIONS, enqueue_start
    from tuner.search.objective import TrialFailed, apply_capacity, apply_quality
    from tuner.search.samplers import make_sampler
    from tuner.search.space import suggest_config

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    surface = {key(r["knobs"]): r for r in data["rows"]}
    sampler = make_sampler(seed, ctx.space if no_repeat else None)
    study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
    if no_repeat:
        enqueue_start(study, ctx.space, seed, budget)
    else:  # TPE alone: the baseline, then TPE
        study.enqueue_trial(dict(ctx.space.baseline), user_attrs={"baseline": True})
    order: list[dict] = []

    def objective(trial):
        config = suggest_config(trial, ctx.space, MODEL, "cpu")
        r = surface[key(config.to_dict())]
        order.append(r)
        apply_quality(trial, ctx, config, data["quality"][config.quant])
        if r["status"] != "ok" or not r.get("capacity"):
            raise TrialFailed(r.get("reason") or "failed")
        return apply_capacity(trial, ctx, r["capacity"], data["quality"][config.quant])

    study.optimize(objective, n_trials=budget, catch=(TrialFailed,))
    return order


def feasible_capacity(r: dict, data: dict, ctx) -> float:
    """The capacity of a config if the search would call it feasible (same constraint functions), else 0."""
    from tuner.search.objective import quality_constraint, slo_constraints

    if r["status"] != "ok" or not r.get("capacity"):
        return 0.0
    q = data["quality"][r["knobs"]["quant"]]
    cons = slo_constraints(r["capacity"], ctx) + [quality_constraint(q, ctx)]
    return float(r["capacity"]["requests_per_s"] or 0.0) if all(c <= 0 for c in cons) else 0.0


def trials_to_reach(order: list[dict], data: dict, ctx, goal: float) -> int:
    for i, r in enumerate(order, 1):
        if feasible_capacity(r, data, ctx) >= goal:
            return i
    return len(order) + 1


def mirrored(data: dict) -> dict:
    """The grid with its batch caps reversed (cap 1 measured as cap 16's and so on; drafts stay at cap 1): a
    surface whose best lies at the smallest cap, where the search's start-up prior (formats at the top cap) is
    wrong, to show what that prior costs when it misleads."""
    flip = dict(zip(CAPS, reversed(CAPS)))
    rows = [dict(r, knobs=dict(r["knobs"], batch_cap=flip[r["knobs"]["batch_cap"]]))
            if r["knobs"]["draft"] == "none" else r for r in data["rows"]]
    return dict(data, rows=rows)


def cmd_replay(args: argparse.Namespace) -> int:
    data = json.loads(Path(args.grid).read_text())
    data["max_quality_drop"] = args.max_quality_drop
    if args.mirror_caps:
        data = mirrored(data)
    with tempfile.TemporaryDirectory() as d:
        ctx = search_context(data, space_file(Path(d) / "space.yaml"))
    best = max(feasible_capacity(r, data, ctx) for r in data["rows"])
    if best <= 0:
        print("no feasible config in the grid: nothing to reach")
        return 1
    goal = 0.95 * best
    n = len(data["rows"])
    res: dict[str, list[int]] = {"search": [], "random": [], "tpe_alone": []}
    for seed in range(args.seeds):
        res["search"].append(trials_to_reach(replay_search(data, ctx, seed, n), data, ctx, goal))
        res["tpe_alone"].append(trials_to_reach(replay_search(data, ctx, seed, n, False), data, ctx, goal))
        shuffled = data["rows"][:]
        random.Random(seed).shuffle(shuffled)
        res["random"].append(trials_to_reach(shuffled, data, ctx, goal))
    wins = sum(o < r for o, r in zip(res["search"], res["random"]))
    ties = sum(o == r for o, r in zip(res["search"], res["random"]))
    med = statistics.median(res["search"])
    print(f"grid: {n} configs, SLO {data['slo']}, quality budget {args.max_quality_drop} pp; best feasible capacity "
          f"{best:.3f} req/s, goal 95% = {goal:.3f}")
    print(f"trials to reach the goal ({args.seeds} seeds): search {res['search']}, random {res['random']}; "
          f"TPE alone (configurations may repeat) {res['tpe_alone']}, median "
          f"{statistics.median(res['tpe_alone']):.1f}")
    print(f"median: search {med:.1f} ({100 * med / n:.0f}% of the grid), random {statistics.median(res['random']):.1f};"
          f" search better than random in {wins}/{args.seeds} seeds ({ties} ties) (goal: <= 20% of the grid and "
          ">= 8/10)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--out", default="results/bench/capacity-grid.json")
    g.add_argument("--slo", default="ttft:p90<2s")
    g.add_argument("--input-len", default="32:128")
    g.add_argument("--output-len", default="16:32")
    g.add_argument("--probe-requests", default="30:45")
    g.add_argument("--max-probes", type=int, default=3)
    g.add_argument("--capacity-timeout", default="90s", help="per config, as a search trial's budget")
    g.add_argument("--tasks", default="arc_easy,piqa")
    g.add_argument("--limit", type=int, default=50)
    g.add_argument("--max-quality-drop", type=float, default=5.0)
    r = sub.add_parser("replay")
    r.add_argument("--grid", default="benchmarks/data/capacity-grid-smollm2-cpu.json", help="the grid measured on "
                   "this 2-core CPU on 2026-12-04 (bench_search.py grid, defaults), or one you measured")
    r.add_argument("--max-quality-drop", type=float, default=5.0)
    r.add_argument("--seeds", type=int, default=10)
    r.add_argument("--mirror-caps", action="store_true", help="replay on the grid with its batch caps reversed")
    args = ap.parse_args()
    return {"grid": cmd_grid, "replay": cmd_replay}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
