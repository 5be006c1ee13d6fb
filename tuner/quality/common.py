"""What every quality scorer shares, below tuner.quality.template, tuner.quality.gate and tuner.quality.kld: the
result types, the cache (key, path, read, atomic write, versions), lm-eval's suite run and the per-task/per-item scores.

The scoring template (cache hit, baseline first, the engine's own scores, assembly, store) is tuner.quality.template;
tuner.quality.gate (inputs, paired comparison, gate), tuner.quality.kld and every tuner.quality.<engine> read these
from here, so none of them imports another's helpers (no import circle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tuner.errors import TunerError

SCHEMA = 2  # bump when the way a number is computed changes (invalidates every cache entry). 2: per-item values
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
    items: tuple[tuple[str, float], ...] = ()  # (doc key, metric value) per item, for paired comparisons

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
        """JSON form; per-item values go to `items` / `baseline_items` ({task: {doc key: value}}), not `tasks`."""
        d = asdict(self)
        d["tasks"] = {t.name: t.to_dict() for t in self.tasks}
        d["baseline_tasks"] = {t.name: t.to_dict() for t in self.baseline_tasks}
        d["items"] = {t.name: dict(t.items) for t in self.tasks}
        d["baseline_items"] = {t.name: dict(t.items) for t in self.baseline_tasks}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QualityResult:
        d = dict(d)
        for k, ik in (("tasks", "items"), ("baseline_tasks", "baseline_items")):
            items = d.get(ik) or {}
            d[k] = tuple(TaskScore(name, v["metric"], v["acc"], v["acc_stderr"], v["n"],
                                   tuple(sorted(((str(a), float(b)) for a, b in (items.get(name) or {}).items()),
                                                key=item_order)))
                         for name, v in d[k].items())
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
    return package_versions(names)


def package_versions(names: list[str]) -> dict[str, str]:
    """Installed version of each distribution ("missing" when absent)."""
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


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict[str, Any]) -> Path:
    return results_dir() / key["model_hash"] / f"{key['quant']}-{digest(key)}.json"


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
    from tuner.files import write_json_atomic as write

    write(path, obj, sort_keys=True)


# ------------------------------------------------------------------------------------------------ scoring ---- #
def _number(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):  # lm-eval writes "N/A" when a stderr cannot be computed (one item)
        return 0.0
    return 0.0 if math.isnan(v) else v


def leaf_tasks(name: str, out: dict[str, Any]) -> list[str]:
    """The tasks lm-eval actually scored for `name`: itself, or the leaves of its group (mmlu -> 57 subjects)."""
    groups = out.get("group_subtasks", {})
    subs = groups.get(name) or []
    if not subs:
        return [name]
    return [leaf for sub in subs for leaf in leaf_tasks(sub, out)]


def task_items(name: str, metric: str, out: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """Per-item values of `metric` from simple_evaluate's logged samples, keyed by doc id (`subtask/doc id` for a
    group). Empty when samples were not logged."""
    samples = out.get("samples") or {}
    leaves = leaf_tasks(name, out)
    items = []
    for leaf in leaves:
        for s in samples.get(leaf, []):
            key = str(s["doc_id"]) if leaves == [name] else f"{leaf}/{s['doc_id']}"
            items.append((key, _number(s.get(metric))))
    return tuple(sorted(items, key=item_order))


def item_order(item: tuple[str, float]) -> tuple[str, int]:
    """Canonical order of items: by subtask, then numeric doc id (JSON sorts keys as text: "10" < "2")."""
    head, _, tail = item[0].rpartition("/")
    return head, int(tail) if tail.isdigit() else -1


def task_score(name: str, out: dict[str, Any]) -> TaskScore:
    """Pick acc_norm (when the task reports it) or acc, with its stderr and per-item values, from simple_evaluate's
    output."""
    res = out["results"][name]
    metric = "acc_norm" if "acc_norm,none" in res else "acc"
    if f"{metric},none" not in res:
        raise TunerError(f"task {name!r} reported no accuracy (metrics: {', '.join(sorted(res))})")
    n_samples = out.get("n-samples", {})
    n = sum(int(n_samples.get(t, {}).get("effective", 0)) for t in leaf_tasks(name, out))
    return TaskScore(name, metric, _number(res[f"{metric},none"]), _number(res.get(f"{metric}_stderr,none")), n,
                     task_items(name, metric, out))


def run_suite(model: Any, tokenizer: Any, tasks: tuple[str, ...], limit: int, seed: int,
              batch_size: int = BATCH_SIZE) -> tuple[TaskScore, ...]:
    """lm-eval on an already-loaded model (its quantization as loaded), offline, with a fixed seed."""
    from lm_eval.models.huggingface import HFLM

    return evaluate_suite(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), tasks, limit, seed)


def evaluate_suite(lm: Any, tasks: tuple[str, ...], limit: int, seed: int) -> tuple[TaskScore, ...]:
    """lm-eval's simple_evaluate on an lm-eval model object (HFLM, local-completions, ...), offline, fixed seed, with
    every item's value logged."""
    from tuner.quality.evaldata import resolve_tasks, set_offline

    set_offline()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)  # lm-eval logs every step at INFO; its progress bars stay
    try:
        with tempfile.TemporaryDirectory(prefix="tuner-evals-") as include:
            resolve_tasks(tasks, Path(include))
            manager = TaskManager(include_path=include, include_defaults=False)
            out = simple_evaluate(
                model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=True,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            )
    finally:
        log.setLevel(level)
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    return tuple(task_score(name, out) for name in tasks)
