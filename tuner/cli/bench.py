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
    from tuner.measure.bench import BenchOptions

    p = sub.add_parser("bench", help="measure one serving configuration under load",
                       description="Serve a workload on a real model with one setting of the four knobs and report "
                                   "TTFT, TPOT, ITL, E2E (p50/p90/p95/p99/mean), throughput and memory.")
    add_config_args(p)
    add_workload_args(p)
    g = p.add_argument_group("measurement")
    g.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="per-request SLO for goodput, like vLLM: ttft:300 tpot:50 (milliseconds)")
    g.add_argument("--timeout", type=float, default=BenchOptions.timeout_s,
                   help=f"seconds before unfinished requests fail (default {BenchOptions.timeout_s:g})")
    g.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: fixed output lengths)")
    g.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth (roofline) measurement")
    g.add_argument("--stop-if", metavar="SLO", help="stop early (status pruned) if, half-way through, a bound is "
                                                   "already exceeded, e.g. 'ttft:p99<300ms'")
    g.add_argument("--json", metavar="FILE", help="write {config, metrics, ...} as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--server-log", metavar="FILE", help="a server engine's output goes to FILE (appended; default: a "
                                                        "temporary log removed at exit)")
    add_capacity_args(p)


def duration_text(seconds: float) -> str:
    """A duration as its flag takes it: 15m, 90s (tuner.slo.parse_duration_s reads it back)."""
    return f"{seconds / 60:g}m" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g}s"


def add_capacity_args(p: argparse.ArgumentParser, with_switch: bool = True) -> None:
    """SLO and capacity-search flags (shared by `tuner bench --capacity` and `tuner search`); every default shown is
    read from its home (tuner.measure.capacity.CapacityOptions, tuner.slo)."""
    from tuner.measure.capacity import CapacityOptions, probe_requests_for
    from tuner.slo import DEFAULT_ATTAINMENT, DEFAULT_LATENCY_METRIC, SLO, build_slo

    o = CapacityOptions
    first, cap = o.probe_requests
    p90 = probe_requests_for(build_slo("1s", "ttft:p90", None, None, SLO.confidence)[1], o.max_probes, None)

    g = p.add_argument_group("capacity: the highest rate served within the SLO (see tuner/measure/capacity.py)")
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
    g.add_argument("--confidence", type=float, default=SLO.confidence,
                   help=f"confidence of every verdict (default {SLO.confidence:g})")
    g.add_argument("--probe-requests", metavar="A:B",
                   help="requests per rate probe: A first, pooled up to B while undecided (default: sized by the "
                        f"SLO's percentile, at least {first}:{cap}; p90: {p90[0]}:{p90[1]})")
    g.add_argument("--max-probes", type=int, help=f"rate probes at most (default {o.max_probes})")
    g.add_argument("--capacity-timeout", metavar="DURATION",
                   help=f"no new probe starts after this long (default {duration_text(o.max_wall_s)})")
    g.add_argument("--saturation-requests", type=int, metavar="N",
                   help="most requests the saturation probe sends; it stops once its steady window holds "
                        f"max(in-flight, {o.steady_count(1)}) completions over {o.steady_s:g} s (default 2 x "
                        "(in-flight + that))")


def recorded_slo(path: str | None) -> Any:
    """The SLO a bench or export JSON's capacity was measured under (None when it has none)."""
    import json
    from pathlib import Path

    from tuner.slo import SLO

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
    """The capacity settings' defaults, read from their one home (tuner.measure.capacity); `probe_requests` None: sized
    by the SLO's percentile (tuner.measure.capacity.probe_requests_for)."""
    from tuner.measure.capacity import CapacityOptions

    return {"probe_requests": None, "max_probes": CapacityOptions.max_probes,
            "timeout": duration_text(CapacityOptions.max_wall_s), "saturation_requests": None}


def capacity_settings(args: argparse.Namespace, base: dict[str, Any] | None = None,
                      base_name: str = "space file capacity") -> dict[str, Any]:
    """Flags, else `base` (a space file's `capacity:` section), else the defaults; validated. An error names where
    the bad value came from: the flag, or the space file's key."""
    from tuner.measure.workload import parse_range
    from tuner.slo import parse_duration_s

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
    from tuner.measure.capacity import CapacityOptions, probe_requests_for

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
    from tuner.measure.bench import BenchOptions, run_bench

    should_stop = None
    if args.stop_if:
        from tuner.measure.bench import stop_when_past
        from tuner.slo import parse_slo

        should_stop = stop_when_past(parse_slo(args.stop_if))
    capacity = None
    if args.capacity:
        from tuner.slo import build_slo

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
    from tuner.measure.report import format_report
    from tuner.measure.run import exit_code, final_result

    result = final_result(run_bench(config, opts, should_stop))
    print(format_report(result))
    if out_path:
        write_json_atomic(out_path, result)
    return exit_code(result)
