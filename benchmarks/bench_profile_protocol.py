"""What a shorter profile protocol would lose, from profiles already measured: each profile's fit without its long
decode waves above `--up-to` sequences, scored on the steps of those waves it left out (held out), beside the full
fit's error on the same steps. Nothing is measured; the profiles are read from `--profiles` (default: this host's
cache, $TUNER_CACHE/profiles).

Profile version 5 kept llama.cpp's long waves at every batch size because of this (2026-12-06, six version-4 profiles
of smollm2-135m at -np 16 -t 1, Q8_0/Q4_0/Q4_1 x KV auto/q8_0, measured within the hour): fitted without the long
waves above 4 sequences they predicted those waves' steps -7% to +15% off (median per profile; worst +36%), the full
fit (in sample) +0% to +6%: the context slope at 1-4 sequences differs from the one at 8-16.

Usage: .venv/bin/python benchmarks/bench_profile_protocol.py [--profiles DIR] [--up-to 4,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def held_out_errors(profile: dict[str, Any], up_to: int) -> tuple[list[float], list[float]]:
    """Relative errors (predicted - measured) / measured on the long waves' decode samples above `up_to` sequences:
    of the fit without them, and of the profile's full fit."""
    from tuner.predict.fit import fit_step_model

    s = profile["samples"]
    short = min(profile["protocol"]["decode_prompts"])
    kept = [d for d in s["decode"] if d["prompt_tokens"] == short or d["seqs"] <= up_to]
    held = [d for d in s["decode"] if not (d["prompt_tokens"] == short or d["seqs"] <= up_to)]
    gaps = [g for g in s["gaps"] if g[0] <= up_to or g[1] < g[0] * (short + profile["protocol"]["decode_tokens"] + 1)]
    full, _ = fit_step_model(s["decode"], s["prefill"], s["gaps"], s.get("mixed") or ())
    part, _ = fit_step_model(kept, s["prefill"], gaps, s.get("mixed") or ())
    return ([(part.decode_s(d["seqs"], d["context_tokens"]) - d["step_s"]) / d["step_s"] for d in held],
            [(full.decode_s(d["seqs"], d["context_tokens"]) - d["step_s"]) / d["step_s"] for d in held])


def main() -> int:
    from tuner.predict.profile import profiles_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", help="a folder of profile JSON files (default: $TUNER_CACHE/profiles)")
    ap.add_argument("--up-to", default="4,2", help="the widest batch the shorter protocol keeps long waves at")
    args = ap.parse_args()
    folder = Path(args.profiles) if args.profiles else profiles_dir()
    for path in sorted(folder.glob("*.json")):
        p = json.loads(path.read_text())
        if not p.get("samples", {}).get("decode"):
            continue
        fmt = p["key"]["format"]
        name = f"{p['key']['engine']} {fmt.get('quant')} kv {fmt.get('kv_type', '-')} cap {p['batch_cap']}"
        parts = []
        for up in (int(u) for u in args.up_to.split(",")):
            part, full = held_out_errors(p, up)
            if not part:
                parts.append(f"long waves above {up}: none measured")
                continue
            parts.append(f"long waves above {up} held out (n={len(part)}): without them median "
                         f"{statistics.median(part):+.1%}, worst {max(part, key=abs):+.1%}; the full fit median "
                         f"{statistics.median(full):+.1%}, worst {max(full, key=abs):+.1%}")
        print(f"{name} ({path.name}, version {p.get('version')}): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
