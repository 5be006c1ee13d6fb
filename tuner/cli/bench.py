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
    g.add_argument("--server-log", metavar="FILE", help="a server engine's output goes to FILE (appended; default: a "
                                                        "temporary log removed at exit)")
    add_capacity_args(p)


def add_capacity_args(p: argparse.ArgumentParser, with_switch: bool = True) -> None:
    """SLO and capacity-search flags (shared by `tuner bench --capacity` and `tuner search`)."""
    from tuner.targets import DEFAULT_ATTAINMENT, DEFAULT_LATENCY_METRIC

    g = p.add_argument_group("capacity: the highest rate served within the SLO (see tuner/capacity.py)")
    if with_switch:
        g.add_argument("--capacity", action="store_true",
                       help="measure capacity: warm-up, saturation probe, then a bracketed search over the arrival "
                            "rate for the highest rate at which every SLO term holds with confidence")
        g.add_argument("--latency-target", metavar="TIME", help="with --capacity: bound on --latency-metric (300ms)")
        g.add_argument("--latency-metric", default=DEFAULT_LATENCY_METRIC,
                       help=f"METRIC:STAT (default {DEFAULT_LATENCY_METRIC})")
        g.add_argument("--slo", help="'ttft:p99<300ms;tpot:p50<50ms' bounds and/or per-request targets "
                                     "'ttft<300ms;tpot<50ms' (with --attainment)")
    g.add_argument("--attainment", type=float, metavar="SHARE",
                   help=f"share of requests that must meet every per-request target (default {DEFAULT_ATTAINMENT})")
    g.add_argument("--confidence", type=float, default=0.95, help="confidence of every verdict (default 0.95)")
    g.add_argument("--probe-requests", metavar="A:B",
                   help="requests per rate probe: A first, pooled up to B while undecided (default: sized by the "
                        "SLO's percentile, at least 30:120; p90: 57:120)")
    g.add_argument("--max-probes", type=int, help="rate probes at most (default 5)")
    g.add_argument("--capacity-timeout", metavar="DURATION",
                   help="no new probe starts after this long (default 600s)")
    g.add_argument("--saturation-requests", type=int, metavar="N",
                   help="most requests the saturation probe sends; it stops once its steady window holds "
                        "max(in-flight, 32) completions over 10 s (default 2 x (in-flight + that))")


def recorded_slo(path: str | None) -> Any:
    """The SLO a bench or export JSON's capacity was measured under (None when it has none)."""
    import json
    from pathlib import Path

    from tuner.targets import SLO

    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    m = (data.get("measured") or data).get("metrics") if isinstance(data, dict) else None
    slo = ((m or {}).get("capacity") or {}).get("slo") if isinstance(m, dict) else None
    return SLO.from_dict(slo) if isinstance(slo, dict) else None


def capacity_defaults() -> dict[str, Any]:
    """The capacity settings' defaults, read from their one home (tuner.capacity); `probe_requests` None: sized
    by the SLO's percentile (tuner.capacity.probe_requests_for)."""
    from tuner.capacity import DEFAULT_TIMEOUT_S, CapacityOptions

    return {"probe_requests": None, "max_probes": CapacityOptions.max_probes, "timeout": f"{DEFAULT_TIMEOUT_S:g}s",
            "saturation_requests": None}


def capacity_settings(args: argparse.Namespace, base: dict[str, Any] | None = None,
                      base_name: str = "space file capacity") -> dict[str, Any]:
    """Flags, else `base` (a space file's `capacity:` section), else the defaults; validated. An error names where
    the bad value came from: the flag, or the space file's key."""
    from tuner.targets import parse_duration_s
    from tuner.workload import parse_range

    s = {**capacity_defaults(), **(base or {})}
    flags = {"probe_requests": "--probe-requests", "max_probes": "--max-probes", "timeout": "--capacity-timeout",
             "saturation_requests": "--saturation-requests"}
    where = {k: f"{base_name}.{k}" if k in (base or {}) else flag for k, flag in flags.items()}
    for key, flag in flags.items():
        attr = "capacity_timeout" if key == "timeout" else key
        if getattr(args, attr, None) is not None:
            s[key], where[key] = getattr(args, attr), flag
    probe = None if s["probe_requests"] is None else parse_range(str(s["probe_requests"]), where["probe_requests"])
    if probe is not None and probe[0] < 4:
        raise TunerError(f"{where['probe_requests']} {s['probe_requests']} is invalid: expected A:B with 4 <= A <= B")
    if isinstance(s["max_probes"], bool) or not isinstance(s["max_probes"], int) or s["max_probes"] < 1:
        raise TunerError(f"{where['max_probes']} {s['max_probes']} is invalid: expected an integer >= 1")
    sat = s["saturation_requests"]
    if sat is not None and (isinstance(sat, bool) or not isinstance(sat, int) or sat < 4):
        raise TunerError(f"{where['saturation_requests']} {sat} is invalid: expected an integer >= 4")
    return {"probe_requests": probe, "max_probes": s["max_probes"],
            "timeout_s": parse_duration_s(str(s["timeout"]), where["timeout"]), "saturation_requests": sat}


def capacity_options(args: argparse.Namespace, slo: Any, seed: int, arrival: str) -> Any:
    from tuner.capacity import CapacityOptions, probe_requests_for

    s = capacity_settings(args)
    return CapacityOptions(slo=slo, probe_requests=probe_requests_for(slo, s["max_probes"], s["probe_requests"]),
                           max_probes=s["max_probes"],
                           max_wall_s=s["timeout_s"], saturation_requests=s["saturation_requests"],
                           arrival=arrival, seed=seed)


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
    server_log = check_output_path(args.server_log, "--server-log")
    slo = parse_goodput(args.goodput)
    if args.timeout <= 0:
        raise TunerError(f"--timeout {args.timeout} is invalid: expected seconds > 0")
    from tuner.bench import BenchOptions, run_bench

    should_stop = None
    if args.stop_if:
        from tuner.bench import stop_when_past
        from tuner.targets import parse_slo

        should_stop = stop_when_past(parse_slo(args.stop_if))
    capacity = None
    if args.capacity:
        from tuner.targets import build_slo

        if args.stop_if:
            raise TunerError("--stop-if does not apply with --capacity: expected one of them (a capacity probe stops "
                             "by itself once the SLO is missed with confidence)")
        if not (args.latency_target or args.slo) and recorded_slo(args.config):
            full = recorded_slo(args.config)  # closed loop: re-measure under the SLO the export was measured with
        else:
            _, full = build_slo(args.latency_target, args.latency_metric, args.slo, args.attainment,
                                args.confidence)
        capacity = capacity_options(args, full, spec.seed, spec.arrival)
    elif args.latency_target or args.slo or args.attainment is not None:
        raise TunerError("--latency-target/--slo/--attainment need --capacity: expected --capacity, or --goodput "
                         "for a per-request SLO at one fixed load")
    if args.quiet:  # transformers' own "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    opts = BenchOptions(workload=spec, slo_ms=slo, timeout_s=args.timeout, ignore_eos=not args.respect_eos,
                        measure_bandwidth=not args.no_bandwidth, progress=not args.quiet, capacity=capacity,
                        log_path=server_log)
    from tuner.bench_run import exit_code, final_result

    result = final_result(run_bench(config, opts, should_stop))
    print(format_report(result))
    if out_path:
        write_json_atomic(out_path, result)
    return exit_code(result)


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ci(ci: Any) -> str:
    lo, hi = (ci or [None, None])
    return f"[{_fmt(lo, 0) if lo is not None else '?'}, {_fmt(hi, 0) if hi is not None else '?'}]"


def format_percentiles(m: dict[str, Any]) -> list[str]:
    """Percentile table: every value with its n, and the distribution-free 95% interval of p50 and p99."""
    lines = [f"{'metric':<10}{'n':>6}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'mean':>10}   "
             f"{'p50 95% CI':>16}{'p99 95% CI':>18}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m.get(key) or {}
        ci = s.get("ci") or {}
        lines.append(f"{key:<10}{s.get('n', 0):>6}" + "".join(f"{_fmt(s.get(k)):>10}" for k in
                                                              ("p50", "p90", "p95", "p99", "mean"))
                     + f"   {_ci(ci.get('p50')):>16}{_ci(ci.get('p99')):>18}")
    return lines


def capacity_has_point(c: dict[str, Any]) -> bool:
    return bool(c.get("requests_per_s"))


def format_capacity(c: dict[str, Any]) -> list[str]:
    from tuner.capacity import describe_conditions

    lo, hi = c["requests_per_s_ci"]
    slo = c["slo"]
    terms = list(slo["bounds"])
    if slo.get("targets_ms"):
        terms.append(f"{slo['attainment']:.0%} of requests within "
                     + ", ".join(f"{k.removesuffix('_ms')}<{v:g}ms" for k, v in slo["targets_ms"].items()))
    head = f"capacity: {c['requests_per_s']:.3f} req/s [{lo:.3f}, {hi:.3f}]"
    if c.get("output_tokens_per_s"):
        head += f" = {c['output_tokens_per_s']:.1f} output tok/s"
    looks = (c.get("method") or {}).get("looks")
    head += (f", verdict {c['verdict'].upper()} at {slo['confidence']:.0%} confidence"
             + (f" over {looks} looks" if looks else "") + f" for SLO {'; '.join(terms)}")
    sat = c["saturation"]
    steady = sat.get("steady")
    lines = [head, f"  saturation (closed loop, {sat['concurrency']} in flight, n={sat['n']}): "
                   f"{sat['requests_per_s']:.3f} req/s, {sat['output_tokens_per_s']:.1f} output tok/s"
                   + (f" (steady state: {steady['completions']} completions over {steady['seconds']:.1f} s)"
                      if steady else "")]
    lines.append(f"  {'rate req/s':>11}{'lead-in':>8}{'n':>5}{'achieved':>10}{'ttft p50':>10}{'ttft p90':>10}"
                 f"{'ttft p99':>10}{'tpot p50':>10}{'attain':>8}  verdict")
    for p in c["probes"]:
        att = "-" if p.get("attainment") is None else f"{p['attainment']:.2f}"
        lines.append(f"  {p['rate_rps']:>11.3f}{p.get('ramp', 0):>8}{p['n']:>5}{_fmt(p['achieved_rps'], 3):>10}"
                     f"{_fmt(p['ttft_ms'].get('p50'), 0):>10}{_fmt(p['ttft_ms'].get('p90'), 0):>10}"
                     f"{_fmt(p['ttft_ms'].get('p99'), 0):>10}"
                     f"{_fmt(p['tpot_ms'].get('p50'), 0):>10}{att:>8}  {p['verdict']}"
                     + (f" (stopped early: {p['stopped_early']})" if p.get("stopped_early") else "")
                     + (f" (unsteady: {p['unsteady']})" if p.get("unsteady") else ""))
    cost = c["cost"]
    lines.append(f"  cost: {cost['probes']} probes + warm-up + saturation, {cost['requests']} requests, "
                 f"{cost['wall_s']:.0f} s")
    canary = c.get("canary") or {}
    if canary.get("drift") is not None:
        steps = ", ".join(f"{_fmt(t)} {at}" for t, at in zip(canary["itl_ms"], canary["at"]))
        lines.append(f"  engine canary (one prompt, a full batch): ITL p50 ms {steps} (largest move "
                     f"{canary['drift']:+.0%} speed)")
    host = c.get("host") or {}
    if host.get("busiest"):
        b = host["busiest"]
        lines.append(f"  host ({host['cpus']} CPUs): other processes took {host['others_share']:.0%}, the hypervisor "
                     f"{host['steal_share']:.0%}, this measurement {host['own_share']:.0%} (busiest: {b['step']}, "
                     f"{b['others_share']:.0%} and {b['steal_share']:.0%})")
    again = c.get("remeasured") or {}
    for i, a in enumerate(again.get("attempts") or []):
        lines.append(f"  measurement {i + 1} of 2: {a['requests_per_s']:.3f} req/s "
                     f"[{a['requests_per_s_ci'][0]:.3f}, {a['requests_per_s_ci'][1]:.3f}] "
                     f"({a['verdict']}), {describe_conditions(a)}, {a['wall_s']:.0f} s"
                     + (" <- reported" if i == again["kept"] else ""))
    bw = (c.get("machine") or {}).get("memory_bandwidth_gbs") or [None, None]
    if None not in bw:
        lines.append(f"  machine: memory bandwidth {bw[0]:.1f} GB/s before, {bw[1]:.1f} after")
    lines.extend(f"  note: {n}" for n in c.get("notes", []))
    return lines


def format_report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"config: model={c['model']} engine={c.get('engine', 'transformers')} quant={c['quant']} "
             f"batch_cap={c['batch_cap']} kv_fraction={c['kv_fraction']} kv_type={c.get('kv_type', 'auto')} "
             f"draft={c['draft']} device={c['device']}"]
    if result.get("engine"):
        e = result["engine"]
        info = e.get("info") or {}
        if e["name"] == "endpoint":
            lines.append(f"engine: endpoint {info.get('endpoint')} serving {info.get('served_model')!r} (not launched by "
                         "tuner: its version and settings are its own; memory below is the client's)")
        elif info.get("build"):
            start = info.get("startup_s")
            lines.append(f"engine: {e['name']} ({info['build']}) on {e['device']}, started in "
                         f"{_fmt(start, 1)} s: {' '.join(info.get('argv') or [])}")
        else:
            lines.append(f"engine: {e['name']} on {e['device']} "
                         f"(transformers {e['versions'].get('transformers')}, torch {e['versions'].get('torch')})")
    if result["status"] != "ok":
        lines.append(f"status: {result['status'].upper()}: {result['reason']}")
    m = result.get("metrics")
    if not m:
        return "\n".join(lines)
    if m.get("capacity"):
        lines.extend(format_capacity(m["capacity"]))
        lines.append("at the capacity point:" if capacity_has_point(m["capacity"]) else "at saturation:")
    lines.extend(format_percentiles(m))
    if m.get("duration_s") is not None:
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
    elif r.get("unknown"):
        lines.append(f"roofline: unknown ({r['unknown']})")
    if m.get("errors"):
        lines.append("errors: " + "; ".join(m["errors"]))
    return "\n".join(lines)
