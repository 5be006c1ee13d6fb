"""`tuner bench`: measure one configuration under load and print/write the figures."""

from __future__ import annotations

import argparse
import re
from typing import Any

from tuner.cli.common import (
    add_config_args,
    add_workload_args,
    check_output_path,
    config_from_args,
    workload_from_args,
    write_json_atomic,
)
from tuner.errors import TunerError

_GOODPUT = re.compile(r"^(ttft|tpot|e2e):(\d+(?:\.\d+)?)$")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure one serving configuration under load",
                       description="Serve a workload on a real model with one setting of the four knobs and report "
                                   "TTFT, TPOT, ITL, E2E (p50/p90/p95/p99/mean), throughput and memory.")
    add_config_args(p)
    add_workload_args(p)
    g = p.add_argument_group("measurement")
    g.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="per-request SLO for goodput, like vLLM: ttft:300 tpot:50 (milliseconds)")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds before unfinished requests fail")
    g.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: fixed output lengths)")
    g.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth (roofline) measurement")
    g.add_argument("--stop-if", metavar="SLO", help="stop early (status pruned) if, half-way through, a bound is "
                                                   "already exceeded, e.g. 'ttft:p99<300ms'")
    g.add_argument("--json", metavar="FILE", help="write {config, metrics, ...} as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_goodput(items: list[str]) -> dict[str, float] | None:
    slo = {}
    for item in items:
        m = _GOODPUT.match(item.strip())
        if not m:
            raise TunerError(f"--goodput {item!r} is invalid: expected METRIC:MS with METRIC in ttft, tpot, e2e")
        slo[f"{m.group(1)}_ms"] = float(m.group(2))
    return slo or None


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    spec = workload_from_args(args)
    out_path = check_output_path(args.json)
    slo = parse_goodput(args.goodput)
    if args.timeout <= 0:
        raise TunerError(f"--timeout {args.timeout} is invalid: expected seconds > 0")
    from tuner.bench import BenchOptions, run_bench

    should_stop = None
    if args.stop_if:
        from tuner.bench import stop_when_past
        from tuner.targets import parse_slo

        should_stop = stop_when_past(parse_slo(args.stop_if))
    opts = BenchOptions(workload=spec, slo_ms=slo, timeout_s=args.timeout, ignore_eos=not args.respect_eos,
                        measure_bandwidth=not args.no_bandwidth, progress=not args.quiet)
    result = run_bench(config, opts, should_stop)
    if result["status"] == "unsupported":
        raise TunerError(result["reason"])
    result.pop("token_ids", None)
    print(format_report(result))
    if out_path:
        write_json_atomic(out_path, result)
    return {"ok": 0, "pruned": 3}.get(result["status"], 1)


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"config: model={c['model']} quant={c['quant']} batch_cap={c['batch_cap']} "
             f"kv_fraction={c['kv_fraction']} draft={c['draft']} device={c['device']}"]
    if result.get("engine"):
        e = result["engine"]
        lines.append(f"engine: {e['name']} on {e['device']} "
                     f"(transformers {e['versions'].get('transformers')}, torch {e['versions'].get('torch')})")
    if result["status"] != "ok":
        lines.append(f"status: {result['status'].upper()}: {result['reason']}")
    m = result.get("metrics")
    if not m:
        return "\n".join(lines)
    lines.append(f"{'metric':<10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'mean':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        lines.append(f"{key:<10}" + "".join(f"{_fmt(s[k]):>10}" for k in ("p50", "p90", "p95", "p99", "mean")))
    lines.append(f"output tok/s {_fmt(m['output_tokens_per_s'], 2)}   req/s {_fmt(m['requests_per_s'], 3)}   "
                 f"completed {m['completed']}   failed {m['failed']}   duration {_fmt(m['duration_s'], 2)} s")
    extra = f"peak RSS {_fmt(m['peak_rss_mb'], 0)} MB"
    if m.get("peak_cuda_mb") is not None:
        extra += f"   peak CUDA {_fmt(m['peak_cuda_mb'], 0)} MB"
    if m.get("acceptance_rate") is not None:
        extra += f"   draft acceptance {m['acceptance_rate']:.1%} ({m['draft_accepted']}/{m['draft_proposed']})"
    if m.get("draft_outputs_match") is not None:
        extra += f"   greedy output == no-draft output: {m['draft_outputs_match']}"
    if m.get("goodput_requests_per_s") is not None:
        extra += f"   goodput {m['goodput_requests_per_s']:.3f} req/s"
    lines.append(extra)
    r = m.get("roofline") or {}
    if r.get("bound_tokens_per_s"):
        lines.append(f"roofline: {r['bytes_per_token'] / 1e6:.0f} MB read/token, bandwidth {r['bandwidth_gbs']:.1f} "
                     f"GB/s -> bound {r['bound_tokens_per_s']:.0f} tok/s/seq; decode at "
                     f"{_fmt(r.get('percent_of_bound'))}% of bound")
    if m.get("errors"):
        lines.append("errors: " + "; ".join(m["errors"]))
    return "\n".join(lines)
