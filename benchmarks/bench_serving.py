"""Serving benchmark for `tuner bench` on smollm2-135m, all figures from one run on this machine.

(a) harness overhead: TTFT as the harness sees it minus the engine's own first-token timestamp (median, ms)
(b) batch-1 decode tok/s per format against the memory-bandwidth bound measured in the same run (percent)
(c) output tok/s of the best config of a small hand grid vs fp32 / batch cap 1 / no draft, same arrival rate

Usage: .venv/bin/python benchmarks/bench_serving.py [--formats fp32,bf16,...] [--requests 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from tuner.config import TrialConfig
from tuner.measure.bench import BenchOptions, run_bench
from tuner.measure.roofline import measure_bandwidth_gbs
from tuner.measure.workload import WorkloadSpec

MODEL = "smollm2-135m"
FORMATS = "fp32,bf16,bnb-int8,bnb-nf4,bnb-fp4,torchao-int8wo,gptq-int4"
GRID = [  # (quant, batch cap, kv fraction, draft); the first is the engine-default baseline
    ("fp32", 1, 0.01, "none"),
    ("bf16", 1, 0.01, "none"),
    ("bf16", 4, 0.01, "none"),
    ("bf16", 8, 0.01, "none"),
    ("bf16", 16, 0.01, "none"),
    ("gptq-int4", 8, 0.01, "none"),
    ("bf16", 1, 0.01, "ngram:3"),
]


def decode_per_format(formats: list[str], bandwidth: float) -> list[dict]:
    spec = WorkloadSpec(requests=4, rate=None, concurrency=1, input_len=(64, 64), output_len=(64, 64), seed=0)
    rows = []
    for q in formats:
        out = run_bench(TrialConfig(model=MODEL, quant=q, batch_cap=1, kv_fraction=0.01),
                        BenchOptions(workload=spec, measure_bandwidth=False, progress=False, keep_requests=False))
        if out["status"] != "ok":
            rows.append({"quant": q, "status": out["status"], "reason": out["reason"]})
            continue
        m = out["metrics"]
        from_bytes = m["roofline"]["bytes_per_token"]
        tok_s = m["decode_tokens_per_s_per_seq"]
        bound = bandwidth * 1e9 / from_bytes
        rows.append({"quant": q, "status": "ok", "decode_tok_s": tok_s, "bytes_per_token": from_bytes,
                     "bound_tok_s": bound, "percent_of_bound": 100 * tok_s / bound,
                     "harness_overhead_ms_p50": m["harness_overhead_ms"]["p50"]})
        print(f"  {q:<15} {tok_s:7.1f} tok/s  {from_bytes / 1e6:6.0f} MB/token  bound {bound:7.1f} tok/s  "
              f"{100 * tok_s / bound:5.1f}% of bound", flush=True)
    return rows


def grid(requests: int, rate: float) -> list[dict]:
    spec = WorkloadSpec(requests=requests, rate=rate, input_len=(64, 256), output_len=(32, 64), seed=0)
    rows = []
    for q, cap, kv, draft in GRID:
        cfg = TrialConfig(model=MODEL, quant=q, batch_cap=cap, kv_fraction=kv, draft=draft)
        out = run_bench(cfg, BenchOptions(workload=spec, measure_bandwidth=False, progress=False,
                                          keep_requests=False))
        m = out["metrics"] or {}
        row = {"config": cfg.to_dict(), "status": out["status"], "output_tokens_per_s": m.get("output_tokens_per_s"),
               "ttft_p99_ms": (m.get("ttft_ms") or {}).get("p99"), "failed": m.get("failed"),
               "harness_overhead_ms_p50": (m.get("harness_overhead_ms") or {}).get("p50")}
        rows.append(row)
        print(f"  {q:<10} cap {cap:<3} draft {draft:<8} {row['output_tokens_per_s'] or 0:7.2f} out tok/s  "
              f"p99 TTFT {row['ttft_p99_ms'] or 0:8.0f} ms  failed {row['failed']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    bw = measure_bandwidth_gbs()
    print(f"memory read bandwidth: {bw:.1f} GB/s (median of 5 reads of 512 MB)")
    print("(b) batch-1 decode vs the bandwidth bound:")
    decode = decode_per_format(args.formats.split(","), bw)
    print(f"(c) hand grid at {args.rate} req/s Poisson, {args.requests} requests:")
    rows = grid(args.requests, args.rate)
    overheads = [r["harness_overhead_ms_p50"] for r in decode + rows if r.get("harness_overhead_ms_p50") is not None]
    base = rows[0]["output_tokens_per_s"] or float("nan")
    ok = [r for r in rows if r["status"] == "ok" and not r["failed"]]
    best = max(ok, key=lambda r: r["output_tokens_per_s"])
    print(f"(a) harness overhead (TTFT seen by harness - engine first-token stamp): median "
          f"{statistics.median(overheads):.3f} ms over {len(overheads)} runs (goal < 1 ms)")
    print(f"(c) best of grid: {best['config']['quant']} cap {best['config']['batch_cap']} draft "
          f"{best['config']['draft']}: {best['output_tokens_per_s']:.2f} vs baseline {base:.2f} out tok/s "
          f"-> {best['output_tokens_per_s'] / base:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbs": bw, "decode": decode, "grid": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
