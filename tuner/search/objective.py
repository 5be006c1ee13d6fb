"""The search objective: one trial = one configuration's quality gate (once per format, from the quality cache)
and its capacity (tuner.measure.capacity: the highest arrival rate served within the SLO), measured for real in child
processes, turned into Optuna objectives and constraints.

Objectives: (capacity in req/s within the SLO -> max, suite quality score -> max).
Constraints (Optuna convention, <= 0 is satisfied), each normalised by its limit so they are comparable and TPE's
sum of violations means something; names are labels only:
  * per SLO term: (value at the capacity point - limit) / limit (for an attainment term: (target - attained) /
    target), measured at the lowest rate probed when no rate meets;
  * "SLO shown to hold": 0 when some rate was shown to meet the SLO with confidence, else +0.1 (an undecided
    config is not feasible: its point estimates may look fine);
  * quality: (upper confidence bound of the drop - budget) / max(budget, 0.5 pp): within budget only when the
    evidence shows it.
A format whose quality gate is `exceeds` is PRUNED before its capacity is measured, with its constraints set (the
SLO terms as unknown = 0), so TPE ranks it by its quality violation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.child import run_child
from tuner.config import TrialConfig
from tuner.engines.registry import backend
from tuner.job import BenchJob, EvalJob, write_job
from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import WorkloadSpec
from tuner.quality.common import DEFAULT_SEED
from tuner.search.space import Space, suggest_config
from tuner.slo import SLO, Bound

UNDECIDED = 0.1  # the "SLO shown to hold" constraint when no rate was shown to meet it

# The search's own defaults, their one home: `tuner search` / `tuner worker` flags and SearchContext read them (the
# capacity settings' home is tuner.measure.capacity.CapacityOptions, the quality gate's tuner.quality.gate).
TRIALS = 20  # the study's trial budget (--trials), resumed runs and every worker included
CONFIRM = 2  # re-measures of the pick after the last trial (--confirm; tuner.search.confirm); 0: the trials' own
TRIAL_TIMEOUT_S = 900.0  # time limit of one trial's measurement (--trial-timeout)
MAX_QUALITY_DROP_PP = 1.0  # the quality budget (--max-quality-drop), on the upper bound of the paired drop
QUALITY_TASKS = ("arc_easy",)  # lm-eval tasks when neither --quality-tasks nor the space file names any
QUALITY_LIMIT = 50  # items per task when neither --quality-limit nor the space file sets one
QUALITY_MAX_LIMIT_FACTOR = 4  # an undecided gate grows to this many times the limit (no --quality-max-limit, none
# in the space file)
SEED = 0  # the sampler's seed (--seed)
WORKLOAD = {"input_len": "64:192", "output_len": "24:48", "shared_prefix": 0, "seed": 0, "arrival": "poisson"}
# the study's prompts where the space file's `workload:` says nothing (requests: the probe cap)
RESULTS_DIR = "results"  # where study outputs and caches go (--results-dir)


class TrialFailed(Exception):
    """A trial that could not be measured; its reason is stored in the study, the search goes on."""


@dataclass
class SearchContext:
    model: str
    device: str
    space: Space
    primary: Bound | None
    slo: SLO
    max_quality_drop: float
    workload: WorkloadSpec
    quality_tasks: tuple[str, ...]
    quality_limit: int
    quality_seed: int = DEFAULT_SEED
    score_quality: bool = True
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    results_dir: Path = Path(RESULTS_DIR)
    study_dir: Path = Path(RESULTS_DIR)
    cost_per_hour: float | None = None
    target_rate: float | None = None  # req/s the user must serve: replicas = ceil(target / capacity)
    probe_requests: tuple[int, int] = CapacityOptions.probe_requests  # tuner.measure.capacity: every default's one home
    max_probes: int = CapacityOptions.max_probes
    capacity_timeout_s: float = CapacityOptions.max_wall_s
    saturation_requests: int | None = None
    quality_max_limit: int | None = None  # escalation cap for an undecided quality gate
    max_kld: float | None = None  # KLD screen before lm-eval
    confirm: int = CONFIRM  # re-measures of the pick after the last trial (tuner.search.confirm)
    quality_memo: dict[str, dict[str, Any]] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Every setting that defines the study: resuming or joining with any of them different is refused."""
        endpoints = [s for s in (self.space.engines or (self.space,)) if s.endpoint]
        return {"model": self.model, "device": self.device, "space": self.space.path,
                "space_sha256": self.space.digest, "slo": self.slo.to_dict(), "workload": self.workload.to_dict(),
                "quality": {"scored": self.score_quality, "tasks": list(self.quality_tasks),
                            "limit": self.quality_limit, "max_limit": self.quality_max_limit,
                            "max_drop_pp": self.max_quality_drop, "max_kld": self.max_kld,
                            "seed": self.quality_seed},
                "capacity": {"probe_requests": list(self.probe_requests), "max_probes": self.max_probes,
                             "timeout_s": self.capacity_timeout_s, "saturation_requests": self.saturation_requests},
                **({"endpoint": [f"{s.endpoint} {s.served_model}".strip() for s in endpoints]} if endpoints else {})}


def bench_job(config: TrialConfig, ctx: SearchContext, out: Path, server_log: Path,
              plan: dict[str, Any] | None = None) -> BenchJob:
    """`tuner bench --capacity` of one trial: the study's prompts (the capacity search chooses the arrival rates:
    the workload's own rate is left at its default), its SLO and its capacity settings, without the bandwidth
    measurement. `plan`: capacity settings the trial's chooser set for it (`--strategy predict`'s verification of a
    tail SLO at the predicted capacity, tuner.predict.verify.verification_plan), over the study's."""
    w = ctx.workload
    workload = WorkloadSpec(requests=w.requests, arrival=w.arrival, input_len=w.input_len, output_len=w.output_len,
                            shared_prefix=w.shared_prefix, seed=w.seed, trace=w.trace)
    capacity = CapacityOptions(slo=ctx.slo, probe_requests=ctx.probe_requests, max_probes=ctx.max_probes,
                               max_wall_s=ctx.capacity_timeout_s, saturation_requests=ctx.saturation_requests,
                               arrival=w.arrival, seed=w.seed)
    if plan:
        capacity = replace(capacity, **{k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()})
    return BenchJob(config=config, workload=workload, out_path=str(out), capacity=capacity,
                    server_log=str(server_log), measure_bandwidth=False)


def measure(config: TrialConfig, ctx: SearchContext, trial_dir: Path, plan: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Measure `config`'s capacity in a child process. Returns the bench JSON, or {'status': 'failed', ...}."""
    out = trial_dir / "bench.json"
    out.unlink(missing_ok=True)
    job = trial_dir / "bench_job.json"
    write_job(job, bench_job(config, ctx, out, trial_dir / "server.log", plan))  # a server engine's output, kept with it
    res = run_child(job, trial_dir / "bench.log", ctx.trial_timeout_s)
    if out.is_file():
        data = json.loads(out.read_text())
        data["child_wall_s"] = res.wall_s
        return data
    if res.returncode == 3:
        return {"status": "pruned", "reason": res.reason, "child_wall_s": res.wall_s}
    return {"status": "failed", "reason": res.reason or "bench wrote no result", "child_wall_s": res.wall_s}


def eval_job(config: TrialConfig, ctx: SearchContext, out: Path) -> EvalJob:
    """`tuner eval` of the config's weights as served (engine, format, KV type, device, endpoint) with the study's
    quality gate; the cache under the study's results folder."""
    weights = TrialConfig(model=config.model, engine=config.engine, quant=config.quant, kv_type=config.kv_type,
                          device=config.device, endpoint=config.endpoint, served_model=config.served_model)
    return EvalJob(config=weights, tasks=tuple(ctx.quality_tasks), limit=ctx.quality_limit, seed=ctx.quality_seed,
                   out_path=str(out), max_quality_drop=ctx.max_quality_drop,
                   max_limit=max(ctx.quality_max_limit or ctx.quality_limit, ctx.quality_limit),
                   confidence=ctx.slo.confidence, max_kld=ctx.max_kld, results_dir=str(ctx.results_dir))


def quality(config: TrialConfig, ctx: SearchContext, trial_dir: Path) -> dict[str, Any]:
    """Quality of the config's weights (format): memoized per study, cached on disk by `tuner eval`."""
    memo = quality_key(config.to_dict())
    if memo in ctx.quality_memo:
        return ctx.quality_memo[memo]
    out = trial_dir / "quality.json"
    job = trial_dir / "eval_job.json"
    write_job(job, eval_job(config, ctx, out))
    res = run_child(job, trial_dir / "quality.log", ctx.trial_timeout_s * 3)
    if not out.is_file():
        return {"error": res.reason or "quality scoring wrote no result"}
    q = json.loads(out.read_text())
    ctx.quality_memo[memo] = q
    return q


def quality_key(config: dict[str, Any]) -> str:
    """What quality depends on: the weights as served (an in-process engine: its format; a server engine: the
    engine, the format and the KV-cache type)."""
    engine = config.get("engine", "transformers")
    if not backend(engine).server:
        return str(config.get("quant"))
    return f"{engine}:{config.get('quant')}:{config.get('kv_type', 'auto')}"


def slo_terms(ctx: SearchContext) -> list[str]:
    return ctx.slo.terms()


def constraint_names(ctx: SearchContext) -> list[str]:
    quality = [f"quality drop<={ctx.max_quality_drop:g}pp (upper bound)"] if ctx.score_quality else []
    return slo_terms(ctx) + ["SLO shown to hold"] + quality


def slo_constraints(capacity: dict[str, Any] | None, ctx: SearchContext) -> list[float]:
    """Normalised SLO violations at the capacity point (or the lowest rate probed), plus "shown to hold"."""
    from tuner.measure.capacity import bound_value_at, capacity_point

    if capacity is None:  # not measured (pruned on quality): unknown, not violated
        return [0.0] * (len(ctx.slo.terms()) + 1)
    values = []
    for b in ctx.slo.bounds:
        v = bound_value_at(capacity, b)
        values.append(10.0 if v is None else (v - b.limit_ms) / b.limit_ms)
    if ctx.slo.targets_ms:
        p = capacity_point(capacity) or min(capacity.get("probes") or [{}], key=lambda q: q.get("rate_rps", 0))
        got = p.get("attainment")
        values.append(1.0 if got is None else (ctx.slo.attainment - got) / ctx.slo.attainment)
    values.append(0.0 if capacity.get("verdict") == "meets" else UNDECIDED)
    return [min(v, 1e6) for v in values]


def quality_constraint(q: dict[str, Any], ctx: SearchContext) -> float:
    """(upper bound of the drop - budget) / max(budget, 0.5 pp); <= 0 only when the gate says within budget."""
    gate = q.get("gate") or {}
    hi = (gate.get("drop_ci_pp") or [None, None])[1]
    if hi is None:
        hi = q.get("drop_pp")
    if hi is None:
        return 1e6
    value = (hi - ctx.max_quality_drop) / max(ctx.max_quality_drop, 0.5)
    if gate.get("verdict") not in (None, "within") and value <= 0:
        value = 0.01  # the gate decided against it (e.g. the KLD screen): never feasible
    return value


def cost_per_million(tokens_per_s: float | None, cost_per_hour: float | None) -> float | None:
    if not cost_per_hour or not tokens_per_s:
        return None
    return cost_per_hour / (tokens_per_s * 3600.0) * 1e6


def set_constraints(trial: Any, ctx: SearchContext, capacity: dict[str, Any] | None, q: dict[str, Any]) -> list[float]:
    values = slo_constraints(capacity, ctx) + ([quality_constraint(q, ctx)] if ctx.score_quality else [])
    trial.set_user_attr("constraints", values)
    for name, value in zip(constraint_names(ctx), values):  # Optuna's own store: feasibility in TPE
        trial.set_constraint(name, value)
    return values


QUALITY_KEYS = ("score", "score_stderr", "baseline_score", "drop_pp", "kld_mean", "kld_p99", "top1_agree", "tasks",
                "limit", "seed", "gate")


def apply_quality(trial: Any, ctx: SearchContext, config: TrialConfig, q: dict[str, Any]) -> None:
    """Record a format's quality on the trial; a gate that says `exceeds` prunes it (constraints set), except the
    baseline, which is always measured."""
    import optuna

    trial.set_user_attr("quality", {k: q.get(k) for k in QUALITY_KEYS})
    gate = q.get("gate") or {}
    if gate.get("verdict") == "exceeds" and not trial.user_attrs.get("baseline"):
        lo, hi = gate.get("drop_ci_pp") or [None, None]
        what = f"{config.quant} KV {config.kv_type}" if backend(config.engine).server else config.quant
        screen = gate.get("screen") or {}
        if screen and not screen.get("passed") and screen.get("reason"):  # screened on its KLD: no drop measured
            why = f"quality: {what}: {screen['reason']}: capacity not measured"
        else:
            why = (f"quality: {what} drops {q.get('drop_pp') or 0:.1f} pp" +
                   (f" [{lo:.1f}, {hi:.1f}]" if lo is not None and hi is not None else "") +
                   f" > budget {ctx.max_quality_drop:g} pp with confidence: capacity not measured")
        set_constraints(trial, ctx, None, q)
        trial.set_user_attr("reason", why)
        raise optuna.TrialPruned(why)


def apply_capacity(trial: Any, ctx: SearchContext, capacity: dict[str, Any], q: dict[str, Any]
                   ) -> tuple[float, float]:
    """Record a measured capacity on the trial: constraints, cost, the reason when no rate met; the objectives."""
    trial.set_user_attr("capacity", capacity)
    set_constraints(trial, ctx, capacity, q)
    cost = cost_per_million(capacity.get("output_tokens_per_s"), ctx.cost_per_hour)
    if cost is not None:
        trial.set_user_attr("cost_per_million_tokens", cost)
    if capacity.get("verdict") != "meets":
        trial.set_user_attr("reason", "; ".join(capacity.get("notes") or []) or
                            f"no rate was shown to meet the SLO ({capacity.get('verdict')})")
    return float(capacity.get("requests_per_s") or 0.0), quality_value(q, ctx) if ctx.score_quality else 0.0


def quality_value(q: dict[str, Any], ctx: SearchContext) -> float:
    """The quality objective: the suite score; in a study across engines (each scores with its own metric against
    its own full-precision reference) minus the drop from that reference, the one figure every engine measures the
    same way."""
    if ctx.space.engines:
        return -float(q.get("drop_pp") or 0.0) / 100.0
    return float(q.get("score", 0.0))


def objective(trial: Any, ctx: SearchContext) -> tuple[float, float]:
    config = suggest_config(trial, ctx.space, ctx.model, ctx.device)
    trial.set_user_attr("config", config.to_dict())
    trial_dir = ctx.study_dir / "trials" / f"{trial.number:04d}"
    q: dict[str, Any] = {}
    if ctx.score_quality:  # first: it is cached per format, and a format out of budget needs no capacity
        q = quality(config, ctx, trial_dir)
        if "error" in q:
            trial.set_user_attr("reason", f"quality scoring failed: {q['error']}")
            raise TrialFailed(q["error"])
        apply_quality(trial, ctx, config, q)
    bench = measure(config, ctx, trial_dir, trial.user_attrs.get("capacity_plan"))
    for key in ("engine", "environment", "workload", "load_s", "child_wall_s", "warmup"):
        if key in bench:
            trial.set_user_attr(key, bench[key])
    if bench["status"] != "ok" or not (bench.get("metrics") or {}).get("capacity"):
        reason = bench.get("reason") or "the capacity measurement wrote no result"
        trial.set_user_attr("reason", reason)
        raise TrialFailed(reason)
    metrics = dict(bench["metrics"])
    capacity = metrics.pop("capacity")
    trial.set_user_attr("metrics", metrics)  # at the capacity point (or at saturation)
    return apply_capacity(trial, ctx, capacity, q)
