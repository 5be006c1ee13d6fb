"""The human report of one quality result: what `tuner eval` prints and an eval job's child writes to its log
(`trials/NNNN/quality.log`): per task accuracy, the fp32 baseline and the paired drop with its interval, the suite
line, KLD, and the gate's verdict."""

from __future__ import annotations

from typing import Any

from tuner.engines.registry import backend


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
