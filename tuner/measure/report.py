"""The human report of one bench result: what `tuner bench` prints and a bench job's child writes to its log
(`trials/NNNN/bench.log`): the config and engine lines, the capacity section (probes, cost, canary, host, re-measures,
every note), the percentile table with each value's n and 95% intervals, throughput, memory and roofline."""

from __future__ import annotations

from typing import Any


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
    from tuner.measure.capacity import describe_conditions

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
