"""`tuner eval`: accuracy on offline lm-eval tasks, the drop against the fp32 baseline of the same weights paired
on the same items, KL divergence, and (with --max-quality-drop) the gate's verdict.

    tuner eval --model smollm2-135m --quant bnb-nf4 --limit 100 --json out.json
    tuner eval --model smollm2-135m --quant bf16 --limit 50 --max-quality-drop 2 --max-limit 400 [--max-kld 0.05]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tuner.config import DEVICES, ENGINE_NAMES, FORMATS, GGUF_TYPES, KV_TYPES, TrialConfig
from tuner.engines.registry import backend, names


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tuner.quality.evaldata import DEFAULT_SUITE
    from tuner.quality.gate import DEFAULT_CONFIDENCE, DEFAULT_LIMIT, DEFAULT_SEED
    from tuner.quality.kld import DEFAULT_KLD_TOKENS

    p = sub.add_parser("eval", help="score a configuration's quality with lm-eval",
                       description="Accuracy on offline benchmarks (lm-eval), accuracy drop (paired on the same items) "
                                   "and KL divergence against the fp32 model of the same weights, and a gate on a "
                                   "quality budget. Results are cached.")
    p.add_argument("--model", required=True, help="alias (see `tuner models`), checkpoint directory or .gguf file")
    engine = TrialConfig.engine
    p.add_argument("--engine", default=engine, metavar="ENGINE",
                   help=f"engine whose served model is scored: {' | '.join(ENGINE_NAMES)} (default {engine}; "
                        "llamacpp: the exact GGUF and KV type, by llama-perplexity)")
    p.add_argument("--quant", default=None, metavar="FORMAT",
                   help=f"transformers: {', '.join(FORMATS)} (default {backend('transformers').default_quant}); "
                        f"llamacpp: {', '.join(GGUF_TYPES)} (default {backend('llamacpp').default_quant})")
    p.add_argument("--kv-type", default=TrialConfig.kv_type,
                   help=f"KV-cache type, llamacpp: {', '.join(KV_TYPES['llamacpp'])} (default {TrialConfig.kv_type})")
    p.add_argument("--endpoint", metavar="URL", default=None,
                   help="score a running OpenAI-compatible server at URL through its /v1/completions (engine endpoint;"
                        " API key from $TUNER_API_KEY) against the fp32 model named by --model")
    p.add_argument("--served-model", metavar="NAME", default=TrialConfig.served_model,
                   help="endpoint: the model name to request (default: the first of its /v1/models)")
    p.add_argument("--tasks", default=None,
                   help=f"comma-separated tasks from evals/ (default: {','.join(DEFAULT_SUITE)})")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"items per task (default {DEFAULT_LIMIT})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"lm-eval random seed (default {DEFAULT_SEED})")
    p.add_argument("--device", default=TrialConfig.device, choices=DEVICES,
                   help=f"where to run the model (default {TrialConfig.device})")
    p.add_argument("--kld-tokens", type=int, default=DEFAULT_KLD_TOKENS,
                   help=f"held-text tokens scored for KL divergence (default {DEFAULT_KLD_TOKENS})")
    g = p.add_argument_group("quality gate")
    g.add_argument("--max-quality-drop", type=float, default=None, metavar="PP",
                   help="budget: the largest accuracy drop vs fp32 allowed, in percentage points (>= 0); prints the "
                        "verdict within | exceeds | indeterminate")
    g.add_argument("--max-limit", type=int, default=None, metavar="N",
                   help="while the verdict is indeterminate, double --limit up to N (default: --limit, no escalation)")
    g.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE, metavar="C",
                   help=f"confidence of each one-sided bound, in (0.5, 1) (default {DEFAULT_CONFIDENCE})")
    g.add_argument("--max-kld", type=float, default=None, metavar="NATS",
                   help="screen first: a mean KLD vs fp32 above this is `exceeds` without running the lm-eval tasks")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON to PATH")
    p.add_argument("--results-dir", metavar="DIR", default=None,
                   help="results folder holding the quality cache (default $TUNER_RESULTS or ./results)")


def run(args: argparse.Namespace) -> int:
    from tuner.cli.common import check_output_path, write_json_atomic
    from tuner.config import TrialConfig
    from tuner.quality.evaldata import set_offline

    t0 = time.perf_counter()
    out_path = check_output_path(str(Path(args.json).expanduser()) if args.json else None)
    from tuner.quality.report import format_table
    from tuner.quality.run import check_eval_settings, evaluate

    check_eval_settings(args.max_quality_drop, args.limit, args.max_limit, args.confidence, args.max_kld)
    set_offline()
    if args.results_dir:
        os.environ["TUNER_RESULTS"] = str(Path(args.results_dir).expanduser())
    engine = args.engine
    if args.endpoint and not backend(engine).server:  # --endpoint alone: the running server is scored
        engine = names(launched=False)[0]
    quant = args.quant or backend(engine).default_quant
    config = TrialConfig(model=args.model, engine=engine, quant=quant, kv_type=args.kv_type, device=args.device,
                         endpoint=args.endpoint or "", served_model=args.served_model)
    res = evaluate(config, args.tasks, args.limit, args.seed, max_quality_drop=args.max_quality_drop,
                   max_limit=args.max_limit, confidence=args.confidence, max_kld=args.max_kld,
                   kld_tokens=args.kld_tokens)
    res["wall_s"] = time.perf_counter() - t0
    print(format_table(res))
    if out_path:
        write_json_atomic(out_path, res)
    return 0
