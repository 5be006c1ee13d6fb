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
from typing import Any

from tuner.config import DEVICES, ENGINE_NAMES, FORMATS, GGUF_TYPES, KV_TYPES
from tuner.engines.registry import backend, names


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tuner.evaldata import DEFAULT_SUITE
    from tuner.kld import DEFAULT_KLD_TOKENS
    from tuner.quality import DEFAULT_CONFIDENCE, DEFAULT_LIMIT, DEFAULT_SEED

    p = sub.add_parser("eval", help="score a configuration's quality with lm-eval",
                       description="Accuracy on offline benchmarks (lm-eval), accuracy drop (paired on the same items) "
                                   "and KL divergence against the fp32 model of the same weights, and a gate on a "
                                   "quality budget. Results are cached.")
    p.add_argument("--model", required=True, help="alias (see `tuner models`), checkpoint directory or .gguf file")
    p.add_argument("--engine", default="transformers", metavar="ENGINE",
                   help=f"engine whose served model is scored: {' | '.join(ENGINE_NAMES)} (default transformers; "
                        "llamacpp: the exact GGUF and KV type, by llama-perplexity)")
    p.add_argument("--quant", default=None, metavar="FORMAT",
                   help=f"transformers: {', '.join(FORMATS)} (default bf16); llamacpp: {', '.join(GGUF_TYPES)} "
                        "(default F16)")
    p.add_argument("--kv-type", default="auto", help=f"KV-cache type, llamacpp: {', '.join(KV_TYPES['llamacpp'])}")
    p.add_argument("--endpoint", metavar="URL", default=None,
                   help="score a running OpenAI-compatible server at URL through its /v1/completions (engine endpoint;"
                        " API key from $TUNER_API_KEY) against the fp32 model named by --model")
    p.add_argument("--served-model", metavar="NAME", default="",
                   help="endpoint: the model name to request (default: the first of its /v1/models)")
    p.add_argument("--tasks", default=None,
                   help=f"comma-separated tasks from evals/ (default: {','.join(DEFAULT_SUITE)})")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"items per task (default {DEFAULT_LIMIT})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"lm-eval random seed (default {DEFAULT_SEED})")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where to run the model (default auto)")
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


def _pp(x: float) -> str:
    return f"{x:+.1f}"


def format_table(res: dict[str, Any]) -> str:
    """Per task: accuracy ± stderr, items, fp32 baseline, paired drop [lower, upper] and McNemar p; then the suite
    line, KLD, and the gate line when there is one."""
    cfg = res["config"]
    limit = "- (lm-eval skipped)" if res["limit"] is None else res["limit"]
    engine = backend(cfg.get("engine", "transformers"))
    head = f"{cfg['model']}  {cfg['quant']}  limit {limit}  seed {res['seed']}"
    if engine.server:  # the engine's own format: its name, weight type and KV type
        head = (f"{cfg['model']}  {engine.name} {cfg['quant']} KV {cfg.get('kv_type', 'auto')}  limit {limit}  "
                f"seed {res['seed']}")
    base_name = engine.reference_quant
    if not engine.launched:  # a running server: its URL
        head = f"{cfg['model']}  {engine.name} {cfg.get('endpoint')}  limit {limit}  seed {res['seed']}"
    if res.get("cached"):
        head += "  (cached)"
    lines = [head]
    paired = res.get("paired")
    if "tasks" in res and paired is not None:
        conf = f"{paired['confidence']:g}"
        lines.append(f"{'task':<16}{'metric':<14}{'acc':>8}   {'± stderr':<9}{'n':>6}{base_name:>8}{'drop pp':>9}"
                     f"  {'[lower, upper] @' + conf:<20}{'McNemar p':>10}")
        for name, t in res["tasks"].items():
            base = res["baseline_tasks"].get(name, {}).get("acc")
            base_s = f"{base:>8.4f}" if base is not None else f"{'':>8}"
            pt = paired["tasks"].get(name)
            pair = (f"{_pp(pt['drop_pp']):>9}  {'[' + _pp(pt['ci_pp'][0]) + ', ' + _pp(pt['ci_pp'][1]) + ']':<20}"
                    f"{pt['mcnemar_p']:>10.3f}") if pt else f"{'':>9}  {'(no paired items)':<20}"
            lines.append(f"{name:<16}{t['metric']:<14}{t['acc']:>8.4f}   ± {t['acc_stderr']:<7.4f}{t['n']:>6}"
                         f"{base_s}{pair}")
        ci = paired["ci_pp"]
        lines.append(f"{'suite (mean)':<30}{res['score']:>8.4f}   ± {res['score_stderr']:<7.4f}{paired['items']:>6}"
                     f"{res['baseline_score']:>8.4f}{_pp(paired['drop_pp']):>9}  "
                     f"{'[' + _pp(ci[0]) + ', ' + _pp(ci[1]) + ']':<20}"
                     f"  discordance {paired['discordance'] * 100:.1f}%")
    lines.append(f"KLD vs {base_name} over {res['kld_tokens']} tokens: mean {res['kld_mean']:.5f} ± {res['kld_mean_stderr']:.5f}"
                 f"  p99 {res['kld_p99']:.4f}  top-1 agreement {res['top1_agree'] * 100:.2f}%")
    gate = res.get("gate")
    if gate is not None:
        lines.extend(format_gate(gate))
    if "wall_s" in res:
        lines.append(f"wall {res['wall_s']:.1f} s")
    return "\n".join(lines)


def format_gate(gate: dict[str, Any]) -> list[str]:
    screen = gate.get("screen")
    if screen is not None and not screen["passed"]:
        reason = screen.get("reason") or (f"mean {screen['kld_mean']:.5f} nats > --max-kld {screen['max_kld']:g}: "
                                          "screened out before lm-eval")
        return [f"gate: {gate['verdict'].upper()}  KLD screen: {reason} (lm-eval tasks skipped)",
                f"  baseline: {gate['baseline']}"]
    lo, hi = gate["drop_ci_pp"]
    line = (f"gate: {gate['verdict'].upper()}  drop {_pp(gate['drop_pp'])} pp [{_pp(lo)}, {_pp(hi)}] vs budget "
            f"{gate['budget_pp']:g} pp at {gate['confidence']:g} (one-sided bounds"
            + (f", over {gate['looks']} look(s) at {gate['confidence_per_look']:.4g} each" if gate.get("looks") else "")
            + "); detectable "
            f"{gate['detectable_pp']:.2f} pp with {gate['items']} paired items (--limit {gate['limit']})")
    out = [line]
    if gate.get("escalated_limits"):
        out.append(f"  escalated: --limit {' -> '.join(str(x) for x in gate['escalated_limits'])}")
    if screen is not None:
        out.append(f"  KLD screen passed: mean {screen['kld_mean']:.5f} <= {screen['max_kld']:g} nats")
    if gate.get("warning"):
        out.append(f"  warning: {gate['warning']}")
    out.append(f"  baseline: {gate['baseline']}")
    return out


def run(args: argparse.Namespace) -> int:
    from tuner.cli.common import write_json_atomic
    from tuner.config import TrialConfig
    from tuner.errors import TunerError
    from tuner.evaldata import set_offline

    t0 = time.perf_counter()
    if args.json and Path(args.json).expanduser().is_dir():
        raise TunerError(f"--json {args.json!r} is a directory: expected a file path")
    from tuner.eval_run import check_eval_settings, evaluate

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
    if args.json:
        write_json_atomic(Path(args.json).expanduser(), res)
    return 0
