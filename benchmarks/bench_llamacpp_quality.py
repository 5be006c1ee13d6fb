"""Quality of what llama.cpp serves (tuner.quality.llamacpp, llama-perplexity on the exact GGUF + KV type), in one run:

(a) cross-check: the F32 GGUF scored by llama-perplexity vs the transformers fp32 model of the same weights scored by
    an independent implementation of llama.cpp's rule (mean log-prob per token after the shared prefix; the scorer of
    tests/test_llamacpp_quality.py), same lm-eval items: accuracy each, difference vs its stderr, item agreement.
(b) the ladder: per weight type and KV type, GGUF size, mean KLD vs F32/f32, top-1 agreement, the suite's paired
    drop with its one-sided bounds, and the gate's verdict at the budget.

Usage: .venv/bin/python benchmarks/bench_llamacpp_quality.py [--limit 200] [--tasks arc_easy,piqa] [--budget 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = "smollm2-135m"
LADDER = [("F16", "auto"), ("Q8_0", "auto"), ("Q6_K", "auto"), ("Q4_K_M", "auto"), ("Q4_0", "auto"),
          ("Q8_0", "q8_0"), ("Q8_0", "q4_0")]


def crosscheck(task: str, limit: int) -> None:
    from tests.test_llamacpp_quality import token_mean_choice
    from tuner.config import TrialConfig
    from tuner.quality.gate import score_quality
    from tuner.quality.llamacpp import choice_tasks
    from tuner.quantize import load_model

    res = score_quality(TrialConfig(model=MODEL, engine="llamacpp", quant="F32", kv_type="f32"), (task,), limit,
                        1234, kld_tokens=255, progress=False)
    llama = dict(res.tasks[0].items)
    model, tok = load_model(TrialConfig(model=MODEL, quant="fp32"))
    items = choice_tasks(task, limit)
    hf = {str(t.doc_id): float(token_mean_choice(model, tok, t.question, t.answers) == t.gold) for t in items}
    n = len(hf)
    a_l, a_h = sum(llama.values()) / n, sum(hf.values()) / n
    se = math.sqrt(a_h * (1 - a_h) / (n - 1))
    agree = sum(llama[k] == hf[k] for k in hf) / n
    print(f"  {task:<14} n={n}  llama-perplexity F32 {a_l:.4f}  transformers fp32 {a_h:.4f} ± {se:.4f}  "
          f"diff {a_l - a_h:+.4f} ({abs(a_l - a_h) / se if se else 0:.2f} stderr)  item agreement {agree:.1%}",
          flush=True)


def ladder(tasks: tuple[str, ...], limit: int, budget: float, kld_tokens: int) -> None:
    from tuner.config import TrialConfig
    from tuner.engines.llamacpp import quantized_gguf
    from tuner.quality.gate import gated_quality

    print(f"  {'weights':<8}{'KV':<6}{'MB':>7}{'KLD mean':>11}{'top-1':>8}{'drop pp':>9}{'[lower, upper]':>18}  verdict",
          flush=True)
    for quant, kv in LADDER:
        cfg = TrialConfig(model=MODEL, engine="llamacpp", quant=quant, kv_type=kv)
        g = gated_quality(cfg, tasks, limit, 1234, max_drop_pp=budget, kld_tokens=kld_tokens, progress=False)
        r, gate = g.result, g.gate
        size = quantized_gguf(MODEL, quant).stat().st_size / 1e6
        lo, hi = gate["drop_ci_pp"]
        print(f"  {quant:<8}{kv:<6}{size:7.1f}{r.kld_mean:11.5f}{r.top1_agree:8.1%}{gate['drop_pp']:+9.2f}"
              f"{f'[{lo:+.2f}, {hi:+.2f}]':>18}  {gate['verdict']}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--tasks", default="arc_easy,piqa")
    p.add_argument("--budget", type=float, default=2.0)
    p.add_argument("--kld-tokens", type=int, default=2040)
    args = p.parse_args()
    tasks = tuple(args.tasks.split(","))
    os.environ["TUNER_RESULTS"] = os.environ.get("TUNER_RESULTS") or tempfile.mkdtemp(prefix="tuner-bq-")
    print(f"(a) cross-check, the same weights on two engines, same rule, same items (--limit {args.limit})")
    for t in tasks:
        crosscheck(t, args.limit)
    print(f"(b) ladder: {','.join(tasks)} x {args.limit} items, KLD over {args.kld_tokens} tokens, budget "
          f"{args.budget:g} pp, vs F32 weights + f32 KV")
    ladder(tasks, args.limit, args.budget, args.kld_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
