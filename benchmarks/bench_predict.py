"""Predicted vs measured on llama.cpp (smollm2-135m): `tuner predict` against the real harness, signed errors.

For each configuration (weight type, -np) the engine profile is taken (or read from the cache), then:
(a) fixed rates: `tuner predict --at-rate R` against `tuner bench --rate R` (same workload flags and seed, a fresh
    process each), at the given shares of the predicted capacity: TTFT p50/p90 and TPOT p50, predicted (with the
    band) and measured (with n), and the signed error (predicted - measured) / measured;
(b) with --capacity: the predicted capacity against `tuner bench --capacity` at the same SLO (slow: minutes each).
Every figure is labelled predicted or measured. The machine is shared: each measured figure is one run under
whatever the neighbours did then (a profile taken minutes earlier may be off by the host's drift).

Usage: .venv/bin/python benchmarks/bench_predict.py [--configs Q8_0:4,Q8_0:1] [--threads 1] [--slo "ttft:p90<2s"]
       [--shares 0.5,1.0] [--requests 30] [--input-len 64:128] [--output-len 16:32] [--refresh-profile] [--capacity]
       [--json out.json]
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
from typing import Any

MODEL = "smollm2-135m"


def tuner_env() -> dict[str, str]:
    """The environment that runs the `tuner` this process imports: `python -m tuner` looks in its working directory
    first, so a run from the repository with PYTHONPATH naming another checkout (an older version's worktree) would
    get the working directory's instead; PYTHONSAFEPATH=1 leaves the working directory out."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("tuner")
    root = str(Path(spec.origin).parent.parent) if spec and spec.origin else ""
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": path}


def tuner_json(*args: str) -> tuple[dict[str, Any], float]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tuner", *args, "--json", str(out)], capture_output=True,
                              text=True, env=tuner_env())
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"tuner {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
        return json.loads(out.read_text()), wall


def signed(pred: float | None, meas: float | None) -> str:
    return "-" if not pred or not meas else f"{(pred - meas) / meas:+.0%}"


def run_config(quant: str, cap: int, args: argparse.Namespace) -> dict[str, Any]:
    config = ["--model", MODEL, "--engine", "llamacpp", "--quant", quant, "--batch-cap", str(cap),
              "--threads", str(args.threads)]
    work = ["--requests", str(args.requests), "--input-len", args.input_len, "--output-len", args.output_len,
            "--seed", str(args.seed)]
    pred, pred_s = tuner_json("predict", *config, *work, "--slo", args.slo,
                              *[a for s in args.shares for a in ("--at-share", str(s))],
                              *(["--refresh-profile"] if args.refresh_profile else []))
    first = pred
    rows = []
    for p in pred["at_rates"]:
        r = p["rate_rps"]
        m, bench_s = tuner_json("bench", *config, *work, "--rate", repr(r), "--no-bandwidth", "--quiet")
        mm = m["metrics"]
        row = {"rate_rps": r, "share_of_predicted_capacity": p.get("share"), "bench_s": bench_s}
        for metric, stat in (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50")):
            row[f"{metric}_{stat}"] = {"predicted": p[metric][stat], "predicted_band": p[metric]["band"][stat],
                                       "measured": mm[metric][stat], "measured_n": mm[metric]["n"],
                                       "measured_ci": mm[metric]["ci"][stat],
                                       "signed_error": (p[metric][stat] - mm[metric][stat]) / mm[metric][stat]
                                       if p[metric][stat] and mm[metric][stat] else None}
        rows.append(row)
        print(f"  {quant} -np {cap} at {r:.3f} req/s ({p.get('share')} x predicted capacity): "
              + "; ".join(f"{k}: predicted {v['predicted']:.0f} {v['predicted_band'] and [round(x) for x in v['predicted_band']]}"
                          f" vs measured {v['measured']:.0f} (n={v['measured_n']}) -> {signed(v['predicted'], v['measured'])}"
                          for k, v in row.items() if isinstance(v, dict)), flush=True)
    out: dict[str, Any] = {"quant": quant, "batch_cap": cap, "threads": args.threads, "profile": first["profile"],
                           "profile_cached": first["profile_cached"], "predict_s": pred["predict_s"],
                           "predict_cpu_s": pred["predict_cpu_s"], "predict_command_s": pred_s,
                           "predicted_capacity_rps": first["capacity"]["requests_per_s"],
                           "predicted_band": first["capacity"]["band"],
                           "predicted_saturation_rps": first["capacity"]["saturation_rps"], "rates": rows}
    if args.capacity:
        m, wall = tuner_json("bench", *config, *work, "--capacity", "--slo", args.slo, "--no-bandwidth", "--quiet")
        c = m["metrics"]["capacity"]
        out["measured_capacity_rps"] = c["requests_per_s"]
        out["measured_capacity_ci"] = c["requests_per_s_ci"]
        out["measured_capacity_wall_s"] = wall
        out["capacity_signed_error"] = ((first["capacity"]["requests_per_s"] - c["requests_per_s"]) /
                                        c["requests_per_s"] if c["requests_per_s"] else None)
        print(f"  {quant} -np {cap}: capacity predicted {first['capacity']['requests_per_s']:.3f} req/s "
              f"{[round(x, 3) for x in first['capacity']['band']]} vs measured {c['requests_per_s']:.3f} "
              f"{[round(x, 3) for x in c['requests_per_s_ci']]} ({wall:.0f} s) -> "
              f"{signed(first['capacity']['requests_per_s'], c['requests_per_s'])}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="Q8_0:4", help="WEIGHT_TYPE:NP,... (default Q8_0:4)")
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t (default 1: see the test's docstring)")
    ap.add_argument("--slo", default="ttft:p90<2s")
    ap.add_argument("--shares", default="0.5,1.0", help="rates measured, as shares of the predicted capacity")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--input-len", default="64:128")
    ap.add_argument("--output-len", default="16:32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refresh-profile", action="store_true",
                    help="profile each configuration afresh (a cached profile carries the host's load of then)")
    ap.add_argument("--capacity", action="store_true", help="also measure the real capacity (minutes per config)")
    ap.add_argument("--json", help="write every figure as JSON")
    args = ap.parse_args()
    args.shares = [float(s) for s in args.shares.split(",")]
    results = []
    for item in args.configs.split(","):
        quant, cap = item.split(":")
        print(f"{quant} -np {cap} (-t {args.threads}), SLO {args.slo}, workload {args.requests} requests "
              f"{args.input_len} in / {args.output_len} out, seed {args.seed}", flush=True)
        results.append(run_config(quant, int(cap), args))
    errors = [abs(v["signed_error"]) for r in results for row in r["rates"] for k, v in row.items()
              if isinstance(v, dict) and k == "ttft_ms_p90" and v["signed_error"] is not None]
    if errors:
        print(f"TTFT p90 |predicted - measured| / measured over {len(errors)} rates: median "
              f"{statistics.median(errors):.0%}, max {max(errors):.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
