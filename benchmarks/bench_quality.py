"""Time `tuner eval` (score_quality) end to end on this machine: the fp32 baseline (cold), one format with the baseline
cached, and the cache hit; then print the paired comparison and the quality gate at a budget. Goal: under 3 minutes
per format for the default suite at --limit 100 on smollm2-135m.

    .venv/bin/python benchmarks/bench_quality.py [--model smollm2-135m] [--quant bnb-nf4] [--limit 100] \
        [--max-quality-drop 1.0] [--confidence 0.95]

Uses a fresh temporary results folder (so nothing is cached from earlier runs) unless --results-dir is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="bnb-nf4")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: the default suite)")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--kld-tokens", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-quality-drop", type=float, default=1.0, help="gate budget, pp (default 1.0)")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--results-dir", default=None, help="reuse this results folder instead of a fresh temporary one")
    args = p.parse_args()

    tmp = None
    if args.results_dir:
        os.environ["TUNER_RESULTS"] = args.results_dir
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-quality-")
        os.environ["TUNER_RESULTS"] = tmp.name

    import torch

    from tuner.config import TrialConfig
    from tuner.quality.evaldata import set_offline
    from tuner.quality.gate import paired_comparison, quality_gate, score_quality
    from tuner.quality.report import format_gate

    set_offline()
    config = TrialConfig(model=args.model, quant=args.quant, device=args.device)
    kw = {"kld_tokens": args.kld_tokens}
    print(f"# bench_quality: {args.model} {args.quant} limit {args.limit} seed {args.seed}, "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f} (other processes share the CPU)", flush=True)

    rows = []
    if args.quant != "fp32":
        t = time.perf_counter()
        base = score_quality(config.replace(quant="fp32"), args.tasks, args.limit, args.seed, **kw)
        rows.append(("fp32 baseline", base, time.perf_counter() - t))
    t = time.perf_counter()
    res = score_quality(config, args.tasks, args.limit, args.seed, **kw)
    rows.append((f"{args.quant}", res, time.perf_counter() - t))
    t = time.perf_counter()
    hit = score_quality(config, args.tasks, args.limit, args.seed, **kw)
    hit_s = time.perf_counter() - t
    assert hit.cached and hit.score == res.score and hit.kld_mean == res.kld_mean

    print(f"\n{'run':<16}{'cached':>7}{'wall s':>9}{'items':>7}{'items/s':>9}{'score':>8}{'kld mean':>10}{'top-1':>8}")
    for name, r, wall in rows:
        items = sum(s.n for s in r.tasks)
        rate = f"{'-':>9}" if r.cached else f"{items / wall:>9.2f}"
        print(f"{name:<16}{str(r.cached):>7}{wall:>9.1f}{items:>7}{rate}{r.score:>8.4f}"
              f"{r.kld_mean:>10.5f}{r.top1_agree:>8.3f}")
    print(f"{'cache hit':<16}{str(hit.cached):>7}{hit_s:>9.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    per_format = rows[-1][2]
    print(f"\n{args.quant}: {per_format:.1f} s with the baseline cached "
          f"({'meets' if per_format < 180 else 'MISSES'} the 3-minute goal); cache hit {hit_s * 1000:.0f} ms")
    paired = {t.name: t for t in paired_comparison(res, args.confidence).tasks}
    for s in res.tasks:
        pt = paired.get(s.name)
        pair = (f"   drop {pt.drop_pp:+.1f} pp [{pt.ci_pp[0]:+.1f}, {pt.ci_pp[1]:+.1f}]  McNemar p {pt.mcnemar_p:.3f}  "
                f"discordant {pt.only_baseline}+{pt.only_candidate}/{pt.n}") if pt else ""
        print(f"  {s.name:<14} {s.metric:<9} {s.acc:.4f} ± {s.acc_stderr:.4f}   fp32 "
              f"{next(b.acc for b in res.baseline_tasks if b.name == s.name):.4f}{pair}")
    gate = quality_gate(res, args.max_quality_drop, args.confidence)
    print("\n".join(format_gate(gate)))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
