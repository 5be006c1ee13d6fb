"""What running each trial in a child process costs: the same bench run as `tuner search` runs it (a
`python -m tuner.child --job` bench child: process start, imports, model load from the safetensors cache, serving) vs
in this process (`run_bench`, imports already paid, model loaded per run as a trial would).

Rounds alternate child / in-process. Serving time varies with the machine's load far more than the child's cost,
so the overhead is measured on the fixed part of a trial, wall time minus serving time (start, imports, model load,
engine start and warm-up, clean-up), as the median over rounds of (child fixed part - in-process fixed part), with
its parts:
  start+imports   a child that only starts Python and imports torch, transformers and tuner's bench code
  load            the model load measured inside each (bench JSON `load_s`)

Usage:
  .venv/bin/python benchmarks/bench_child_overhead.py --rounds 5 --out results/bench/child_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m"
KNOBS = {"quant": "bf16", "batch_cap": 2, "kv_fraction": 0.01, "draft": "none"}
WORKLOAD = {"requests": 2, "rate": 8.0, "input_len": (16, 32), "output_len": (4, 6), "seed": 0}
IMPORTS = "import torch, transformers, tuner.measure.bench, tuner.quantize, tuner.measure.loadgen, tuner.engines.transformers_cb"


def child_round(tmp: Path, i: int) -> dict:
    from tuner.child import run_child
    from tuner.config import TrialConfig
    from tuner.job import BenchJob, write_job
    from tuner.measure.workload import WorkloadSpec

    out = tmp / f"bench{i}.json"
    job = tmp / f"bench_job{i}.json"
    write_job(job, BenchJob(config=TrialConfig(model=MODEL, device="cpu", **KNOBS), workload=WorkloadSpec(**WORKLOAD),
                            out_path=str(out), measure_bandwidth=False))
    res = run_child(job, tmp / f"bench{i}.log", 900)
    if res.returncode != 0:
        raise SystemExit(f"child bench failed: {res.reason}")
    data = json.loads(out.read_text())
    return {"wall_s": res.wall_s, "load_s": data["load_s"], "serve_s": data["metrics"]["duration_s"]}


def inprocess_round() -> dict:
    from tuner.config import TrialConfig
    from tuner.measure.bench import BenchOptions, run_bench
    from tuner.measure.workload import WorkloadSpec

    opts = BenchOptions(workload=WorkloadSpec(**WORKLOAD), measure_bandwidth=False, progress=False)
    t = time.perf_counter()
    data = run_bench(TrialConfig(model=MODEL, device="cpu", **KNOBS), opts)
    wall = time.perf_counter() - t
    assert data["status"] == "ok", data["reason"]
    return {"wall_s": wall, "load_s": data["load_s"], "serve_s": data["metrics"]["duration_s"]}


def imports_round() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def fixed(r: dict) -> float:
    return r["wall_s"] - r["serve_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="results/bench/child_overhead.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from tuner.models import checkpoint_dir

    checkpoint_dir(MODEL)  # the safetensors cache exists before anything is timed
    t = time.perf_counter()
    exec(IMPORTS, {})  # this process pays its imports once, outside the timed in-process rounds
    own_imports = time.perf_counter() - t
    inprocess_round()  # warm-up: first-call costs of this process (allocator, kernels) are not a trial's
    child, inproc, imports = [], [], []
    with tempfile.TemporaryDirectory(prefix="child-overhead-") as tmp:
        for i in range(args.rounds):
            child.append(child_round(Path(tmp), i))
            inproc.append(inprocess_round())
            imports.append(imports_round())
            print(f"round {i + 1}/{args.rounds}: child {child[-1]['wall_s']:.2f} s (fixed {fixed(child[-1]):.2f}), "
                  f"in-process {inproc[-1]['wall_s']:.2f} s (fixed {fixed(inproc[-1]):.2f}), start+imports "
                  f"{imports[-1]:.2f} s", flush=True)
    load = os.getloadavg()
    result = {
        "model": MODEL, "knobs": KNOBS, "workload": {k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in WORKLOAD.items()},
        "rounds": args.rounds, "cpu_count": os.cpu_count(), "loadavg_1m_at_end": load[0],
        "child_wall_s": med(child, "wall_s"), "inprocess_wall_s": med(inproc, "wall_s"),
        "child_fixed_s": statistics.median(map(fixed, child)), "inprocess_fixed_s": statistics.median(map(fixed, inproc)),
        "overhead_s": statistics.median(fixed(c) - fixed(p) for c, p in zip(child, inproc)),
        "child_start_imports_s": statistics.median(imports),
        "child_load_s": med(child, "load_s"), "inprocess_load_s": med(inproc, "load_s"),
        "child_serve_s": med(child, "serve_s"), "inprocess_serve_s": med(inproc, "serve_s"),
        "this_process_first_imports_s": own_imports, "raw": {"child": child, "inprocess": inproc,
                                                             "start_imports_s": imports},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    r = result
    print(f"child process overhead per trial: {r['overhead_s']:.2f} s (median of {r['rounds']} rounds): fixed part "
          f"of a trial (wall - serving) {r['child_fixed_s']:.2f} s in a child vs {r['inprocess_fixed_s']:.2f} s "
          f"in-process; whole trial {r['child_wall_s']:.2f} s vs {r['inprocess_wall_s']:.2f} s")
    print(f"  of which start+imports {r['child_start_imports_s']:.2f} s; model load {r['child_load_s']:.2f} s in the "
          f"child vs {r['inprocess_load_s']:.2f} s in-process; serving {r['child_serve_s']:.2f} s vs "
          f"{r['inprocess_serve_s']:.2f} s")
    print(f"  ({r['cpu_count']} CPUs, load average {load[0]:.1f}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
