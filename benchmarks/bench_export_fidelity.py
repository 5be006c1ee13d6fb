"""Export fidelity: re-measure the recommended config of a study from its transformers export, in a fresh process,
and print the ratio of p99 TTFT and output tok/s to the figures stored in the study (goal: within +-10%).

Usage: .venv/bin/python benchmarks/bench_export_fidelity.py --study S [--storage URL] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", required=True)
    ap.add_argument("--storage", default="sqlite:///results/tuner.db")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-"))
    exported = tmp / "exported.json"
    tuner = [sys.executable, "-m", "tuner"]
    subprocess.run([*tuner, "export", "--study", args.study, "--storage", args.storage, "--best", "--to",
                    "transformers", "-o", str(exported)], check=True, capture_output=True)
    data = json.loads(exported.read_text())
    stored = data["measured"]["metrics"]
    tok, ttft = [], []
    for i in range(args.rounds):
        out = tmp / f"bench{i}.json"
        subprocess.run([*tuner, "bench", "--config", str(exported), "--json", str(out), "--quiet", "--no-bandwidth"],
                       check=True, capture_output=True)
        m = json.loads(out.read_text())["metrics"]
        tok.append(m["output_tokens_per_s"] / stored["output_tokens_per_s"])
        ttft.append(m["ttft_ms"]["p99"] / stored["ttft_ms"]["p99"])
        print(f"round {i + 1}: output tok/s {m['output_tokens_per_s']:.2f} (stored {stored['output_tokens_per_s']:.2f},"
              f" ratio {tok[-1]:.3f}); p99 TTFT {m['ttft_ms']['p99']:.0f} ms (stored {stored['ttft_ms']['p99']:.0f},"
              f" ratio {ttft[-1]:.3f})", flush=True)
    print(f"fidelity of {data['config']}: median ratio output tok/s {statistics.median(tok):.3f}, p99 TTFT "
          f"{statistics.median(ttft):.3f} (goal 0.9-1.1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
