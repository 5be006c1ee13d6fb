"""`tuner eval`: score a configuration's quality offline with lm-eval, against the fp32 baseline of the same weights.

    tuner eval --model smollm2-135m --quant bnb-nf4 --limit 100 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tuner.config import DEVICES, FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tuner.evaldata import DEFAULT_SUITE
    from tuner.kld import DEFAULT_KLD_TOKENS
    from tuner.quality import DEFAULT_LIMIT, DEFAULT_SEED

    p = sub.add_parser("eval", help="score a configuration's quality with lm-eval",
                       description="Accuracy on offline benchmarks (lm-eval), accuracy drop and KL divergence "
                                   "against the fp32 model of the same weights. Results are cached.")
    p.add_argument("--model", required=True, help="alias (see `tuner models`), checkpoint directory or .gguf file")
    p.add_argument("--quant", default="bf16", metavar="FORMAT", help=f"quantization format: {', '.join(FORMATS)}")
    p.add_argument("--tasks", default=None,
                   help=f"comma-separated tasks from evals/ (default: {','.join(DEFAULT_SUITE)})")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"items per task (default {DEFAULT_LIMIT})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"lm-eval random seed (default {DEFAULT_SEED})")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where to run the model (default auto)")
    p.add_argument("--kld-tokens", type=int, default=DEFAULT_KLD_TOKENS,
                   help=f"held-text tokens scored for KL divergence (default {DEFAULT_KLD_TOKENS})")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON to PATH")
    p.add_argument("--results-dir", metavar="DIR", default=None,
                   help="results folder holding the quality cache (default $TUNER_RESULTS or ./results)")


def format_table(res: dict[str, Any]) -> str:
    """Per-task accuracy ± stderr next to the fp32 baseline, then the suite score, drop and KLD."""
    cfg = res["config"]
    head = f"{cfg['model']}  {cfg['quant']}  limit {res['limit']}  seed {res['seed']}"
    if res["cached"]:
        head += "  (cached)"
    lines = [head, f"{'task':<16}{'metric':<10}{'acc':>8}   {'± stderr':<9}{'fp32':>8}{'drop pp':>9}{'n':>7}"]
    for name, t in res["tasks"].items():
        base = res["baseline_tasks"].get(name, {}).get("acc")
        base_s = f"{base:>8.4f}" if base is not None else f"{'':>8}"
        drop = f"{(base - t['acc']) * 100:>+9.1f}" if base is not None else f"{'':>9}"
        lines.append(f"{name:<16}{t['metric']:<10}{t['acc']:>8.4f}   ± {t['acc_stderr']:<7.4f}{base_s}{drop}{t['n']:>7}")
    noise = "within noise" if res["within_noise"] else "beyond noise"
    lines.append(f"{'score (mean)':<26}{res['score']:>8.4f}   ± {res['score_stderr']:<7.4f}"
                 f"{res['baseline_score']:>8.4f}{res['drop_pp']:>+9.1f}  {noise}")
    lines.append(f"KLD vs fp32 over {res['kld_tokens']} tokens: mean {res['kld_mean']:.5f} ± {res['kld_mean_stderr']:.5f}"
                 f"  p99 {res['kld_p99']:.4f}  top-1 agreement {res['top1_agree'] * 100:.2f}%")
    lines.append(f"wall {res['wall_s']:.1f} s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tuner.config import TrialConfig
    from tuner.errors import TunerError
    from tuner.evaldata import set_offline

    if args.json and Path(args.json).expanduser().is_dir():
        raise TunerError(f"--json {args.json!r} is a directory: expected a file path")
    set_offline()
    if args.results_dir:
        os.environ["TUNER_RESULTS"] = str(Path(args.results_dir).expanduser())
    from tuner.quality import score_quality

    config = TrialConfig(model=args.model, quant=args.quant, device=args.device)
    result = score_quality(config, args.tasks, args.limit, args.seed, kld_tokens=args.kld_tokens)
    res = result.to_dict()
    print(format_table(res))
    if args.json:
        path = Path(args.json).expanduser()
        if path.parent != Path():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
    return 0
