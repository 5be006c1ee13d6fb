"""What a shorter profile protocol would lose, from profiles already measured: each profile refitted without some of
its samples, scored on the samples it left out (held out), beside the full fit's error on the same samples. Nothing
is measured; the profiles are read from `--profiles` (a folder of profile JSON files, or one .json.gz file holding a
list of them; default: this host's cache, $TUNER_CACHE/profiles). Two shorter protocols:

* `--drop long-waves` (`--up-to 4,2`): without the long decode waves above `up_to` sequences. Profile version 5 kept
  llama.cpp's long waves at every batch size because of this (2026-12-06, six version-4 profiles of smollm2-135m at
  -np 16 -t 1, Q8_0/Q4_0/Q4_1 x KV auto/q8_0, measured within the hour): fitted without the long waves above 4
  sequences they predicted those waves' steps -7% to +15% off (median per profile; worst +36%), the full fit (in
  sample) +0% to +6%: the context slope at 1-4 sequences differs from the one at 8-16.
* `--drop second-wave` (`--wide 8 --prefill-repeats 2`): without the second decode wave of each length from `wide`
  sequences on and the prefill repeats past `prefill_repeats` (profile version 7's llama.cpp protocol). `--write DIR`
  also writes the reduced profiles there (refitted, marked as this tuner's profile version with a note saying what
  was left out, as profiles of a TUNER_CACHE), for
  benchmarks/bench_predict_accuracy.py to score on a measured grid (`TUNER_CACHE=<a copy with DIR as profiles>
  ... --no-measure`). Version 7 came from this (2026-12-06 15:35-15:42, the six version-6 profiles in
  benchmarks/data/profiles-llamacpp-2026-12-06-v6.json.gz): the left-out steps of the second waves at 8 and 16
  sequences predicted +0.5% to +2.5% off (median per profile; worst 16%), the full fit +0.2% to +4.2% (worst 15%).
  Version 8's transformers protocol from `--wide 2 --prefill-repeats 3` (2026-12-06 18:36-18:50, four version-7
  profiles of smollm2-135m at cap 16, fp32/bf16/bnb-nf4/torchao-int8wo, in
  benchmarks/data/profiles-transformers-2026-12-06-v7.json.gz): the left-out second waves at 2-16 sequences
  predicted -2.8% to +3.4% off (median per profile; worst 15-80%), the full fit -0.3% to +13.4% (worst 15-41%).

Usage: .venv/bin/python benchmarks/bench_profile_protocol.py [--profiles DIR|FILE.json.gz]
           [--drop long-waves --up-to 4,2 | --drop second-wave --wide 8 --prefill-repeats 2 [--write DIR]]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any


def errors(model: Any, samples: list[dict[str, Any]]) -> list[float]:
    """(predicted - measured) / measured of each decode sample's step time."""
    return [(model.decode_s(d["seqs"], d["context_tokens"]) - d["step_s"]) / d["step_s"] for d in samples]


def without_long_waves(profile: dict[str, Any], up_to: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The samples without the long waves above `up_to` sequences, and the decode samples left out."""
    s = profile["samples"]
    short = min(profile["protocol"]["decode_prompts"])
    kept = [d for d in s["decode"] if d["prompt_tokens"] == short or d["seqs"] <= up_to]
    held = [d for d in s["decode"] if not (d["prompt_tokens"] == short or d["seqs"] <= up_to)]
    gaps = [g for g in s["gaps"] if g[0] <= up_to or g[1] < g[0] * (short + profile["protocol"]["decode_tokens"] + 1)]
    return {**s, "decode": kept, "gaps": gaps}, held


def runs(rows: list[Any], context: Any) -> list[list[Any]]:
    """`rows` (one concurrency's, in the order measured) cut where the context stops growing: a wave's decode
    samples (its quarters), or one request's gaps."""
    out: list[list[Any]] = []
    for row in rows:
        if not out or context(row) <= context(out[-1][-1]):
            out.append([])
        out[-1].append(row)
    return out


def without_second_waves(profile: dict[str, Any], wide: int,
                         prefill_repeats: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The samples without every decode wave but the first of each length from `wide` sequences on and the prefill
    repeats past `prefill_repeats`; and the decode samples left out. The raw gaps (the noise estimate alone) of
    those waves are left out too, cut by request: the first k runs of each length."""
    s, waves = profile["samples"], profile["protocol"]["decode_waves"]
    lengths = profile["protocol"]["decode_prompts"]
    kept, held = [], []
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for d in s["decode"]:
        groups.setdefault((d["seqs"], d["prompt_tokens"]), []).append(d)
    for (k, _), rows in groups.items():
        cut = runs(rows, lambda d: d["context_tokens"])
        kept += [d for w in (cut[:1] if k >= wide else cut) for d in w]
        held += [d for w in (cut[1:] if k >= wide else []) for d in w]
    gaps: list[Any] = []
    by_k: dict[int, list[Any]] = {}
    for g in s["gaps"]:
        by_k.setdefault(g[0], []).append(g)
    for k, rows in by_k.items():
        if k < wide:
            gaps += rows
            continue
        cut = runs(rows, lambda g: g[1])
        per_length = len(cut) // len(lengths)
        for i in range(len(lengths)):
            gaps += [g for r in cut[i * per_length:i * per_length + max(1, per_length // waves)] for g in r]
    count: dict[int, int] = {}
    prefill = []
    for x in s["prefill"]:
        count[x["prompt_tokens"]] = count.get(x["prompt_tokens"], 0) + 1
        if count[x["prompt_tokens"]] <= prefill_repeats:
            prefill.append(x)
    return {**s, "decode": kept, "gaps": gaps, "prefill": prefill}, held


def read_profiles(where: Path) -> list[tuple[str, dict[str, Any]]]:
    if where.is_file():
        with gzip.open(where, "rt", encoding="utf-8") as f:
            return [(f"{p['id']}.json", p) for p in json.load(f)]
    return [(path.name, json.loads(path.read_text())) for path in sorted(where.glob("*.json"))]


def main() -> int:
    from tuner.predict.fit import fit_step_model
    from tuner.predict.profile import VERSION, profiles_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", help="a folder of profile JSON files or a .json.gz list of profiles "
                                       "(default: $TUNER_CACHE/profiles)")
    ap.add_argument("--drop", choices=("long-waves", "second-wave"), default="long-waves")
    ap.add_argument("--up-to", default="4,2", help="long-waves: the widest batch the shorter protocol keeps them at")
    ap.add_argument("--wide", type=int, default=8, help="second-wave: one wave per length from this many sequences")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="second-wave: prefill repeats kept per length")
    ap.add_argument("--write", help="second-wave: write the reduced, refitted profiles into this folder")
    args = ap.parse_args()
    for name, p in read_profiles(Path(args.profiles) if args.profiles else profiles_dir()):
        s = p.get("samples", {})
        if not s.get("decode"):
            continue
        fmt = p["key"]["format"]
        title = f"{p['key']['engine']} {fmt.get('quant')} kv {fmt.get('kv_type', '-')} cap {p['batch_cap']}"
        full, _ = fit_step_model(s["decode"], s["prefill"], s["gaps"], s.get("mixed") or ())
        cases = ([(f"long waves above {up}", without_long_waves(p, up)) for up in map(int, args.up_to.split(","))]
                 if args.drop == "long-waves" else
                 [(f"second waves from {args.wide} sequences, prefill past {args.prefill_repeats} repeats",
                   without_second_waves(p, args.wide, args.prefill_repeats))])
        parts = []
        for what, (samples, held) in cases:
            if not held:
                parts.append(f"{what}: none measured")
                continue
            part, fit = fit_step_model(samples["decode"], samples["prefill"], samples["gaps"],
                                       samples.get("mixed") or ())
            e_part, e_full = errors(part, held), errors(full, held)
            parts.append(f"{what} held out (n={len(held)}): without them median {statistics.median(e_part):+.1%}, "
                         f"worst {max(e_part, key=abs):+.1%}; the full fit median {statistics.median(e_full):+.1%}, "
                         f"worst {max(e_full, key=abs):+.1%}")
            if args.write:
                out = Path(args.write)
                out.mkdir(parents=True, exist_ok=True)
                note = (f"reduced from a version-{p.get('version')} profile by bench_profile_protocol.py: {what} "
                        "left out")
                (out / name).write_text(json.dumps({**p, "version": VERSION, "fit": fit, "samples": samples,
                                                    "notes": list(p.get("notes") or []) + [note]}), encoding="utf-8")
        print(f"{title} ({name}, version {p.get('version')}): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
