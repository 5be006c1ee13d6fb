"""The one scoring template: every engine's quality module fills in two steps, and `score_through_cache` does the rest.

1. `plan_scoring(config, names, limit, seed, kld_tokens, progress) -> Plan` (the engine's): the cache key (None:
   never cached, e.g. a running endpoint, whose server can change between two calls), the model hash and versions
   the result records, and the baseline to score first (None: the config is its own baseline). Cheap; it refuses
   what the engine cannot score before anything runs.
2. A cache entry for the key is this call's result at once (`cached=True`, tasks in the order asked).
3. The baseline is scored first through this same template with its own engine's steps (an endpoint's baseline is
   the transformers fp32 model), so its cache entry is reused when it exists and written when it does not.
4. `score_config(config, names, limit, seed, kld_tokens, progress, plan) -> (task scores, KLD)` (the engine's):
   this config's own work.
5. The result is assembled (suite score, drop vs the baseline, KLD; `compute_s` this config's own work only) and,
   when keyed, stored atomically without this call's `cached`/`wall_s`.

The engine's steps are found through tuner.engines.registry (its quality module); tuner.quality.gate.score_quality
checks the inputs, then runs this.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.registry import backend
from tuner.quality.common import QualityResult, TaskScore, cache_path, read_cache, write_json_atomic


@dataclass(frozen=True)
class Plan:
    """What an engine's `plan_scoring` step tells the template before anything is scored."""

    model_hash: str
    versions: dict[str, str]  # recorded in the result (and, for a keyed engine, part of its key)
    key: dict[str, Any] | None  # the cache key; None: never cached
    baseline: TrialConfig | None  # scored first (its engine's steps); None: the config is its own baseline
    state: Any = None  # what the plan step prepared for `score_config` (an endpoint's reached server)


def score_through_cache(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                        progress: bool = True) -> QualityResult:
    """QualityResult of `config` (tasks, drop and KLD vs its engine's baseline), through the cache (inputs already
    checked: tuner.quality.gate.score_quality)."""
    steps = backend(config.engine).quality()
    t0 = time.perf_counter()
    plan = steps.plan_scoring(config, names, limit, seed, kld_tokens, progress)
    path = None if plan.key is None else cache_path(plan.key)
    if path is not None:
        hit = cached_result(path, plan.key, config, names, t0)  # type: ignore[arg-type]
        if hit is not None:
            return hit
    baseline, own_start = None, t0
    if plan.baseline is not None:
        baseline = score_through_cache(plan.baseline, names, limit, seed, kld_tokens, progress)
        own_start = time.perf_counter()  # compute_s counts this config's own work, not the baseline's
    scores, kld = steps.score_config(config, names, limit, seed, kld_tokens, progress, plan)
    result = assemble_result(config, scores, baseline, kld, limit, seed, plan.model_hash, plan.versions, t0,
                             own_start)
    return result if path is None else store_result(path, plan.key, result)  # type: ignore[arg-type]


def suite_score(scores: tuple[TaskScore, ...]) -> tuple[float, float]:
    """Mean accuracy over tasks and its stderr sqrt(sum stderr^2) / n (tasks independent)."""
    n = len(scores)
    return sum(s.acc for s in scores) / n, math.sqrt(sum(s.acc_stderr**2 for s in scores)) / n


def cached_result(path: Path, key: dict[str, Any], config: TrialConfig, names: tuple[str, ...],
                  t0: float) -> QualityResult | None:
    """A cache entry for `key` as this call's result (tasks in the order asked), or None."""
    hit = read_cache(path, key)
    if hit is None:
        return None
    res = QualityResult.from_dict(hit)
    order = {n: i for i, n in enumerate(names)}
    return dataclasses.replace(
        res, config=config.to_dict(), cached=True, wall_s=time.perf_counter() - t0,
        tasks=tuple(sorted(res.tasks, key=lambda s: order[s.name])),
        baseline_tasks=tuple(sorted(res.baseline_tasks, key=lambda s: order[s.name])),
    )


def assemble_result(config: TrialConfig, scores: tuple[TaskScore, ...], baseline: QualityResult | None, kld: Any,
                    limit: int, seed: int, model_hash: str, versions: dict[str, str], t0: float,
                    own_start: float) -> QualityResult:
    """A config's QualityResult from its task scores, its baseline's (None: it is the baseline) and its KLD."""
    score, stderr = suite_score(scores)
    if baseline is None:
        base_score, base_stderr, base_tasks = score, stderr, scores
    else:
        base_score, base_stderr, base_tasks = baseline.score, baseline.score_stderr, baseline.tasks
    return QualityResult(
        config=config.to_dict(), tasks=scores, score=score, score_stderr=stderr, baseline_score=base_score,
        baseline_stderr=base_stderr, baseline_tasks=base_tasks, drop_pp=(base_score - score) * 100.0,
        kld_mean=kld.mean, kld_mean_stderr=kld.mean_stderr, kld_p99=kld.p99, top1_agree=kld.top1_agree,
        kld_tokens=kld.n_tokens, limit=limit, seed=seed, model_hash=model_hash, versions=versions, cached=False,
        wall_s=time.perf_counter() - t0, compute_s=time.perf_counter() - own_start,
    )


def store_result(path: Path, key: dict[str, Any], result: QualityResult) -> QualityResult:
    """Write the cache entry (atomically; without this call's own `cached`/`wall_s`) and return the result."""
    entry = result.to_dict()
    entry.pop("cached")
    entry.pop("wall_s")
    write_json_atomic(path, {"key": key, "result": entry})
    return result
