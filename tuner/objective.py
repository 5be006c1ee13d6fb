"""The search objective: one trial = one configuration, measured for real in a child process, plus its quality
score (once per format, from the quality cache), turned into Optuna objectives and constraints.

Objectives: (output tok/s -> max, primary latency metric in ms -> min, suite quality score -> max).
Constraints (Optuna convention, <= 0 is satisfied): every latency bound (value - limit, ms), the quality budget
(drop_pp - max_drop_pp), and failed requests (count).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.child import run_child
from tuner.config import TrialConfig
from tuner.space import Space, suggest_config
from tuner.targets import Bound
from tuner.workload import WorkloadSpec


class TrialFailed(Exception):
    """A trial that could not be measured; its reason is stored in the study, the search goes on."""


@dataclass
class SearchContext:
    model: str
    device: str
    space: Space
    primary: Bound
    bounds: list[Bound]
    max_quality_drop: float
    workload: WorkloadSpec
    quality_tasks: tuple[str, ...]
    quality_limit: int
    quality_seed: int = 1234
    score_quality: bool = True
    trial_timeout_s: float = 900.0
    results_dir: Path = Path("results")
    study_dir: Path = Path("results")
    cost_per_hour: float | None = None
    quality_memo: dict[str, dict[str, Any]] = field(default_factory=dict)


def bench_args(config_path: Path, out_path: Path, ctx: SearchContext, early_stop: bool = True) -> list[str]:
    w = ctx.workload
    args = ["bench", "--config", str(config_path), "--json", str(out_path), "--quiet", "--no-bandwidth",
            "--requests", str(w.requests), "--input-len", f"{w.input_len[0]}:{w.input_len[1]}",
            "--output-len", f"{w.output_len[0]}:{w.output_len[1]}", "--shared-prefix", str(w.shared_prefix),
            "--seed", str(w.seed), "--arrival", w.arrival]
    if early_stop:
        args += ["--stop-if", ";".join(str(b) for b in ctx.bounds)]
    args += ["--concurrency", str(w.concurrency)] if w.concurrency else ["--rate", str(w.rate)]
    if w.trace:
        args += ["--trace", w.trace]
    return args


def measure(config: TrialConfig, ctx: SearchContext, trial_dir: Path, early_stop: bool = True) -> dict[str, Any]:
    """Bench `config` in a child process. Returns the bench JSON, or {'status': 'failed', 'reason': ...}."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    cfg = trial_dir / "config.json"
    cfg.write_text(config.to_json())
    out = trial_dir / "bench.json"
    out.unlink(missing_ok=True)
    res = run_child(bench_args(cfg, out, ctx, early_stop), trial_dir / "bench.log", ctx.trial_timeout_s)
    if out.is_file():
        data = json.loads(out.read_text())
        data["child_wall_s"] = res.wall_s
        return data
    if res.returncode == 3:
        return {"status": "pruned", "reason": res.reason, "child_wall_s": res.wall_s}
    return {"status": "failed", "reason": res.reason or "bench wrote no result", "child_wall_s": res.wall_s}


def quality(config: TrialConfig, ctx: SearchContext, trial_dir: Path) -> dict[str, Any]:
    """Quality of the config's weights (format): memoized per study, cached on disk by `tuner eval`."""
    if config.quant in ctx.quality_memo:
        return ctx.quality_memo[config.quant]
    out = trial_dir / "quality.json"
    args = ["eval", "--model", config.model, "--quant", config.quant, "--device", config.device,
            "--tasks", ",".join(ctx.quality_tasks), "--limit", str(ctx.quality_limit),
            "--seed", str(ctx.quality_seed), "--json", str(out)]
    env = {"TUNER_RESULTS": str(ctx.results_dir)}
    res = run_child(args, trial_dir / "quality.log", ctx.trial_timeout_s * 3, env=env)
    if not out.is_file():
        return {"error": res.reason or "quality scoring wrote no result"}
    q = json.loads(out.read_text())
    ctx.quality_memo[config.quant] = q
    return q


def constraint_values(metrics: dict[str, Any], q: dict[str, Any], ctx: SearchContext) -> list[float]:
    """<= 0 means satisfied. Order: bounds..., quality budget, failed requests."""
    values = []
    for b in ctx.bounds:
        v = b.value(metrics)
        values.append(math.inf if v is None else v - b.limit_ms)
    if ctx.score_quality:
        drop = q.get("drop_pp")
        values.append(math.inf if drop is None else drop - ctx.max_quality_drop)
    values.append(float(metrics.get("failed", 0)))
    return values


def constraint_names(ctx: SearchContext) -> list[str]:
    quality = [f"quality drop<={ctx.max_quality_drop:g}pp"] if ctx.score_quality else []
    return [str(b) for b in ctx.bounds] + quality + ["failed requests=0"]


def cost_per_million(tokens_per_s: float, cost_per_hour: float | None) -> float | None:
    if not cost_per_hour or not tokens_per_s:
        return None
    return cost_per_hour / (tokens_per_s * 3600.0) * 1e6


def objective(trial: Any, ctx: SearchContext) -> tuple[float, float, float]:
    import optuna

    config = suggest_config(trial, ctx.space, ctx.model, ctx.device)
    trial.set_user_attr("config", config.to_dict())
    trial_dir = ctx.study_dir / "trials" / f"{trial.number:04d}"
    # the engine-default baseline always runs to the end (never pruned), so the gain over it is always known
    bench = measure(config, ctx, trial_dir, early_stop=not trial.user_attrs.get("baseline"))
    for key in ("engine", "environment", "workload", "load_s", "child_wall_s"):
        if key in bench:
            trial.set_user_attr(key, bench[key])
    if bench.get("metrics"):
        trial.set_user_attr("metrics", bench["metrics"])
        trial.set_user_attr("requests", [{k: r[k] for k in ("ttft_ms", "e2e_ms", "tpot_ms", "output_tokens", "error")}
                                         for r in bench.get("requests", [])])
    if bench["status"] == "pruned":
        trial.set_user_attr("reason", bench["reason"])
        raise optuna.TrialPruned(bench["reason"])
    if bench["status"] != "ok":
        trial.set_user_attr("reason", bench["reason"])
        raise TrialFailed(bench["reason"])
    metrics = bench["metrics"]
    q: dict[str, Any] = {}
    if ctx.score_quality:
        q = quality(config, ctx, trial_dir)
        if "error" in q:
            trial.set_user_attr("reason", f"quality scoring failed: {q['error']}")
            raise TrialFailed(q["error"])
        trial.set_user_attr("quality", {k: q.get(k) for k in ("score", "score_stderr", "baseline_score", "drop_pp",
                                                              "within_noise", "kld_mean", "kld_p99", "top1_agree",
                                                              "tasks", "limit", "seed")})
    values = constraint_values(metrics, q, ctx)
    trial.set_user_attr("constraints", values)
    for name, value in zip(constraint_names(ctx), values):  # Optuna's own constraint store (feasibility in TPE)
        trial.set_constraint(name, min(value, 1e12))
    cost = cost_per_million(metrics["output_tokens_per_s"], ctx.cost_per_hour)
    if cost is not None:
        trial.set_user_attr("cost_per_million_tokens", cost)
    latency = ctx.primary.value(metrics)
    return (metrics["output_tokens_per_s"], latency if latency is not None else math.inf,
            q.get("score", 0.0) if ctx.score_quality else 0.0)


def pid_tag() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"
