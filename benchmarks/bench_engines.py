"""Engines side by side on smollm2-135m, and vLLM's best against vLLM's defaults, from one real study:

(a) `tuner search --engine vllm,llamacpp,transformers`: the engine is a knob; every engine's default is measured first
    (vLLM's, `vllm serve MODEL` with nothing else, is the study's baseline); every trial launches its real server (or
    the in-process engine) on the same workload, SLO and quality budget. Printed as the search prints it, with the best
    of each engine.
(b) Side by side, re-measured in one round right after (a shared 2-core VM drifts; a round keeps them comparable):
    best vLLM, vLLM's defaults, best llama.cpp, best transformers, each with `tuner bench --config <export> --capacity`
    under the study's workload and SLO. Machine GFLOP/s is printed before each.
(c) Closed loop: the best vLLM trial's export (`tuner export --trial N --to vllm`, the exact command that was
    measured) re-measured 3 times; goal: median within +-10% of the search's figure.

Usage: .venv/bin/python benchmarks/bench_engines.py [--trials 10] [--target 2s] [--metric ttft:p90]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capacity import machine_gflops  # noqa: E402  (one home for the machine-speed probe)

MODEL = "smollm2-135m"
ENGINES = "vllm,llamacpp,transformers"


def tuner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True)


def remeasure(results: Path, storage: str, study: str, trial: int, engine: str, tag: str, cap: dict) -> dict | None:
    """Export trial `trial` to its own engine and measure the export's capacity once (workload + SLO recorded)."""
    export = results / f"export-{tag}.json"
    target = "transformers" if engine == "transformers" else engine
    px = tuner("export", "--study", study, "--storage", storage, "--trial", str(trial), "--to", target, "-o",
               str(export), "--force")
    if px.returncode != 0:
        print(f"    {tag}: export failed: {(px.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    out = results / f"bench-{tag}.json"
    gflops = machine_gflops()
    pb = tuner("bench", "--config", str(export), "--capacity", "--json", str(out), "--quiet", "--no-bandwidth",
               "--probe-requests", f"{cap['probe'][0]}:{cap['probe'][1]}", "--max-probes", str(cap["max_probes"]),
               "--capacity-timeout", "10m")
    if pb.returncode != 0 or not out.is_file():
        print(f"    {tag}: failed: {(pb.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    c = json.loads(out.read_text())["metrics"]["capacity"]
    print(f"    {tag:<22} trial {trial:>2}: {c['requests_per_s']:.3f} req/s {c['requests_per_s_ci']} {c['verdict']}"
          f"  (machine {gflops:.0f} GFLOP/s before)", flush=True)
    return c


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--target", default="2s")
    p.add_argument("--metric", default="ttft:p90")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results-dir", default=None)
    p.add_argument("--max-quality-drop", default="3")
    p.add_argument("--quality", default="arc_easy,piqa:50:100", help="TASKS:LIMIT:MAX_LIMIT of the quality gate")
    args = p.parse_args()
    results = Path(args.results_dir or tempfile.mkdtemp(prefix="tuner-engines-"))
    study, storage = "engines", f"sqlite:///{results / 'tuner.db'}"
    tasks, limit, max_limit = args.quality.split(":")
    print(f"machine {machine_gflops():.0f} GFLOP/s before the search", flush=True)
    t0 = time.perf_counter()
    proc = tuner("search", "--engine", ENGINES, "--model", MODEL, "--latency-target", args.target,
                 "--latency-metric", args.metric, "--trials", str(args.trials), "--results-dir", str(results),
                 "--study", study, "--seed", "0", "--quiet", "--max-quality-drop", args.max_quality_drop,
                 "--quality-tasks", tasks, "--quality-limit", limit, "--quality-max-limit", max_limit)
    print(f"(a) tuner search --engine {ENGINES} --model {MODEL} --latency-target {args.target} --latency-metric "
          f"{args.metric} --trials {args.trials} --max-quality-drop {args.max_quality_drop} --quality-tasks {tasks} "
          f"--quality-limit {limit} --quality-max-limit {max_limit}  ({(time.perf_counter() - t0) / 60:.1f} min, "
          f"exit {proc.returncode})")
    print("\n".join("    " + line for line in proc.stdout.splitlines()))
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
        return 1
    rec = json.loads((results / study / "recommendation.json").read_text())
    per = rec.get("best_per_engine") or {}
    base = rec.get("baseline")
    method = ((per.get("vllm") or {}).get("capacity") or {}).get("method") or {}
    cap = {"probe": method.get("probe_requests") or [30, 120], "max_probes": method.get("max_probes") or 5}
    print("(b) side by side, one round (tuner bench --config <export of the trial> --capacity):")
    side = {}
    rounds = [("vllm best", per.get("vllm"), "vllm"), ("vllm defaults", base, "vllm"),
              ("llama.cpp best", per.get("llamacpp"), "llamacpp"),
              ("transformers best", per.get("transformers"), "transformers")]
    for tag, s, engine in rounds:
        if not s:
            print(f"    {tag}: nothing feasible in the study")
            continue
        side[tag] = remeasure(results, storage, study, s["trial"], engine, tag.replace(" ", "-").replace(".", ""),
                              cap)
    if side.get("vllm best") and side.get("vllm defaults"):
        a, b = side["vllm best"]["requests_per_s"], side["vllm defaults"]["requests_per_s"]
        print(f"    vLLM best / vLLM defaults: {a / b:.2f}x" if b else "    vLLM defaults: no capacity shown")
    best_vllm = per.get("vllm")
    if not best_vllm:
        print("(c) closed loop skipped: no feasible vLLM trial")
        return 0
    figure = best_vllm["capacity_requests_per_s"]
    print(f"(c) closed loop: vLLM trial {best_vllm['trial']} exported and re-measured {args.repeats}x (search's figure "
          f"{figure:.3f} req/s {best_vllm['capacity_ci']})")
    again = [side["vllm best"]["requests_per_s"]] if side.get("vllm best") else []
    for i in range(len(again), args.repeats):
        c = remeasure(results, storage, study, best_vllm["trial"], "vllm", f"vllm-again-{i}", cap)
        if c:
            again.append(c["requests_per_s"])
    if again:
        med = statistics.median(again)
        print(f"    runs {', '.join(f'{x:.3f}' for x in again)}; median {med:.3f} req/s vs the search's {figure:.3f}: "
              f"{(med - figure) / figure * 100 if figure else float('nan'):+.1f}% (goal within +-10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
