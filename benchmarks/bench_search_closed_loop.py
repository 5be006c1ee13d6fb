"""A short `tuner search --engine E` on smollm2-135m (E = llamacpp or vllm), then the closed loop on its answer:

(a) the search: every trial a real server (llama-server / vLLM) launched with the exported argv, capacity within the
    SLO measured by the capacity search, quality of what is served (llama-perplexity on the GGUF + KV type; vLLM:
    through the endpoint); it must end with a recommendation and its exact launch command (printed as the search
    prints it). The pick is re-measured after the last trial (`--confirm`, the search's default) and the answer
    reports that figure.
(b) closed loop: `tuner export --best --to E` of that study, then `tuner bench --config <export> --capacity`
    three times with the workload and SLO the export recorded; goal: the median within +-10% of the search's figure
    (the figure printed also against the pick's own in-trial figure).

Usage: .venv/bin/python benchmarks/bench_search_closed_loop.py [--engine llamacpp] [--trials 8] [--target 2s]
       [--metric ttft:p90]
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

MODEL = "smollm2-135m"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capacity import machine_gflops  # noqa: E402  (one home for the machine-speed probe)


def tuner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="llamacpp", choices=("llamacpp", "vllm"))
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--target", default="2s")
    p.add_argument("--metric", default="ttft:p90")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results-dir", default=None)
    p.add_argument("--study", default="bench")
    p.add_argument("--max-quality-drop", default="3", help="pp (paired upper bound), as `tuner search`")
    p.add_argument("--quality", default="arc_easy,piqa:50:100", help="TASKS:LIMIT:MAX_LIMIT of the quality gate")
    args = p.parse_args()
    results = Path(args.results_dir or tempfile.mkdtemp(prefix=f"tuner-{args.engine}-search-"))
    tasks, limit, max_limit = args.quality.split(":")
    print(f"machine {machine_gflops():.0f} GFLOP/s before the search", flush=True)
    t0 = time.perf_counter()
    proc = tuner("search", "--engine", args.engine, "--model", MODEL, "--latency-target", args.target,
                 "--latency-metric", args.metric, "--trials", str(args.trials), "--results-dir", str(results),
                 "--study", args.study, "--seed", "0", "--quiet", "--max-quality-drop", args.max_quality_drop,
                 "--quality-tasks", tasks, "--quality-limit", limit, "--quality-max-limit", max_limit)
    wall = time.perf_counter() - t0
    print(f"(a) tuner search --engine {args.engine} --model {MODEL} --latency-target {args.target} --latency-metric "
          f"{args.metric} --trials {args.trials} --max-quality-drop {args.max_quality_drop} --quality-tasks {tasks} "
          f"--quality-limit {limit} --quality-max-limit {max_limit}  ({wall / 60:.1f} min, exit {proc.returncode})")
    print("\n".join("    " + line for line in proc.stdout.splitlines()))
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
        return 1
    rec = json.loads((results / args.study / "recommendation.json").read_text()).get("recommendation")
    if not rec:
        print("no recommendation: closed loop skipped")
        return 1
    export = results / "export.json"
    px = tuner("export", "--study", args.study, "--storage", f"sqlite:///{results / 'tuner.db'}", "--best", "--to",
               args.engine, "-o", str(export), "--force")
    if px.returncode != 0:
        print(px.stderr[-2000:])
        return 1
    cap = rec["capacity"]
    figure = rec["capacity_requests_per_s"]
    method = cap.get("method") or {}
    probe, max_probes = method.get("probe_requests") or [30, 120], method.get("max_probes") or 5
    own = rec.get("in_trial_requests_per_s")
    bw = (cap.get("machine") or {}).get("memory_bandwidth_gbs")
    if bw and None not in bw:
        print(f"    the search's figure was measured with the machine's memory at {bw[0]:.1f} -> {bw[1]:.1f} GB/s")
    print(f"(b) closed loop: export of trial {rec['trial']} re-measured {args.repeats}x with tuner bench --config "
          f"(search's figure {figure:.3f} req/s {rec['capacity_ci']}"
          + (f", re-measured after the search; {own:.3f} in its trial)" if rec.get("confirmed") else ")"))
    again = []
    for i in range(args.repeats):
        out = results / f"again-{i}.json"
        gflops = machine_gflops()
        pb = tuner("bench", "--config", str(export), "--capacity", "--json", str(out), "--quiet", "--no-bandwidth",
                   "--probe-requests", f"{probe[0]}:{probe[1]}", "--max-probes", str(max_probes),
                   "--capacity-timeout", "10m")  # the search's capacity budget (search_spaces/<engine>-cpu.yaml)
        if pb.returncode != 0 or not out.is_file():
            print(f"    run {i + 1}: failed: {(pb.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        c = json.loads(out.read_text())["metrics"]["capacity"]
        again.append(c["requests_per_s"])
        bw = (c.get("machine") or {}).get("memory_bandwidth_gbs") or [float("nan")] * 2
        print(f"    run {i + 1}: {c['requests_per_s']:.3f} req/s {c['requests_per_s_ci']} {c['verdict']}  (machine "
              f"{gflops:.0f} GFLOP/s before, memory {bw[0]:.1f} -> {bw[1]:.1f} GB/s)", flush=True)
    if again:
        med = statistics.median(again)
        dev = (med - figure) / figure * 100 if figure else float("nan")
        print(f"    median {med:.3f} req/s vs the search's {figure:.3f}: {dev:+.1f}% (goal within +-10%)")
        if rec.get("confirmed") and own:
            print(f"    (vs the pick's own in-trial figure {own:.3f}: {(med - own) / own * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
