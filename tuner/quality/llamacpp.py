"""Quality of what llama-server serves: the exact GGUF file and KV-cache type, scored by llama.cpp's own
`llama-perplexity` built from the same tree (0c1e57098) by `make llamacpp`.

Why this route (README, "Quality on llama.cpp"): this llama-server ignores `echo` and returns log-probs only for
generated tokens, so lm-eval's `gguf`/`local-completions` models (which need prompt log-probs) cannot score it;
`llama-perplexity` runs the same ggml kernels on the same GGUF with the same `-ctk/-ctv`, and is what llama.cpp users
already quote for a quantization (KLD, top-1 agreement, multiple-choice scores).

* Tasks: the items are lm-eval's own — the task YAMLs of `evals/`, the first `limit` documents, lm-eval's context
  and continuations (`build_all_requests`) — written in llama-perplexity's `--multiple-choice` binary format.
  llama.cpp scores each choice by the mean log-prob per token of `context + " " + choice` after the tokens all
  choices share, and picks the best: metric `acc_per_token` (lm-eval's acc sums the log-probs, acc_norm divides by
  bytes, so the figures are comparable across llama.cpp configs, not with a transformers `tuner eval`). The
  per-item 0/1 values come from its running accuracy lines, so the paired comparison and the gate of tuner.quality.gate
  apply unchanged. Tasks whose choices change the context (winogrande) cannot be written in that format: refused.
* Baseline: the F32 GGUF of the same weights (llama-quantize from the model's GGUF) with an f32 KV cache.
* KLD: `--kl-divergence-base` on the baseline over the held text (LAMBADA passages, 512-token chunks, the second half
  of each scored: 255 tokens), then `--kl-divergence` on the candidate; mean ± stderr, 99th percentile and "Same top
  p" (top-1 agreement) as llama.cpp prints them.
* Cache: tuner.quality.template's (this module gives its two steps, plan_scoring and score_config), keyed by model
  hash, engine, weight type, KV type, tasks, limit, seed, KLD tokens and the llama.cpp commit + lm-eval/datasets
  versions.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.errors import TunerError, UnsupportedConfig
from tuner.quality.common import TaskScore, digest, package_versions, read_cache, results_dir, write_json_atomic
from tuner.quality.kld import KLD_CTX, KLDResult, scored_per_chunk
from tuner.quality.template import Plan

BASELINE_QUANT, BASELINE_KV = "F32", "f32"
METRIC = "acc_per_token"
MC_CTX = 2048  # tokens per multiple-choice sequence slot (one slot per choice, at least 4)
TIMEOUT_S = 3600.0
SCOREABLE = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "boolq")  # one context shared by every choice
_ACC_LINE = re.compile(r"^(\d+)\t(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class ChoiceTask:
    doc_id: int
    question: str
    answers: tuple[str, ...]
    gold: int


# ------------------------------------------------------------------------------------------------ items ---- #
def choice_tasks(name: str, limit: int) -> list[ChoiceTask]:
    """lm-eval's own requests for the first `limit` documents of task `name` (context and continuations)."""
    from tuner.quality.evaldata import resolve_tasks, set_offline

    set_offline()
    from lm_eval.tasks import TaskManager, get_task_dict

    with tempfile.TemporaryDirectory(prefix="tuner-evals-") as include:
        resolve_tasks((name,), Path(include))
        task_dict = get_task_dict([name], TaskManager(include_path=include, include_defaults=False))
    leaves = [(k, t) for k, t in _leaves(task_dict)]
    if len(leaves) != 1:
        raise UnsupportedConfig(f"task {name!r} is a group of {len(leaves)} tasks: engine llamacpp scores single "
                                "multiple-choice tasks (arc_easy, arc_challenge, piqa, hellaswag, boolq)")
    task = leaves[0][1]
    if task.OUTPUT_TYPE != "multiple_choice":
        raise UnsupportedConfig(f"task {name!r} is {task.OUTPUT_TYPE}: llama-perplexity scores multiple-choice tasks")
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    by_doc: dict[int, list[Any]] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    out = []
    for doc_id in sorted(by_doc):
        insts = sorted(by_doc[doc_id], key=lambda i: i.idx)
        contexts = {i.arguments[0] for i in insts}
        if len(contexts) != 1:
            raise UnsupportedConfig(f"task {name!r}: its choices change the context (doc {doc_id}), which "
                                    "llama-perplexity --multiple-choice cannot score; accepted: arc_easy, "
                                    "arc_challenge, piqa, hellaswag, boolq")
        answers = tuple(_strip_delimiter(i.arguments[1]) for i in insts)
        if any(all(other.startswith(a) for other in answers) for a in answers):
            continue  # a choice that begins every other (e.g. two identical choices): nothing is left to score it
            # by, and llama-perplexity would read past its tokens; skipped for every config alike (paired)
        doc = insts[0].doc
        target = task.doc_to_target(doc)
        if isinstance(target, str):
            target = list(task.doc_to_choice(doc)).index(target)
        out.append(ChoiceTask(doc_id, contexts.pop(), answers, int(target)))
    return out


def _leaves(task_dict: dict[Any, Any]) -> list[tuple[Any, Any]]:
    out = []
    for k, v in task_dict.items():
        out.extend(_leaves(v) if isinstance(v, dict) else [(k, v)])
    return out


def _strip_delimiter(continuation: str) -> str:
    """llama-perplexity joins context and choice with one space: lm-eval's continuation carries that space."""
    return continuation[1:] if continuation.startswith(" ") else continuation


def encode_tasks(tasks: list[ChoiceTask]) -> bytes:
    """llama-perplexity's --multiple-choice file: u32 count, u32 offset per task, then each task as
    (question, mc1 answers + labels, mc2 answers + labels) with u32-length-prefixed UTF-8 strings."""
    def string(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<I", len(b)) + b

    blobs = []
    for t in tasks:
        labels = [1 if i == t.gold else 0 for i in range(len(t.answers))]
        blob = string(t.question) + struct.pack("<I", len(t.answers)) + b"".join(string(a) for a in t.answers)
        blob += struct.pack(f"<{len(labels)}i", *labels) + struct.pack("<I", 0)  # mc2: none
        blobs.append(blob)
    head = 4 + 4 * len(tasks)
    offsets, pos = [], head
    for b in blobs:
        offsets.append(pos)
        pos += len(b)
    return struct.pack("<I", len(tasks)) + struct.pack(f"<{len(tasks)}I", *offsets) + b"".join(blobs)


# ------------------------------------------------------------------------------------- llama-perplexity ---- #
def perplexity_argv(gguf: Path, kv_type: str, *extra: str) -> list[str]:
    from tuner.engines.llamacpp import binary

    argv = [str(binary("llama-perplexity")), "-m", str(gguf), "-t", str(os.cpu_count() or 1), "--no-warmup"]
    if kv_type != "auto":
        argv += ["-ctk", kv_type, "-ctv", kv_type]
    return argv + list(extra)


def run_perplexity(argv: list[str], what: str) -> str:
    """Run llama-perplexity; its whole output (stdout + stderr), or one line with its last error."""
    from tuner.engines.server import last_error_line

    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, start_new_session=False)
    except subprocess.TimeoutExpired:
        raise TunerError(f"llama-perplexity ({what}) ran past {TIMEOUT_S:g} s") from None
    out = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        raise UnsupportedConfig(f"llama-perplexity ({what}) failed (exit {proc.returncode}): "
                                f"{last_error_line(out.splitlines())}")
    return out


def parse_choices(output: str, n: int, what: str) -> list[float]:
    """Per-task 0/1 from the running accuracy lines `<n done>\\t<100 * correct / done>` (tasks in file order)."""
    correct, values = 0, []
    for line in output.splitlines():
        m = _ACC_LINE.match(line.strip())
        if not m or int(m.group(1)) != len(values) + 1:
            continue
        done = int(m.group(1))
        now = round(float(m.group(2)) * done / 100.0)
        values.append(float(now - correct))
        correct = now
    if len(values) != n or any(v not in (0.0, 1.0) for v in values):
        raise TunerError(f"llama-perplexity ({what}) scored {len(values)} of {n} tasks: its output format differs "
                         f"from llama.cpp 0c1e57098's")
    return values


def parse_kld(output: str, n_tokens: int) -> KLDResult:
    def grab(pattern: str) -> re.Match[str]:
        m = re.search(pattern, output, re.MULTILINE)
        if m is None:
            raise TunerError(f"llama-perplexity --kl-divergence printed no {pattern!r} line")
        return m

    mean = grab(r"^Mean\s+KLD:\s+(-?[\d.]+)\s+±\s+([\d.]+)")
    p99 = grab(r"^99\.0%\s+KLD:\s+(-?[\d.]+)")
    top = grab(r"^Same top p:\s+([\d.]+)\s+±")
    return KLDResult(mean=max(0.0, float(mean.group(1))), mean_stderr=float(mean.group(2)),
                     p99=float(p99.group(1)), top1_agree=float(top.group(1)) / 100.0, n_tokens=n_tokens)


def score_tasks(gguf: Path, kv_type: str, names: tuple[str, ...], limit: int, progress: bool) -> tuple[Any, ...]:
    """TaskScore per task (acc_per_token, stderr, items) of `gguf` served with `kv_type`."""
    import math
    import sys

    scores = []
    for name in names:
        tasks = choice_tasks(name, limit)
        with tempfile.TemporaryDirectory(prefix="tuner-mc-") as d:
            path = Path(d) / f"{name}.bin"
            path.write_bytes(encode_tasks(tasks))
            if progress:
                print(f"tuner eval: llama-perplexity --multiple-choice {name} ({len(tasks)} items) on {gguf.name}, "
                      f"KV {kv_type}", file=sys.stderr, flush=True)
            slots = max(4, max(len(t.answers) for t in tasks))  # every choice of a task needs its own sequence
            out = run_perplexity(perplexity_argv(gguf, kv_type, "--multiple-choice", "-bf", str(path), "-np",
                                                 str(slots), "-c", str(MC_CTX), "-b", str(MC_CTX)),
                                 f"{name} on {gguf.name}")
        values = parse_choices(out, len(tasks), f"{name} on {gguf.name}")
        n = len(values)
        acc = sum(values) / n
        stderr = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else 0.0
        items = tuple((str(t.doc_id), v) for t, v in zip(tasks, values, strict=True))
        scores.append(TaskScore(name, METRIC, acc, stderr, n, items))
    return tuple(scores)


# ------------------------------------------------------------------------------------------------- KLD ---- #
def held_text(kld_tokens: int) -> str:
    """LAMBADA passages joined by blank lines, comfortably more text than the scored chunks need."""
    from tuner.quality.evaldata import lambada_passages

    need_chars = 8 * KLD_CTX * n_chunks(kld_tokens)
    parts: list[str] = []
    size = 0
    for p in lambada_passages():
        parts.append(p)
        size += len(p) + 2
        if size >= need_chars:
            break
    return "\n\n".join(parts)


def n_chunks(kld_tokens: int) -> int:
    return -(-kld_tokens // scored_per_chunk())


def base_logits(model: str, model_hash: str, kld_tokens: int, progress: bool) -> Path:
    """The baseline's (F32 weights, f32 KV) log-probs on the held text, llama.cpp's --kl-divergence-base file."""
    import sys

    from tuner.engines.llamacpp import COMMIT, quantized_gguf

    key = {"kind": "llamacpp-kld-base", "model_hash": model_hash, "kld_tokens": kld_tokens, "ctx": KLD_CTX,
           "commit": COMMIT}
    path = results_dir() / model_hash / f"llamacpp-kld-base-{digest(key)}.bin"
    if path.is_file():
        return path
    gguf = quantized_gguf(model, BASELINE_QUANT)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tuner-kld-", dir=path.parent) as d:
        text = Path(d) / "held.txt"
        text.write_text(held_text(kld_tokens), encoding="utf-8")
        tmp = Path(d) / "base.bin"
        if progress:
            print(f"tuner eval: llama-perplexity --kl-divergence-base on {gguf.name} ({n_chunks(kld_tokens)} chunks)",
                  file=sys.stderr, flush=True)
        run_perplexity(perplexity_argv(gguf, BASELINE_KV, "-f", str(text), "-c", str(KLD_CTX), "-b", str(KLD_CTX),
                                       "--chunks", str(n_chunks(kld_tokens)), "--kl-divergence-base", str(tmp)),
                       f"KLD base on {gguf.name}")
        os.replace(tmp, path)
    return path


def score_kld(config: TrialConfig, model_hash: str, kld_tokens: int, progress: bool = True) -> tuple[KLDResult, bool]:
    """KLD of the served GGUF + KV type from the F32/f32 baseline, through the cache. Returns (result, cached)."""
    from tuner.engines.llamacpp import quantized_gguf

    n_tokens = n_chunks(kld_tokens) * scored_per_chunk()
    if is_baseline(config):
        return KLDResult(0.0, 0.0, 0.0, 1.0, n_tokens), False
    key = {"kind": "llamacpp-kld", "model_hash": model_hash, "quant": config.quant, "kv_type": config.kv_type,
           "kld_tokens": kld_tokens, "ctx": KLD_CTX, "versions": versions()}
    path = results_dir() / model_hash / f"llamacpp-kld-{config.quant}-{config.kv_type}-{digest(key)}.json"
    hit = read_cache(path, key)
    if hit is not None:
        return KLDResult(**hit), True
    base = base_logits(config.model, model_hash, kld_tokens, progress)
    gguf = quantized_gguf(config.model, config.quant)
    out = run_perplexity(perplexity_argv(gguf, config.kv_type, "-c", str(KLD_CTX), "-b", str(KLD_CTX),
                                         "--chunks", str(n_chunks(kld_tokens)), "--kl-divergence-base", str(base),
                                         "--kl-divergence"), f"KLD on {gguf.name}")
    result = parse_kld(out, n_tokens)
    write_json_atomic(path, {"key": key, "result": result.to_dict()})
    return result, False


# --------------------------------------------------------------------------------------------- scoring ---- #
def is_baseline(config: TrialConfig) -> bool:
    return config.quant == BASELINE_QUANT and config.kv_type == BASELINE_KV


def baseline_config(config: TrialConfig) -> TrialConfig:
    return config.replace(quant=BASELINE_QUANT, kv_type=BASELINE_KV, draft="none")


def versions() -> dict[str, str]:
    from tuner.engines.llamacpp import COMMIT

    return {"llama.cpp": COMMIT, **package_versions(["lm_eval", "datasets"])}


def check_available(names: tuple[str, ...] = ()) -> None:
    """The tools exist and every task can be written in llama-perplexity's multiple-choice format."""
    from tuner.engines.llamacpp import binary

    for name in names:
        if name == "winogrande":
            raise UnsupportedConfig("task 'winogrande': its choices change the context, which llama-perplexity "
                                    f"--multiple-choice cannot score; accepted with engine llamacpp: {', '.join(SCOREABLE)}")
        if name not in SCOREABLE:
            raise UnsupportedConfig(f"task {name!r} is not scored on engine llamacpp: accepted {', '.join(SCOREABLE)} "
                                    "(single multiple-choice tasks with one context)")
    binary("llama-perplexity")
    binary("llama-quantize")


def plan_scoring(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool = True) -> Plan:
    """The template's first step (tuner.quality.template): a GGUF source (a checkpoint directory is refused), the key
    of weight type + KV type + llama.cpp commit, the F32/f32 config as the baseline."""
    from tuner.engines.llamacpp import source_gguf
    from tuner.models import resolve_source, source_hash

    source_gguf(config.model)  # llama.cpp serves GGUF files: a checkpoint directory is refused here
    model_hash = source_hash(resolve_source(config.model))
    vers = versions()
    key = {"schema": 2, "engine": "llamacpp", "model_hash": model_hash, "quant": f"llamacpp-{config.quant}-"
           f"{config.kv_type}", "tasks": sorted(names), "limit": limit, "seed": seed, "kld_tokens": kld_tokens,
           "ctx": MC_CTX, "versions": vers}
    return Plan(model_hash, vers, key, None if is_baseline(config) else baseline_config(config))


def score_config(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool, plan: Plan) -> tuple[tuple[TaskScore, ...], KLDResult]:
    """llama-perplexity's multiple-choice scores of the served GGUF + KV type, and its KLD from F32/f32."""
    from tuner.engines.llamacpp import quantized_gguf

    scores = score_tasks(quantized_gguf(config.model, config.quant), config.kv_type, names, limit, progress)
    kld, _ = score_kld(config, plan.model_hash, kld_tokens, progress)
    return scores, kld


# ------------------------------------------------------------------ the registry's quality API (registry.py) --- #
def check_inputs(config: TrialConfig, names: tuple[str, ...]) -> None:
    check_available(names)


def screen_kld(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int, model_hash: str,
               progress: bool = True) -> tuple[KLDResult, bool, dict[str, str]]:
    """The KLD alone (llama-perplexity --kl-divergence, no tasks), through its cache: (result, cached, versions)."""
    vers = versions()
    kld, cached = score_kld(config, model_hash, kld_tokens, progress)
    return kld, cached, vers


def baseline_description(model: str, source: Any) -> str:
    from tuner.models import ALIASES

    return (f"the F32 GGUF made by llama-quantize from {source.path.name} "
            f"(lineage {ALIASES[model].lineage_quant if model in ALIASES else 'of that file'}), f32 KV cache, scored by llama-perplexity")
