"""What a shorter profile protocol would lose, from profiles already measured: each profile refitted without some of
its samples, scored on the samples it left out (held out), beside the full fit's error on the same samples. Nothing
is measured; the profiles are read from `--profiles` (a folder of profile JSON files, or one .json.gz file holding a
list of them; default: this host's cache, $TUNER_CACHE/profiles). Two shorter protocols:

* `--drop long-waves` (`--up-to 4,2`): without the long decode waves above `up_to` sequences. Profile version 5 kept
  llama.cpp's long waves at every batch size because of this (2026-12-06, six version-4 profiles of smollm2-135m at
  -np 16 -t 1, Q8_0/Q4_0/Q4_1 x KV auto/q8_0, measured within the hour): fitted without the long waves above 4
  sequences they predicted those waves' steps -7% to +15% off (median per profile; worst +36%), the full fit (in
  sample) +0% to +6%: the context slope at 1-4 sequences differs from the one at 8-16. vLLM's version 12 protocol
  (long prompts up to 16 sequences, `Protocol.long_waves_to`) came from `--up-to 16,8` on its three profiles at
  `--max-num-seqs 32` (bf16 and fp32 of version 8 in benchmarks/data/profiles-vllm-2026-12-06-v8.json.gz, bf16 of
  version 10 in profiles-2026-12-06-v10.json.gz): the 32-sequence long steps left out predicted -5.4%, +1.5%, +3.0%
  off (median per profile; worst -12.5%), the full fit +0.2% to +0.4%; up to 8 sequences, -22.7% in one of them.
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
* `--drop levels` (`--levels 1,4,16`): without the waves at the other concurrencies (the cap kept), predicted there by
  interpolating between the batch sizes kept. Rejected for version 10 (2026-12-06, six version-8 transformers profiles
  at cap 16, benchmarks/data/profiles-transformers-2026-12-06-v8.json.gz, and two version-9 vLLM profiles at
  --max-num-seqs 8, profiles-vllm-2026-12-06-v9.json.gz): the left-out concurrencies' steps -16% to +3% off
  (median per profile; vLLM -17% and -14%), the full fit within 1%: a step is not linear in the batch from 1 to 16.
* `--drop tail` (`--tokens 16 --from-k 1`): each decode wave as if it had asked `tokens` tokens out from `from_k`
  sequences on (each request's kept gaps ending `decode_tokens - tokens` steps sooner), scored on all the profile's
  decode samples. Version 10 from this (the same eight profiles; 16 tokens flat cuts more than version 10, whose waves
  ask 16 more than the steps their prompts take to get in): median -0.1% to +1.1% off per profile (worst 9-27%), the
  full fit 0.0% to +1.0% (worst 8-19%); and (`--drop second-wave --wide 2 --prefill-repeats 2`, same profiles) the
  third prefill repeat left out predicted median -1.6% to +2.8% off, by the full fit -1.4% to +2.2%.
  From version 10 on a wave asks its entry's steps + `decode_steps`, and `tokens` is then the steps past the entry.
  vLLM's 16 kept (2026-12-07 14:10, fifteen version-13 profiles at --max-num-seqs 32, bf16 and fp32, `--tokens 12
  --from-k 1`): waves of 12 predicted the decode samples +0.1% to +4.8% off (median per profile), the full fit -0.1%
  to +4.2%, but moved the extrapolated 32-sequence step over 330-token contexts -4.9% to +6.9% (16 x 330: -1.4% to
  +11.2%) for 3 s of an 82-88 s fp32 profile: not taken.

Usage: .venv/bin/python benchmarks/bench_profile_protocol.py [--profiles DIR|FILE.json.gz]
           [--drop long-waves --up-to 4,2 | --drop second-wave --wide 8 --prefill-repeats 2 [--write DIR]
            | --drop levels --levels 1,4,16 | --drop tail --tokens 16 --from-k 1 [--write DIR]]
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
    from tuner.predict.waves import DECODE_TOKENS

    out = profile["protocol"].get("decode_tokens", DECODE_TOKENS)  # version 10 on: short waves ask fewer (16 + entry)
    gaps = [g for g in s["gaps"] if g[0] <= up_to or g[1] < g[0] * (short + out + 1)]
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


def without_levels(profile: dict[str, Any], keep: set[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The samples without the decode waves at the concurrencies not in `keep` (the cap always kept: the widest a
    profile covers), and the decode samples left out: what the profile predicts there by interpolating between the
    batch sizes it kept."""
    s = profile["samples"]
    kept_k = keep | {profile["batch_cap"]}
    return ({**s, "decode": [d for d in s["decode"] if d["seqs"] in kept_k],
             "gaps": [g for g in s["gaps"] if g[0] in kept_k]},
            [d for d in s["decode"] if d["seqs"] not in kept_k])


def request_runs(gaps: list[Any]) -> list[list[Any]]:
    """The stored gaps cut into one request's each: a request's gaps extend its context by its wave's k a step."""
    out: list[list[Any]] = []
    for g in gaps:
        if not out or g[0] != out[-1][-1][0] or g[1] != out[-1][-1][1] + g[0]:
            out.append([])
        out[-1].append(g)
    return out


def with_shorter_waves(profile: dict[str, Any], tokens: int, from_k: int) -> tuple[dict[str, Any], list[Any]]:
    """The samples as waves of `tokens` output tokens (instead of the profile's) would have given them, from `from_k`
    sequences on: each request's kept gaps end `decode_tokens - tokens` steps earlier (the wave's first finish
    comes that much sooner; every request decodes in the same steps), summarised again per quarter (a wave: k
    requests in a row); and all the profile's decode samples, held out (the full fit's own, in sample)."""
    from tuner.predict.waves import decode_samples

    proto = profile["protocol"]
    # version 10 on, a wave asks its entry's steps + decode_steps: `tokens` is then the steps asked past the entry
    s, cut = profile["samples"], (proto["decode_steps"] if proto.get("decode_steps") else proto["decode_tokens"]) - tokens
    lengths = sorted(profile["protocol"]["decode_prompts"])
    gaps, decode = [], []
    wave: list[Any] = []
    n = 0
    for run in request_runs(s["gaps"]):
        k = run[0][0]
        kept = run[:max(0, len(run) - cut)] if k >= from_k else run
        gaps += kept
        wave, n = wave + kept, n + 1
        if n == k:
            if wave:
                p = max(x for x in lengths if x * k <= min(g[1] for g in wave))
                decode += [dict(d, prompt_tokens=p) for d in decode_samples(wave)]
            wave, n = [], 0
    return {**s, "decode": decode, "gaps": gaps}, s["decode"]


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
    ap.add_argument("--drop", choices=("long-waves", "second-wave", "levels", "tail"), default="long-waves")
    ap.add_argument("--up-to", default="4,2", help="long-waves: the widest batch the shorter protocol keeps them at")
    ap.add_argument("--wide", type=int, default=8, help="second-wave: one wave per length from this many sequences")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="second-wave: prefill repeats kept per length")
    ap.add_argument("--levels", default="1,4,16", help="levels: the concurrencies whose waves are kept (and the cap)")
    ap.add_argument("--tokens", type=int, default=16, help="tail: the output tokens of each decode wave")
    ap.add_argument("--from-k", type=int, default=2, help="tail: the shorter waves from this many sequences on")
    ap.add_argument("--write", help="second-wave, levels, tail: write the reduced, refitted profiles into this folder")
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
                 [(f"waves of {args.tokens} tokens from {args.from_k} sequences",
                   with_shorter_waves(p, args.tokens, args.from_k))] if args.drop == "tail" else
                 [(f"waves at concurrencies but {args.levels} and the cap",
                   without_levels(p, {int(k) for k in args.levels.split(",")}))] if args.drop == "levels" else
                 [(f"second waves from {args.wide} sequences, prefill past {args.prefill_repeats} repeats",
                   without_second_waves(p, args.wide, args.prefill_repeats))])
        parts = []
        for what, (samples, held) in cases:
            part, fit = fit_step_model(samples["decode"], samples["prefill"], samples["gaps"],
                                       samples.get("mixed") or ())
            left = [x for x in s["prefill"] if x not in samples["prefill"]]  # prefill repeats left out
            if left:
                e_out, e_in = ([(m.prefill_s(x["prompt_tokens"]) - x["ttft_s"]) / x["ttft_s"] for x in left]
                               for m in (part, full))
                parts.append(f"the prefill TTFTs left out (n={len(left)}): without them median "
                             f"{statistics.median(e_out):+.1%}, worst {max(e_out, key=abs):+.1%}; the full fit median "
                             f"{statistics.median(e_in):+.1%}, worst {max(e_in, key=abs):+.1%}")
            if not held:
                parts.append(f"{what}: none measured")
                continue
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
