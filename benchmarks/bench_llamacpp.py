"""llama.cpp engine benchmarks on smollm2-135m, every figure from `tuner bench --engine llamacpp` runs in this one
invocation (a real llama-server per run, launched with the exported argv).

(a) roofline: batch-1 decode of each weight type (one request at a time, fixed output length) vs the memory-
    bandwidth bound measured in the same run (tuner.measure.roofline: a streaming read; bytes per token = the GGUF file's
    size). Goal: best type >= 60% of the bound.
(b) harness check: the client's TTFT minus the server's own prompt time, and the client's TPOT minus the server's
    time per token (llama.cpp `timings`), medians over the same batch-1 runs. Goal: TTFT gap median < 1 ms.
(c) capacity side by side, same workload and SLO: a llama.cpp config, a transformers config, and the bundled
    model as llama-server serves it by default (its shipped Q4_1 GGUF; `-np` auto = 4 slots at this commit).

Usage: .venv/bin/python benchmarks/bench_llamacpp.py [--types F16,Q8_0,...] [--skip-capacity] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "smollm2-135m"
TYPES = "F16,Q8_0,Q6_K,Q5_K_M,Q4_K_M,IQ4_NL,Q4_0"


def bench(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b.json"
        proc = subprocess.run([sys.executable, "-m", "tuner", "bench", "--model", MODEL, "--quiet", "--json",
                               str(out), *args], capture_output=True, text=True)
        if not out.is_file():
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        return json.loads(out.read_text())


def roofline_rows(types: list[str]) -> list[dict]:
    rows = []
    for t in types:
        r = bench(["--engine", "llamacpp", "--quant", t, "--batch-cap", "1", "--concurrency", "1", "--requests",
                   "8", "--input-len", "32:32", "--output-len", "64:64"])
        if "error" in r or r.get("status") != "ok":
            rows.append({"type": t, "error": r.get("error") or r.get("reason")})
        else:
            m, info = r["metrics"], r["engine"]["info"]
            h = r["engine"].get("harness_check") or {}
            rows.append({"type": t, "size_mb": info["gguf"]["size_bytes"] / 1e6,
                         "decode_tok_s": m["decode_tokens_per_s_per_seq"], "n": m["tpot_ms"]["n"],
                         "bound_tok_s": m["roofline"].get("bound_tokens_per_s"),
                         "percent": m["roofline"].get("percent_of_bound"),
                         "bandwidth_gbs": m["roofline"].get("bandwidth_gbs"),
                         "ttft_gap_ms": h.get("ttft_minus_server_prompt_ms_p50"),
                         "tpot_gap_ms": h.get("tpot_minus_server_per_token_ms_p50")})
        row = rows[-1]
        if "error" in row:
            print(f"  {t:<8} ERROR {row['error']}", flush=True)
        else:
            print(f"  {t:<8} {row['size_mb']:7.1f} MB  decode {row['decode_tok_s']:6.1f} tok/s (n={row['n']})  bound "
                  f"{row['bound_tok_s']:6.1f} tok/s at {row['bandwidth_gbs']:.1f} GB/s -> {row['percent']:5.1f}%   "
                  f"TTFT-server prompt {row['ttft_gap_ms']:+.2f} ms, TPOT-server {row['tpot_gap_ms']:+.2f} ms",
                  flush=True)
    return rows


def capacity_rows(slo: str, budget: str) -> list[dict]:
    common = ["--capacity", "--slo", slo, "--input-len", "64:192", "--output-len", "24:48", "--probe-requests",
              "30:60", "--max-probes", "4", "--capacity-timeout", budget, "--no-bandwidth"]
    configs = {
        "llama.cpp Q8_0, 8 slots": ["--engine", "llamacpp", "--quant", "Q8_0", "--batch-cap", "8",
                                    "--kv-fraction", "0.01"],
        "transformers bf16, cap 16": ["--quant", "bf16", "--batch-cap", "16", "--kv-fraction", "0.01"],
        "llama-server default (Q4_1 as shipped, -np auto=4)": ["--engine", "llamacpp", "--quant", "Q4_1",
                                                               "--batch-cap", "4", "--kv-fraction", "0.01"],
    }
    rows = []
    for name, args in configs.items():
        r = bench(args + common)
        cap = ((r.get("metrics") or {}).get("capacity")) if "error" not in r else None
        if not cap:
            rows.append({"config": name, "error": r.get("error") or r.get("reason")})
            print(f"  {name:<48} ERROR {rows[-1]['error']}", flush=True)
            continue
        lo, hi = cap["requests_per_s_ci"]
        rows.append({"config": name, "requests_per_s": cap["requests_per_s"], "ci": [lo, hi],
                     "verdict": cap["verdict"], "output_tokens_per_s": cap["output_tokens_per_s"],
                     "saturation_rps": cap["saturation"]["requests_per_s"]})
        print(f"  {name:<48} {cap['requests_per_s']:.3f} req/s [{lo:.3f}, {hi:.3f}] {cap['verdict']:<13} "
              f"= {cap['output_tokens_per_s'] or 0:.1f} tok/s; saturation {cap['saturation']['requests_per_s']:.3f}",
              flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--types", default=TYPES)
    p.add_argument("--slo", default="ttft:p90<2s")
    p.add_argument("--capacity-timeout", default="4m")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    print("(a, b) batch-1 decode per weight type vs the bandwidth bound; client vs server timings")
    out: dict = {"roofline": roofline_rows(args.types.split(","))}
    ok = [r for r in out["roofline"] if "error" not in r and r["percent"] is not None]
    if ok:
        best = max(ok, key=lambda r: r["percent"])
        print(f"(a) best: {best['type']} at {best['percent']:.1f}% of the bound (goal >= 60%)")
        gaps = sorted(r["ttft_gap_ms"] for r in ok if r["ttft_gap_ms"] is not None)
        if gaps:
            print(f"(b) TTFT minus server prompt time, median over types: {gaps[len(gaps) // 2]:+.2f} ms "
                  "(goal < 1 ms)")
    if not args.skip_capacity:
        print(f"(c) capacity at SLO {args.slo}, same workload (in 64:192, out 24:48), side by side")
        out["capacity"] = capacity_rows(args.slo, args.capacity_timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
