"""What the page shows of trials as text and tables: the trials table (and its filters), a configuration in one line,
a point's hover text, and one trial's detail (latency samples and their ECDF, quality per task, its figures)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.config import ENGINE_KNOBS
from tuner.dashboard.curves import capacity_summary, capacity_text, ci_pair, num, pct
from tuner.dashboard.fields import field_label
from tuner.dashboard.study import THROUGHPUT, StudyInfo, TrialView, has_capacity


def table_rows(views: Sequence[TrialView], info: StudyInfo | None = None,
               recommended: int | None = None) -> list[dict[str, Any]]:
    """One dict per trial, every trial (failed and pruned ones with their reason, next to their state), column
    names as in results/<study>/trials.csv plus the study's latency metric and the engine. A study measured by
    capacity adds its capacity (req/s) with CI and verdict and the quality gate's verdict; output tok/s and the
    latencies are then those at the capacity point."""
    lat = info.latency_field if info else None
    by_capacity = has_capacity(views)
    out = []
    for v in views:
        r, m, q, c = v.row, v.row.metrics, v.row.quality, v.row.config
        row: dict[str, Any] = {
            "number": v.number, "state": v.state, "reason": first_line(r.reason),
            "feasible": v.feasible if v.state == "COMPLETE" else None,
            "recommended": v.number == recommended, "baseline": v.baseline,
        }
        if by_capacity:  # the figures that decide, first
            cap = v.capacity or {}
            lo, hi = ci_pair(cap.get("requests_per_s_ci"))
            gate = q.get("gate") if isinstance(q.get("gate"), Mapping) else {}
            row.update({"capacity_rps": v.capacity_rps, "capacity_ci_low_rps": lo, "capacity_ci_high_rps": hi,
                        "verdict": cap.get("verdict"), "quality_gate": gate.get("verdict"),
                        "goodput_rps": num(cap.get("goodput_requests_per_s"))})
        row.update({"engine": v.engine_label, "quant": c.get("quant"), "batch_cap": c.get("batch_cap"),
                    "kv_fraction": c.get("kv_fraction"), "kv_type": c.get("kv_type", "auto"), "draft": c.get("draft")})
        row["output_tokens_per_s"] = num((v.capacity or {}).get(THROUGHPUT)) if v.capacity else num(m.get(THROUGHPUT))
        if lat and lat not in ("ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99", "e2e_ms.p99"):
            key, stat = lat.split(".")
            row[f"{key[:-3]}_{stat}_ms"] = pct(m, key, stat)
        row.update({
            "ttft_p50_ms": pct(m, "ttft_ms", "p50"), "ttft_p99_ms": pct(m, "ttft_ms", "p99"),
            "tpot_p50_ms": pct(m, "tpot_ms", "p50"), "tpot_p99_ms": pct(m, "tpot_ms", "p99"),
            "e2e_p99_ms": pct(m, "e2e_ms", "p99"), "quality_score": num(q.get("score")),
            "quality_stderr": num(q.get("score_stderr")), "drop_pp": num(q.get("drop_pp")),
            "failed": m.get("failed"), "acceptance_rate": num(m.get("acceptance_rate")),
            "peak_rss_mb": num(m.get("peak_rss_mb")), "peak_cuda_mb": num(m.get("peak_cuda_mb")),
            "cost_per_million_tokens": num(r.cost), "duration_s": v.duration_s,
        })
        out.append(row)
    return out


def first_line(text: Any, limit: int = 300) -> str | None:
    if not text:
        return None
    s = str(text).strip().splitlines()
    return s[0][:limit] if s else None


def filter_rows(rows: Sequence[Mapping[str, Any]], formats: Iterable[str] | None = None,
                feasible: str = "all", states: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the formats (quant) and states given (None = all) and feasibility 'all' | 'feasible' |
    'infeasible' (anything not feasible, unfinished trials included)."""
    if feasible not in ("all", "feasible", "infeasible"):
        raise ValueError(f"feasible={feasible!r}: expected all, feasible or infeasible")
    fmts = None if formats is None else set(formats)
    sts = None if states is None else set(states)
    out = []
    for r in rows:
        if fmts is not None and r.get("quant") not in fmts:
            continue
        if sts is not None and r.get("state") not in sts:
            continue
        if feasible == "feasible" and r.get("feasible") is not True:
            continue
        if feasible == "infeasible" and r.get("feasible") is True:
            continue
        out.append(dict(r))
    return out


def config_text(config: Mapping[str, Any]) -> str:
    if not config:
        return "no config recorded"
    kv = config.get("kv_fraction")
    kv_s = f"{kv:g}" if isinstance(kv, (int, float)) else str(kv)
    kv_type = f" ({config['kv_type']})" if config.get("kv_type", "auto") != "auto" else ""
    engine = f"{config['engine']} " if config.get("engine", "transformers") != "transformers" else ""
    extra = "".join(f" · {k} {config[k]}" for k, spec in ENGINE_KNOBS.items() if config.get(k, spec[1]) != spec[1])
    return (f"{engine}{config.get('quant')} · batch cap {config.get('batch_cap')} · KV fraction {kv_s}{kv_type} · "
            f"draft {config.get('draft')}{extra}")


def hover_text(v: TrialView, info: StudyInfo | None = None) -> str:
    r = v.row
    status = v.state + (", feasible" if v.feasible else (", infeasible" if v.state == "COMPLETE" else ""))
    lines = [f"<b>trial {v.number}</b> ({status})" + (" · baseline" if v.baseline else ""),
             f"model {r.config.get('model')} on {r.config.get('device')}"
             + (f" · engine {v.engine_label}" if v.engine_label else ""), config_text(r.config)]
    if v.capacity:
        lines.append(f"capacity {capacity_text(v.capacity)}")
    parts = [f"{v.tok_s:.2f} output tok/s" + (" at capacity" if v.capacity else "")]
    lat = info.latency_field if info else None
    if lat:
        key, stat = lat.split(".")
        val = pct(r.metrics, key, stat)
        if val is not None:
            parts.append(f"{field_label(lat).replace(' (ms)', '')} {val:.0f} ms")
    q = num(r.quality.get("score"))
    if q is not None:
        se = num(r.quality.get("score_stderr"))
        parts.append(f"quality {q:.3f}" + (f" ± {se:.3f}" if se is not None else ""))
    gate = r.quality.get("gate")
    if isinstance(gate, Mapping) and gate.get("verdict"):
        parts.append(f"quality gate {gate['verdict']}")
    lines.append(" · ".join(parts))
    if r.reason:
        lines.append(f"reason: {first_line(r.reason, 120)}")
    return "<br>".join(lines)


def latency_samples(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per-request TTFT and E2E (ms) of the requests that succeeded."""
    out: dict[str, list[float]] = {"ttft_ms": [], "e2e_ms": []}
    for r in requests:
        if r.get("error"):
            continue
        for k in out:
            v = num(r.get(k))
            if v is not None:
                out[k].append(v)
    return out


def ecdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and the share of values <= each."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def quality_tasks(quality: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per-task accuracy with its standard error, sorted by task name."""
    tasks = quality.get("tasks") or {}
    out = []
    for name in sorted(tasks):
        t = tasks[name] or {}
        out.append({"task": name, "acc": num(t.get("acc")), "acc_stderr": num(t.get("acc_stderr"))})
    return out


def detail(v: TrialView) -> dict[str, Any]:
    """What the trial page shows besides its charts."""
    r, m = v.row, v.row.metrics
    draft = str(r.config.get("draft") or "none")
    failed_requests = [first_line(q.get("error"), 200) for q in v.requests if q.get("error")]
    return {
        "number": v.number, "state": v.state, "feasible": v.feasible, "baseline": v.baseline,
        "config": dict(r.config), "reason": r.reason, "uses_draft": draft != "none",
        "acceptance_rate": num(m.get("acceptance_rate")),
        "peak_rss_mb": num(m.get("peak_rss_mb")), "peak_cuda_mb": num(m.get("peak_cuda_mb")),
        "output_tokens_per_s": num(m.get(THROUGHPUT)), "requests_per_s": num(m.get("requests_per_s")),
        "completed": m.get("completed"), "failed": m.get("failed"),
        "percentiles": {k: {s: pct(m, k, s) for s in ("p50", "p90", "p95", "p99", "mean")}
                        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if isinstance(m.get(k), Mapping)},
        "quality": {k: r.quality.get(k) for k in ("score", "score_stderr", "baseline_score", "drop_pp",
                                                  "within_noise", "kld_mean", "top1_agree", "limit")
                    if r.quality.get(k) is not None},
        "tasks": quality_tasks(r.quality), "constraints": r.constraints, "failed_requests": failed_requests,
        "engine": v.engine, "engine_label": v.engine_label, "duration_s": v.duration_s,
        "gate": dict(r.quality["gate"]) if isinstance(r.quality.get("gate"), Mapping) else None,
        "capacity": capacity_summary(v.capacity),
        # the trial was re-measured after the search (tuner.search.confirm): `capacity` is that re-measure, and this
        # is what its trial measured (None when it was not re-measured)
        "in_trial_requests_per_s": (num(v.row.trial_capacity.get("requests_per_s"))
                                    if v.row.trial_capacity is not None else None),
    }
