"""Optuna storage and study handling, and the answer of a search: the feasible Pareto front, the recommendation
(the feasible config with the highest output tok/s), its gain over the baseline, the binding constraint, the
runner-up trade-offs, and the closest miss when nothing is feasible. Pure functions over finished trials."""

from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import TunerError

DEFAULT_STORAGE = "sqlite:///results/tuner.db"


def default_study_name(model: str, metric: str, target: str) -> str:
    base = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{base}-{metric.replace(':', '-')}-{target}").strip("-")


def check_study_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name or ""):
        raise TunerError(f"study name {name!r} is invalid: expected 1-128 characters of letters, digits, '.', '_', '-' "
                         "starting with a letter or digit")
    return name


def open_storage(url: str, create: bool = True) -> Any:
    """An Optuna storage for `url`, checked reachable before anything is written. SQLite files need an existing
    directory; other URLs (postgresql://...) must accept a connection. With `create=False` the storage must exist
    already, and a SQLite file is opened read-only (no tables are ever created in a file that is not a study
    database). `postgresql://` uses psycopg2 when psycopg (v3, SQLAlchemy 2.1's default driver) is not installed.
    Heartbeats (`TUNER_HEARTBEAT_S`, default 10 s; grace period 3x) let a worker mark the RUNNING trial of a dead
    worker FAIL."""
    import importlib.util
    import warnings

    import optuna

    if not re.match(r"^[a-z][a-z0-9+]*://", url or ""):
        raise TunerError(f"storage {url!r} is invalid: expected an Optuna storage URL such as "
                         "sqlite:///results/tuner.db or postgresql://user:pw@host/db")
    target = url
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if not create and not path.is_file():
            raise TunerError(f"storage {url!r}: no such database file {str(path)!r}")
        if not path.parent.is_dir():
            raise TunerError(f"storage {url!r}: directory {str(path.parent)!r} does not exist")
        if not create:
            target = f"sqlite:///file:{path.resolve()}?mode=ro&uri=true"
    elif url.startswith(("postgresql://", "postgres://")) and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        target = "postgresql+psycopg2://" + url.split("://", 1)[1]
    try:
        beat = float(os.environ.get("TUNER_HEARTBEAT_S", "10"))
        beat = beat if beat > 0 else 10.0
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeat_interval
        return optuna.storages.RDBStorage(target, heartbeat_interval=int(max(1, beat)),
                                          grace_period=int(max(2, 3 * beat)), engine_kwargs=engine_kwargs(target))
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not create and "readonly" in msg:
            msg = "not an Optuna study database"
        raise TunerError(f"storage {url!r} is unreachable: {msg[:200]}") from None


def engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    return {"pool_pre_ping": True}


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

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and self.constraints is not None and all(c <= 0 for c in self.constraints)

    @property
    def tok_s(self) -> float:
        return float(self.metrics.get("output_tokens_per_s") or 0.0)


def rows_from_study(study: Any) -> list[Row]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        rows.append(Row(t.number, t.state.name, ua.get("config") or {}, ua.get("metrics") or {},
                        ua.get("quality") or {}, ua.get("constraints"), ua.get("reason"),
                        ua.get("cost_per_million_tokens")))
    return rows


def pareto_front(rows: list[Row], latency: Any) -> list[Row]:
    """Feasible rows not dominated on (tok/s max, latency min, quality max)."""
    pts = [(r, r.tok_s, latency(r), r.quality.get("score") or 0.0) for r in rows if r.feasible]
    front = []
    for r, a, b, c in pts:
        dominated = any(a2 >= a and b2 <= b and c2 >= c and (a2, b2, c2) != (a, b, c) for _, a2, b2, c2 in pts)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: -r.tok_s)


def answer(rows: list[Row], names: list[str], primary: Any, baseline_number: int | None = 0) -> dict[str, Any]:
    """The recommendation and everything said about it (JSON-able)."""

    def lat(r: Row) -> float:
        v = primary.value(r.metrics)
        return math.inf if v is None else v

    feasible = sorted([r for r in rows if r.feasible], key=lambda r: -r.tok_s)
    base = next((r for r in rows if r.number == baseline_number and r.state == "COMPLETE"), None)
    out: dict[str, Any] = {
        "n_trials": len(rows),
        "n_complete": sum(r.state == "COMPLETE" for r in rows),
        "n_feasible": len(feasible),
        "n_pruned": sum(r.state == "PRUNED" for r in rows),
        "n_failed": sum(r.state == "FAIL" for r in rows),
        "constraints": names,
        "baseline": summary(base, lat) if base else None,
        "pareto_front": [summary(r, lat) for r in pareto_front(rows, lat)],
    }
    if feasible:
        best = feasible[0]
        rec = summary(best, lat)
        slack = {n: -c for n, c in zip(names, best.constraints or [])}
        rec["binding_constraint"] = binding(names, best.constraints or [], rows)
        rec["slack"] = slack
        if base and base.tok_s:
            rec["gain_over_baseline"] = best.tok_s / base.tok_s
        out["recommendation"] = rec
        out["runners_up"] = [dict(summary(r, lat), vs_best=tradeoff(r, best, lat)) for r in feasible[1:4]]
    else:
        done = [r for r in rows if r.state == "COMPLETE" and r.constraints]
        if done:
            closest = min(done, key=lambda r: miss_score(names, r.constraints))
            out["closest"] = summary(closest, lat)
            out["closest"]["misses"] = {n: c for n, c in zip(names, closest.constraints) if c > 0}
    return out


def miss_score(names: list[str], constraints: list[float]) -> float:
    """How far a trial is from feasible, as a sum of relative violations."""
    total = 0.0
    for n, c in zip(names, constraints):
        if c > 0:
            m = re.search(r"<=?([\d.]+)", n)
            scale = float(m.group(1)) if m and float(m.group(1)) > 0 else 1.0
            total += c / scale
    return total


def binding(names: list[str], constraints: list[float], rows: list[Row]) -> str:
    """The constraint that stopped a faster config: among trials with more throughput than the recommendation,
    the one violated most often; without such trials, the one with the least slack."""
    if not constraints:
        return "none"
    best_tok = max((r.tok_s for r in rows if r.feasible), default=0.0)
    faster = [r for r in rows if r.state == "COMPLETE" and r.tok_s > best_tok and r.constraints]
    if faster:
        counts = [sum(1 for r in faster if r.constraints[i] > 0) for i in range(len(names))]
        i = max(range(len(names)), key=lambda k: counts[k])
        if counts[i]:
            return f"{names[i]} (violated by {counts[i]} faster config(s))"
    # least slack among the bounds that have slack to speak of (failed requests = 0 is always exactly met)
    candidates = [k for k in range(len(constraints)) if not names[k].startswith("failed")] or list(range(len(names)))
    i = max(candidates, key=lambda k: constraints[k] if math.isfinite(constraints[k]) else -math.inf)
    return f"{names[i]} (least slack)"


def tradeoff(r: Row, best: Row, lat: Any) -> str:
    parts = [f"{r.tok_s / best.tok_s:.2f}x tok/s" if best.tok_s else "-"]
    if math.isfinite(lat(r)) and math.isfinite(lat(best)):
        parts.append(f"{lat(r) - lat(best):+.0f} ms latency")
    if r.quality.get("score") is not None and best.quality.get("score") is not None:
        parts.append(f"{100 * (r.quality['score'] - best.quality['score']):+.1f} pp quality")
    return ", ".join(parts)


def summary(r: Row, lat: Any) -> dict[str, Any]:
    m = r.metrics
    roof = m.get("roofline") or {}
    return {
        "trial": r.number, "state": r.state, "config": r.config,
        "output_tokens_per_s": r.tok_s, "latency_ms": lat(r) if math.isfinite(lat(r)) else None,
        "ttft_ms": m.get("ttft_ms"), "tpot_ms": m.get("tpot_ms"), "e2e_ms": m.get("e2e_ms"),
        "failed_requests": m.get("failed"), "quality": r.quality, "cost_per_million_tokens": r.cost,
        "percent_of_bandwidth_bound": roof.get("percent_of_bound"), "reason": r.reason,
    }


CSV_FIELDS = ["number", "state", "feasible", "model", "quant", "batch_cap", "kv_fraction", "draft", "device",
              "output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
              "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "failed", "acceptance_rate", "peak_rss_mb", "peak_cuda_mb",
              "quality_score", "quality_stderr", "drop_pp", "kld_mean", "cost_per_million_tokens", "reason"]


def trials_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        m, q, c = r.metrics, r.quality, r.config

        def pct(key: str, stat: str, m: dict = m) -> Any:
            return (m.get(key) or {}).get(stat)

        w.writerow({
            "number": r.number, "state": r.state, "feasible": r.feasible, **{k: c.get(k) for k in
                                                                              ("model", "quant", "batch_cap",
                                                                               "kv_fraction", "draft", "device")},
            "output_tokens_per_s": m.get("output_tokens_per_s"), "requests_per_s": m.get("requests_per_s"),
            "ttft_p50_ms": pct("ttft_ms", "p50"), "ttft_p99_ms": pct("ttft_ms", "p99"),
            "tpot_p50_ms": pct("tpot_ms", "p50"), "tpot_p99_ms": pct("tpot_ms", "p99"),
            "itl_p99_ms": pct("itl_ms", "p99"), "e2e_p50_ms": pct("e2e_ms", "p50"), "e2e_p99_ms": pct("e2e_ms", "p99"),
            "failed": m.get("failed"), "acceptance_rate": m.get("acceptance_rate"),
            "peak_rss_mb": m.get("peak_rss_mb"), "peak_cuda_mb": m.get("peak_cuda_mb"),
            "quality_score": q.get("score"), "quality_stderr": q.get("score_stderr"), "drop_pp": q.get("drop_pp"),
            "kld_mean": q.get("kld_mean"), "cost_per_million_tokens": r.cost, "reason": r.reason,
        })
    return buf.getvalue()
