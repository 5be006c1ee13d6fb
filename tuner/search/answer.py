"""The answer of a search: the feasible Pareto front (capacity, quality),
the recommendation (the feasible config with the highest capacity within the SLO), its gain over the engine-default
baseline with an interval, cost per 1M tokens at that load, replicas for a target rate, the binding constraint,
the runners-up (and which of them the evidence cannot tell apart from the recommendation), and the closest miss
when nothing is feasible, and the trials as CSV. Pure functions over finished trials."""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from typing import Any

from tuner.config import ENGINE_KNOBS
from tuner.errors import TunerError
from tuner.measure.capacity import DRIFT_NOTE
from tuner.measure.host import HOST_BUSY, busy_share


@dataclass(frozen=True)
class Row:
    """One finished trial flattened for the answer, the CSV and the dashboard."""

    number: int
    state: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    quality: dict[str, Any]
    constraints: list[float] | None
    reason: str | None
    cost: float | None
    capacity: dict[str, Any] | None = None
    engine: str | None = None
    launch: list[str] | None = None  # a server engine's exact argv, as `tuner export` writes it
    trial_capacity: dict[str, Any] | None = None  # the trial's own measure when `capacity` is its re-measure
    predicted_rps: float | None = None  # --strategy predict: the capacity predicted before it was measured

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and self.constraints is not None and all(c <= 0 for c in self.constraints)

    @property
    def rps(self) -> float:
        """Capacity: requests/s served within the SLO (0 when none was shown)."""
        return float((self.capacity or {}).get("requests_per_s") or 0.0)

    @property
    def rps_ci(self) -> tuple[float, float]:
        lo, hi = (self.capacity or {}).get("requests_per_s_ci") or [self.rps, self.rps]
        return float(lo), float(hi)

    @property
    def tok_s(self) -> float:
        """Output tok/s at the capacity point."""
        return float((self.capacity or {}).get("output_tokens_per_s") or 0.0)


CONFIRMED = "confirmed"  # study attribute: trial number -> its re-measure after the search (tuner.search.confirm)


def remeasure_of(study: Any, number: int) -> dict[str, Any] | None:
    """Trial `number`'s re-measure after the search ({capacity, metrics, constraints, cost_per_million_tokens,
    wall_s}), or None: the figure the answer, the dashboard and `tuner export` report for it."""
    again = ((getattr(study, "user_attrs", None) or {}).get(CONFIRMED) or {}).get(str(number))
    return again if isinstance(again, dict) and isinstance(again.get("capacity"), dict) else None


def rows_from_study(study: Any) -> list[Row]:
    """One row per trial; a trial re-measured after the search (tuner.search.confirm) is judged on that measure: its
    capacity, metrics, constraints (feasibility, slack) and cost are the re-measure's, its own capacity in
    `trial_capacity`."""
    rows = []
    names = list((getattr(study, "user_attrs", None) or {}).get("constraint_names") or [])
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        again = remeasure_of(study, t.number)
        metrics, capacity = ua.get("metrics") or {}, ua.get("capacity")
        constraints, cost = ua.get("constraints"), ua.get("cost_per_million_tokens")
        if again:
            metrics, capacity = again.get("metrics") or metrics, again["capacity"]
            constraints = again.get("constraints") or legacy_rejudge(constraints, capacity, names)
            cost = again.get("cost_per_million_tokens")
        rows.append(Row(t.number, t.state.name, ua.get("config") or {}, metrics,
                        ua.get("quality") or {}, constraints, ua.get("reason"),
                        cost, capacity, (ua.get("engine") or {}).get("name"),
                        launch_command((ua.get("engine") or {}).get("info") or {}),
                        ua.get("capacity") if again else None, ua.get("predicted_requests_per_s")))
    return rows


def legacy_rejudge(constraints: list[float] | None, capacity: dict[str, Any], names: list[str]) -> list[float] | None:
    """A re-measure stored before re-measures carried their own constraints: a capacity not shown to meet the SLO
    makes the trial infeasible ("SLO shown to hold" violated), whatever its trial said."""
    if constraints is None or capacity.get("verdict") == "meets":
        return constraints
    from tuner.search.objective import UNDECIDED

    i = names.index(SHOWN_TO_HOLD) if SHOWN_TO_HOLD in names else None
    return [max(c, UNDECIDED) if i is None or k == i else c for k, c in enumerate(constraints)]


def launch_command(info: dict[str, Any]) -> list[str] | None:
    """A server engine's exported argv with the environment it was launched with (`K=V ... python -m
    vllm.entrypoints.openai.api_server ...`)."""
    argv = info.get("exported_argv")
    if not argv:
        return None
    return [f"{k}={v}" for k, v in (info.get("env") or {}).items()] + list(argv)


def pareto_front(rows: list[Row]) -> list[Row]:
    """Feasible rows not dominated on (capacity max, quality max). Across engines quality is minus the drop from
    each engine's own reference (their scores use different metrics)."""
    across = len({r.config.get("engine", "transformers") for r in rows if r.config}) > 1
    pts = [(r, r.rps, -(r.quality.get("drop_pp") or 0.0) if across else r.quality.get("score") or 0.0)
           for r in rows if r.feasible]
    front = []
    for r, a, c in pts:
        dominated = any(a2 >= a and c2 >= c and (a2, c2) != (a, c) for _, a2, c2 in pts)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: -r.rps)


def answer(rows: list[Row], names: list[str], baseline_number: int | None = 0, cost_per_hour: float | None = None,
           target_rate: float | None = None) -> dict[str, Any]:
    """The recommendation and everything said about it (JSON-able)."""
    feasible = sorted([r for r in rows if r.feasible], key=lambda r: (-r.rps, -(r.quality.get("score") or 0.0)))
    base = next((r for r in rows if r.number == baseline_number and r.state == "COMPLETE"), None)
    out: dict[str, Any] = {
        "n_trials": len(rows),
        "n_complete": sum(r.state == "COMPLETE" for r in rows),
        "n_feasible": len(feasible),
        "n_pruned": sum(r.state == "PRUNED" for r in rows),
        "n_failed": sum(r.state == "FAIL" for r in rows),
        "constraints": names,
        "baseline": summary(base) if base else None,
        "pareto_front": [summary(r) for r in pareto_front(rows)],
        "not_confirmed": not_confirmed(rows),
    }
    if feasible:
        best = feasible[0]
        rec = summary(best)
        rec["slack"] = {n: -c for n, c in zip(names, best.constraints or [])}
        bind = binding(names, best)
        rec["binding"] = bind
        stop = rec["more_capacity_stopped_by"] = stopped_by(names, best, rows)
        rec["binding_constraint"] = bind["text"] if bind else "none"
        if stop:
            rec["binding_constraint"] += ("; configs with more capacity violated: "
                                          + ", ".join(f"{n} ({c})" for n, c in stop.items()))
        gain = gain_over(best, base)
        rec.update(gain)
        from tuner.search.objective import cost_per_million

        cost = cost_per_million(best.tok_s, cost_per_hour)
        if cost is not None:
            rec["cost_per_million_tokens"] = cost
        if target_rate:
            lo = best.rps
            rec["target_rate_rps"] = target_rate
            rec["replicas"] = replicas(target_rate, lo)
        rec["indistinguishable_from"] = [r.number for r in feasible[1:] if r.rps_ci[1] >= best.rps_ci[0]
                                         and r.rps_ci[0] <= best.rps_ci[1] and r.rps_ci[1] > best.rps]
        rec["machine_drift"] = {r.number: d for r in (best, base) if r is not None
                                for d in [((r.capacity or {}).get("machine") or {}).get("drift")]
                                if d is not None and abs(d) > DRIFT_NOTE}
        rec["host_busy"] = {r.number: b for r in (best, base) if r is not None
                            for b in [((r.capacity or {}).get("host") or {}).get("busiest")]
                            if b and busy_share(b) > HOST_BUSY}
        rec["speed_since_trial"] = speed_since_trial(best)  # None unless re-measured, with canaries both times
        rec["statement"] = statement(best, base, gain, rows)
        out["recommendation"] = rec
        out["runners_up"] = [dict(summary(r), vs_best=tradeoff(r, best)) for r in feasible[1:4]]
    engines = list(dict.fromkeys(r.config.get("engine", "transformers") for r in rows if r.config))
    if len(engines) > 1:  # a study across engines: each engine's best, so they are compared on one workload and SLO
        out["best_per_engine"] = {}
        for e in engines:
            mine = [r for r in feasible if r.config.get("engine", "transformers") == e]
            out["best_per_engine"][e] = (dict(summary(mine[0]), vs_best=tradeoff(mine[0], feasible[0]))
                                         if mine else None)
    else:
        done = [r for r in rows if r.state in ("COMPLETE", "PRUNED") and r.constraints]
        if done:
            closest = min(done, key=lambda r: miss_score(r.constraints or []))
            out["closest"] = summary(closest)
            out["closest"]["misses"] = {n: c for n, c in zip(names, closest.constraints or []) if c > 0}
    return out


def replicas(target_rps: float | None, capacity_rps: float | None) -> int | None:
    """Replicas of a configuration that serve `target_rps` within the SLO (None without a target or a capacity);
    a capacity within float noise of an exact share of the target does not add a replica."""
    if target_rps is None or not capacity_rps or capacity_rps <= 0:
        return None
    return math.ceil(target_rps / capacity_rps - 1e-9)


def gain_over(best: Row, base: Row | None) -> dict[str, Any]:
    """k = capacity / baseline capacity, with the interval from the two brackets."""
    if base is None or base.capacity is None:
        return {"gain_over_baseline": None, "gain_ci": None}
    b_lo, b_hi = base.rps_ci
    r_lo, r_hi = best.rps_ci
    if base.rps <= 0:
        return {"gain_over_baseline": None, "gain_ci": [r_lo / b_hi if b_hi else None, None]}
    return {"gain_over_baseline": best.rps / base.rps,
            "gain_ci": [r_lo / b_hi if b_hi else None, r_hi / b_lo if b_lo else None]}


def describe(c: dict[str, Any]) -> str:
    kv_type = f" ({c['kv_type']})" if c.get("kv_type", "auto") != "auto" else ""
    extra = "".join(f", {k} {c[k]}" for k, spec in ENGINE_KNOBS.items() if c.get(k, spec[1]) != spec[1])
    return (f"{c.get('quant')} batch cap {c.get('batch_cap')}, kv {c.get('kv_fraction', 0):.3g}{kv_type}, "
            f"draft {c.get('draft')}{extra}")


def statement(best: Row, base: Row | None, gain: dict[str, Any], rows: list[Row] | None = None) -> str:
    lo, hi = best.rps_ci
    text = (f"trial {best.number} ({describe(best.config)}, on {best.engine or '?'}) serves {best.rps:.3g} req/s "
            f"[{lo:.3g}, {hi:.3g}] within the SLO")
    if best.tok_s:
        text += f" ({best.tok_s:.1f} output tok/s)"
    if best.trial_capacity is not None:
        moved = speed_since_trial(best)
        text += (f" (re-measured after the search; "
                 f"{float(best.trial_capacity.get('requests_per_s') or 0):.3g} req/s in its trial"
                 + (f"; the engine's own speed (its canary) {moved:+.0%} since" if moved is not None else "")
                 + ")")
    if base is not None:
        if gain.get("gain_over_baseline"):
            g_lo, g_hi = gain["gain_ci"]
            text += (f", {gain['gain_over_baseline']:.2f}x [{_n(g_lo)}, {_n(g_hi)}] the engine default's "
                     f"{base.rps:.3g} req/s")
        else:
            text += ", where the engine default was shown to meet the SLO at no rate probed"
    rows = rows or []
    for n in not_confirmed(rows):
        text += (f"; trial {n['trial']} ({n['in_trial_requests_per_s']:.3g} req/s in its trial) is not recommended: "
                 f"{n['why']}")
    if best.trial_capacity is None and any(r.trial_capacity is not None for r in rows):
        text += "; no configuration confirmed: this figure is its trial's own (not re-measured)"
    return text


def why_not(capacity: dict[str, Any]) -> str:
    """Why a re-measure does not confirm its trial, in one clause."""
    if capacity.get("failed"):
        return f"the re-measure failed ({capacity['failed']})"
    return f"the re-measure met the SLO at no rate (verdict {capacity.get('verdict') or 'indeterminate'})"


def not_confirmed(rows: list[Row]) -> list[dict[str, Any]]:
    """Trials re-measured after the search whose re-measure is not feasible: not recommended on their trial's
    figure."""
    return [{"trial": r.number, "in_trial_requests_per_s": float((r.trial_capacity or {}).get("requests_per_s") or 0),
             "why": why_not(r.capacity or {})}
            for r in rows if r.trial_capacity is not None and r.state == "COMPLETE" and not r.feasible]


def speed_since_trial(r: Row) -> float | None:
    """How much faster the engine ran at the re-measure than in the trial, by their canaries (the same prompt, the
    same full batch, measured through each: the mean of their inter-token gaps): + = faster now. A capacity that
    moved with it is the host's speed, not the configuration's (a shared host is slower in its busy hours)."""
    def step_ms(c: dict[str, Any] | None) -> float | None:
        ts = [t for t in ((c or {}).get("canary") or {}).get("itl_ms") or [] if t]
        return sum(ts) / len(ts) if ts else None

    then, now = step_ms(r.trial_capacity), step_ms(r.capacity)
    return then / now - 1 if then and now else None


def _n(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def miss_score(constraints: list[float]) -> float:
    """How far a trial is from feasible: the sum of its (normalised) violations."""
    return sum(c for c in constraints if c > 0 and math.isfinite(c))


SHOWN_TO_HOLD = "SLO shown to hold"  # tuner.search.objective's indicator term: 0 for every feasible trial, never binding


def binding(names: list[str], best: Row) -> dict[str, Any] | None:
    """The pick's tightest real term (an SLO bound, the attainment of per-request targets, the quality budget; never
    the "SLO shown to hold" indicator, which is 0 for every feasible trial): the one with the least normalised
    slack, with its value, its limit and its slack in its own unit, measured at the capacity point."""
    cons = best.constraints or []
    real = [i for i, n in enumerate(names[:len(cons)]) if n != SHOWN_TO_HOLD and math.isfinite(cons[i])]
    if not real:
        return None
    i = max(real, key=lambda k: cons[k])
    return term_at(names[i], cons[i], best)


def term_at(name: str, normalised: float, r: Row) -> dict[str, Any]:
    """One constraint term of `r` in its own unit: {term, value, limit, slack, unit, n, at_rps, text}."""
    from tuner.measure.capacity import capacity_point

    point = capacity_point(r.capacity or {}) or {}
    at = f" at {r.rps:.3g} req/s" if r.rps else ""
    n = point.get("n")
    out: dict[str, Any] = {"term": name, "normalised_slack": 0.0 - normalised, "at_rps": r.rps or None, "n": n}
    if name.startswith("quality drop"):
        gate = (r.quality or {}).get("gate") or {}
        hi = (gate.get("drop_ci_pp") or [None, None])[1]
        budget = gate.get("budget_pp")
        if budget is None:
            m = re.search(r"<=\s*([0-9.eE+-]+)\s*pp", name)
            budget = float(m.group(1)) if m else None
        if hi is not None and budget is not None:
            conf = gate.get("confidence")
            bound = f"upper {conf:.0%} bound" if conf else "upper bound"
            out.update(value=hi, limit=budget, slack=budget - hi, unit="pp",
                       text=f"quality drop ({bound}) {hi:.2f} pp of {budget:g} pp ({budget - hi:.2f} pp slack)")
            return out
    elif " of requests: " in name:
        got = point.get("attainment")
        if got is not None and normalised < 1:
            target = got / (1.0 - normalised)  # normalised = (target - attained) / target
            within = name.split(" of requests: ", 1)[1]
            out.update(value=got, limit=target, slack=got - target, unit="share",
                       text=f"{got:.1%} of requests within {within}, {target:.0%} required "
                            f"({100 * (got - target):.1f} pp slack, n={n}){at}")
            return out
    else:
        from tuner.slo import parse_slo

        try:
            (b,) = parse_slo(name)
        except (TunerError, ValueError):
            b = None
        if b is not None:
            from tuner.measure.capacity import bound_value_at

            v = bound_value_at(r.capacity or {}, b) if r.capacity else None
            if v is None:
                v = b.limit_ms * (1.0 + normalised)  # normalised = (value - limit) / limit
            sec = b.limit_ms >= 1000.0
            unit = "s" if sec else "ms"

            def f(ms: float) -> str:
                return f"{ms / 1000.0:.3g} s" if sec else f"{ms:.3g} ms"

            out.update(value=v / 1000.0 if sec else v, limit=b.limit_ms / 1000.0 if sec else b.limit_ms,
                       slack=(b.limit_ms - v) / 1000.0 if sec else b.limit_ms - v, unit=unit,
                       text=f"{b.key} {f(v)} of {f(b.limit_ms)} ({f(b.limit_ms - v)} slack"
                            + (f", n={n}" if n else "") + f"){at}")
            return out
    out.update(value=None, limit=None, slack=None, unit=None,
               text=f"{name} ({0.0 - normalised:.0%} of its limit to spare){at}")
    return out


def stopped_by(names: list[str], best: Row, rows: list[Row]) -> dict[str, int]:
    """What kept the measured configurations with more capacity than the pick out: per term, how many of them
    violated it."""
    better = [r for r in rows if r.state in ("COMPLETE", "PRUNED") and r.rps > best.rps and r.constraints]
    counts = {n: sum(1 for r in better if i < len(r.constraints or []) and (r.constraints or [])[i] > 0)
              for i, n in enumerate(names)}
    return {n: c for n, c in counts.items() if c}


def tradeoff(r: Row, best: Row) -> str:
    parts = [f"{r.rps / best.rps:.2f}x capacity" if best.rps else "-"]
    if r.config.get("engine", "transformers") != best.config.get("engine", "transformers"):
        # engines score with their own metric against their own reference (llama-perplexity's acc_per_token vs
        # lm-eval's acc_norm): only each one's drop from its own full precision compares
        if r.quality.get("drop_pp") is not None:
            parts.append(f"quality drop {r.quality['drop_pp']:+.1f} pp vs its engine's reference")
    elif r.quality.get("score") is not None and best.quality.get("score") is not None:
        parts.append(f"{100 * (r.quality['score'] - best.quality['score']):+.1f} pp quality")
    return ", ".join(parts)


def summary(r: Row) -> dict[str, Any]:
    m = r.metrics
    cap = r.capacity or {}
    gate = (r.quality or {}).get("gate") or {}
    return {
        "trial": r.number, "state": r.state, "config": r.config, "engine": r.engine,
        "capacity_requests_per_s": r.rps, "capacity_ci": list(r.rps_ci), "capacity_verdict": cap.get("verdict"),
        "capacity": cap or None, "output_tokens_per_s": r.tok_s,
        "ttft_ms": m.get("ttft_ms"), "tpot_ms": m.get("tpot_ms"), "e2e_ms": m.get("e2e_ms"),
        "failed_requests": m.get("failed"), "quality": r.quality, "quality_verdict": gate.get("verdict"),
        "cost_per_million_tokens": r.cost, "reason": r.reason, "launch": r.launch,
        "confirmed": r.trial_capacity is not None,
        "in_trial_requests_per_s": (r.trial_capacity or {}).get("requests_per_s") if r.trial_capacity else None,
        **({"predicted_requests_per_s": r.predicted_rps} if r.predicted_rps is not None else {}),
    }


CSV_FIELDS = ["number", "state", "feasible", "engine", "model", "quant", "batch_cap", "kv_fraction", "kv_type", "draft",
              *ENGINE_KNOBS, "device", "capacity_rps", "capacity_rps_low", "capacity_rps_high", "capacity_verdict",
              "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms",
              "e2e_p50_ms", "e2e_p99_ms", "failed", "peak_rss_mb", "peak_cuda_mb", "quality_score",
              "quality_stderr", "drop_pp", "drop_upper_pp", "quality_verdict", "kld_mean",
              "cost_per_million_tokens", "reason", "predicted_capacity_rps"]


def trials_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        m, q, c = r.metrics, r.quality, r.config
        gate = q.get("gate") or {}

        def pct(key: str, stat: str, m: dict = m) -> Any:
            return (m.get(key) or {}).get(stat)

        lo, hi = r.rps_ci
        w.writerow({
            "number": r.number, "state": r.state, "feasible": r.feasible, "engine": r.engine,
            **{k: c.get(k) for k in ("model", "quant", "batch_cap", "kv_fraction", "draft", "device")},
            "kv_type": c.get("kv_type", "auto"), **{k: c.get(k, spec[1]) for k, spec in ENGINE_KNOBS.items()},
            "capacity_rps": r.rps if r.capacity else None, "capacity_rps_low": lo if r.capacity else None,
            "capacity_rps_high": hi if r.capacity else None, "capacity_verdict": (r.capacity or {}).get("verdict"),
            "output_tokens_per_s": r.tok_s if r.capacity else None,
            "ttft_p50_ms": pct("ttft_ms", "p50"), "ttft_p99_ms": pct("ttft_ms", "p99"),
            "tpot_p50_ms": pct("tpot_ms", "p50"), "tpot_p99_ms": pct("tpot_ms", "p99"),
            "itl_p99_ms": pct("itl_ms", "p99"), "e2e_p50_ms": pct("e2e_ms", "p50"), "e2e_p99_ms": pct("e2e_ms", "p99"),
            "failed": m.get("failed"), "peak_rss_mb": m.get("peak_rss_mb"), "peak_cuda_mb": m.get("peak_cuda_mb"),
            "quality_score": q.get("score"), "quality_stderr": q.get("score_stderr"), "drop_pp": q.get("drop_pp"),
            "drop_upper_pp": (gate.get("drop_ci_pp") or [None, None])[1], "quality_verdict": gate.get("verdict"),
            "kld_mean": q.get("kld_mean"), "cost_per_million_tokens": r.cost, "reason": r.reason,
            "predicted_capacity_rps": r.predicted_rps,
        })
    return buf.getvalue()
