"""What every export target shares: the Export result, the notes that say how each knob was carried over, the
trial context (study, trial, measuring engine, metrics), model references and the memory-fraction formula.

Pure functions only: nothing here touches the disk, the network or a GPU.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.models import ALIASES

# Note kinds. Every knob of TrialConfig gets at least one note in every export.
MAPPED = "mapped"
APPROX = "approximated"
DROPPED = "not carried over"
INFO = "info"
KNOBS = ("model", "quant", "batch_cap", "kv_fraction", "draft", "device")

# The engine tuner measures with (tuner.engines.transformers_cb / assisted) and the step budget it derives.
MEASURING_ENGINE = "transformers-cb"
EXTRA_BATCH_TOKENS = 512  # max_batch_tokens = batch_cap + 512

# Stored bytes per parameter, roughly (4-bit formats carry per-group scales).
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "bnb-int8": 1.05, "torchao-int8wo": 1.05,
                   "bnb-nf4": 0.56, "bnb-fp4": 0.56, "torchao-int4wo": 0.56, "gptq-int4": 0.56}
# Compute dtype tuner loads each format with (tuner.quantize.torch_dtype).
COMPUTE_DTYPE = {"fp32": "float32", "fp16": "float16"}

DEFAULT_GPU_GIB = 80.0
ACTIVATION_HEADROOM = 0.02  # share of GPU memory kept for activations / CUDA graphs by the formula


@dataclass(frozen=True)
class Note:
    """How one knob was carried over to the target engine."""

    kind: str  # mapped | approximated | not carried over | info
    knob: str  # one of KNOBS, or "engine"
    text: str

    @property
    def warn(self) -> bool:
        """Printed on stderr: anything not carried over exactly, and a measuring engine that differs."""
        return self.kind in (APPROX, DROPPED) or (self.knob == "engine" and self.kind != MAPPED)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.knob}: {self.text}"


@dataclass(frozen=True)
class Context:
    """What the export knows besides the config: where it came from and what was measured.

    `paths` overrides model references: keys "model", "gguf", "gptq", "draft", "draft_gguf" (filled by the CLI from
    --model-path and from what it finds in tuner's cache; empty in golden tests, which use the pure defaults).
    """

    study: str | None = None
    trial: int | None = None
    engine: Mapping[str, Any] | None = None  # {"name", "versions": {...}, "device"}
    metrics: Mapping[str, Any] | None = None
    workload: Mapping[str, Any] | None = None  # the workload the figures were measured under
    paths: Mapping[str, str] = field(default_factory=dict)
    gpu_memory_gib: float = DEFAULT_GPU_GIB
    params: float | None = None  # parameter count of a checkpoint directory (read from its safetensors headers)
    ctx_tokens: int | None = None  # llama.cpp: the server's -c as resolved when the trial was measured
    kv_cache_gib: int | None = None  # vLLM CPU: VLLM_CPU_KVCACHE_SPACE as resolved when the trial was measured
    # sha256 of the measured files, keys as in `paths` ("model", "draft", "gguf", "draft_gguf"); a directory's is
    # that of its model.safetensors. serve.sh checks them.
    digests: Mapping[str, str] = field(default_factory=dict)
    available_gib: float | None = None  # memory available when a server engine sized its KV cache (measured)


@dataclass(frozen=True)
class Export:
    """One export: the command line (argv), its environment, the files to write and the notes."""

    target: str  # vllm | sglang | tgi | llamacpp | transformers
    engine: str  # e.g. "vLLM 0.27.1"
    config: TrialConfig
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # file name -> content (each carries the notes as comments)
    notes: list[Note]
    prepare: list[list[str]] = field(default_factory=list)  # commands to run before argv (quantize, convert)
    context: Context = field(default_factory=Context)
    params: tuple[Any, ...] = ()  # serve.sh's parameters (tuner.export.script.Param): the argv's machine-bound values

    @property
    def warnings(self) -> list[Note]:
        return [n for n in self.notes if n.warn]

    def command(self) -> str:
        return shell_command(self.argv)

    def to_dict(self) -> dict[str, Any]:
        ctx = self.context
        return {
            "target": self.target,
            "engine": self.engine,
            "command": self.command(),
            "argv": list(self.argv),
            "env": dict(self.env),
            "prepare": [shlex.join(c) for c in self.prepare],
            "parameters": {p.name: p.value for p in self.params},
            "notes": [str(n) for n in self.notes],
            "files": sorted(self.files),
            "config": self.config.to_dict(),
            "source": {"study": ctx.study, "trial": ctx.trial},
            "measured": {"engine": dict(ctx.engine) if ctx.engine else None,
                         "metrics": dict(ctx.metrics) if ctx.metrics else None,
                         "workload": dict(ctx.workload) if ctx.workload else None},
        }

    def to_json(self) -> str:
        """The export JSON; `TrialConfig.from_json` (so `tuner bench --config`) reads its `config` key."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


# ----------------------------------------------------------------------------------------------- references --- #
def model_name(model: str) -> str:
    """A short file-system friendly name for a model spec (alias, .gguf file or checkpoint directory)."""
    p = Path(model)
    return p.stem if model.endswith(".gguf") else (p.name or model)


def is_alias(model: str) -> bool:
    return model in ALIASES


def hf_ref(model: str, ctx: Context, key: str = "model", knob: str = "model") -> tuple[str, Note]:
    """The Hugging Face-format reference an engine should load for `model`, and a note on how it relates to what
    was measured. `key` selects the override in ctx.paths ("model" or "draft")."""
    if ctx.paths.get(key):
        return ctx.paths[key], Note(MAPPED, knob, f"{ctx.paths[key]} (given on the command line)")
    if is_alias(model):
        repo = ALIASES[model].upstream_repo
        return repo, Note(APPROX, knob, f"{repo} = upstream checkpoint of alias {model}. tuner measured its GGUF "
                                        f"({ALIASES[model].gguf_name}) dequantized to safetensors, so the weights it measured "
                                        "carry that file's rounding: same architecture and speed, quality may differ "
                                        "slightly (--model-path exports tuner's converted checkpoint instead)")
    if model.endswith(".gguf"):
        return model, Note(APPROX, knob, f"{model} is a GGUF file; this engine expects a Hugging Face checkpoint "
                                         "directory: pass tuner's safetensors conversion (under "
                                         "~/.cache/tuner/models/) with --model-path")
    return model, Note(MAPPED, knob, f"{model} (the checkpoint directory that was measured)")


def gptq_ref(model: str, ctx: Context) -> tuple[str, Note]:
    """The GPTQ 4-bit checkpoint (GPTQModel, bits 4, group 64) tuner built for `model`."""
    if ctx.paths.get("gptq"):
        return ctx.paths["gptq"], Note(MAPPED, "model", f"{ctx.paths['gptq']} = the GPTQ checkpoint tuner built "
                                                        f"for {model} (GPTQModel, 4 bit, group 64)")
    path = f"{model_name(model)}-gptq-int4-g64"
    return path, Note(APPROX, "model", f"{path} is a placeholder for the GPTQ checkpoint of {model} (GPTQModel, "
                                       "4 bit, group 64, calibrated on local text) that tuner writes to "
                                       "~/.cache/tuner/quant/<model>-<hash>-gptq-int4-g64 the first time it loads "
                                       "gptq-int4 (e.g. `tuner bench --config exported.json`): point the engine at "
                                       "that directory (or pass it with --model-path)")


def gguf_ref(model: str, ctx: Context, key: str = "gguf") -> str | None:
    """The GGUF file behind `model` when there is one (alias or .gguf path), else None."""
    if ctx.paths.get(key):
        return ctx.paths[key]
    if is_alias(model):
        return ALIASES[model].gguf_name
    if model.endswith(".gguf"):
        return model
    return None


ADAPTIVE_DRAFT = ("tuner measured the draft through transformers' assisted generation, which stops drafting early "
                  "when the draft's confidence falls below assistant_confidence_threshold (K is a maximum); this "
                  "engine drafts exactly K tokens per step")


def vocab_differs(config: TrialConfig) -> bool:
    """A draft alias whose tokenizer family differs from the target alias's (servers refuse or need a flag)."""
    d = config.draft_spec
    return (d.kind == "draft" and d.model is not None and is_alias(d.model) and is_alias(config.model)
            and ALIASES[d.model].family != ALIASES[config.model].family)


def same_tokenizer_note(config: TrialConfig) -> str | None:
    """A warning when a draft alias and the target alias have different tokenizers (tuner bridges them with
    transformers' universal assisted decoding; serving engines need a draft with the target's vocabulary)."""
    d = config.draft_spec
    if d.kind != "draft" or d.model is None:
        return None
    if is_alias(d.model) and is_alias(config.model) and ALIASES[d.model].family != ALIASES[config.model].family:
        return (f"draft {d.model} ({ALIASES[d.model].family}) and target {config.model} "
                f"({ALIASES[config.model].family}) have different tokenizers: tuner measured it through transformers' "
                "universal assisted decoding, which this engine does not have: it needs a draft with the "
                "target's vocabulary")
    return None


# ------------------------------------------------------------------------------------------ memory fraction --- #
def weight_gib(model: str, quant: str, params: float | None = None) -> float | None:
    """Approximate size of the weights in GiB: parameters (known for aliases, else `params`) x bytes per parameter
    of the format. None when the parameter count is unknown."""
    n = ALIASES[model].params if model in ALIASES else params
    return None if not n else n * BYTES_PER_PARAM[quant] / 2**30


def memory_fraction(config: TrialConfig, ctx: Context, headroom: float) -> tuple[float, str]:
    """Turn tuner's KV fraction (share of the memory left FREE after the weights) into a share of TOTAL device
    memory covering weights + KV cache (+ `headroom` for activations when the engine counts them):

        fraction = w + kv * (1 - w) + headroom,  w = weights / device memory

    rounded up to 0.01 and kept in [0.05, 0.95]. Returns the value and a sentence showing the arithmetic."""
    gib = weight_gib(config.model, config.quant, ctx.params)
    total = ctx.gpu_memory_gib
    w = min(gib / total, 0.9) if gib else 0.0
    kv = config.kv_fraction
    raw = w + kv * (1 - w) + headroom
    value = min(0.95, max(0.05, math.ceil(round(raw * 100, 6)) / 100))
    size = (f"weights ~{gib:.2f} GiB ({config.quant}) on an assumed {total:g} GiB GPU" if gib else
            f"weight size unknown for {config.model!r}, counted as 0: add weights/GPU memory yourself")
    clamp = " (clamped to [0.05, 0.95])" if value != math.ceil(round(raw * 100, 6)) / 100 else ""
    text = (f"w + kv*(1-w) + h = {w:.4f} + {kv:g}*(1-{w:.4f}) + {headroom:g} = {raw:.4f} -> {value:.2f}{clamp}; "
            f"w = {size} (--gpu-memory-gib sets it); approximation: tuner's fraction is of the memory left free "
            "after the weights, this one is of the whole device")
    return value, text


# ---------------------------------------------------------------------------------------------- provenance --- #
def engine_label(engine: Mapping[str, Any] | None) -> str:
    if not engine:
        return "an unrecorded engine"
    versions = engine.get("versions") or {}
    v = ", ".join(f"{k} {versions[k]}" for k in sorted(versions) if versions[k] is not None)
    device = engine.get("device")
    return f"{engine.get('name', '?')}" + (f" ({v})" if v else "") + (f" on {device}" if device else "")


def engine_note(ctx: Context, target_engine: str, same: bool) -> Note:
    """Says which engine and versions the figures were measured on, and whether the target differs."""
    where = engine_label(ctx.engine)
    if not ctx.engine:
        return Note(INFO, "engine", f"the engine the figures were measured on was not recorded; this export targets "
                                    f"{target_engine}: re-measure before relying on any figure")
    if same:
        return Note(MAPPED, "engine", f"figures were measured on {where}, the engine this export targets")
    return Note(INFO, "engine", f"figures were measured on {where}; {target_engine} is a different engine, "
                                "so its latency and throughput will differ: re-measure before relying on them")


def _pct(m: Mapping[str, Any], key: str, q: str) -> str | None:
    v = m.get(key)
    if isinstance(v, Mapping) and isinstance(v.get(q), (int, float)):
        return f"{v[q]:.1f} ms"
    return None


def capacity_line(cap: Mapping[str, Any]) -> str:
    """One line on a measured capacity: the rate, its bracket, the SLO (attainment included) and the verdict."""
    from tuner.slo import SLO

    try:
        slo = "; ".join(SLO.from_dict(dict(cap.get("slo") or {})).terms())
    except Exception:  # an SLO this version cannot read back: say so rather than guess
        slo = "(SLO not recorded)"
    bracket = [v for v in (cap.get("requests_per_s_ci") or [])[:2] if isinstance(v, (int, float))]
    span = f" (bracket {bracket[0]:.3g}-{bracket[1]:.3g})" if len(bracket) == 2 else ""
    verdict = cap.get("verdict")
    if verdict == "meets":
        return f"Capacity: {cap['requests_per_s']:.3g} req/s{span} shown to meet the SLO {slo}."
    if verdict == "misses":
        return f"Capacity: none: the SLO {slo} is missed with confidence at every rate probed."
    return f"Capacity: indeterminate{span}: no rate was shown to meet the SLO {slo}."


def measured_lines(ctx: Context) -> list[str]:
    """A few lines summarising what the trial measured (for comments)."""
    src = f"study {ctx.study!r}, trial {ctx.trial}" if ctx.study is not None else "a TrialConfig (no study)"
    lines = [f"Source: {src}; measured on {engine_label(ctx.engine)}."]
    m = ctx.metrics or {}
    cap = m.get("capacity") if isinstance(m.get("capacity"), Mapping) else None
    if cap and isinstance(cap.get("requests_per_s"), (int, float)):
        lines.append(capacity_line(cap))
    if m:
        parts = []
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
            p50, p99 = _pct(m, key, "p50"), _pct(m, key, "p99")
            if p50:
                parts.append(f"{label} p50 {p50}" + (f" / p99 {p99}" if p99 else ""))
        for key, label in (("output_tokens_per_s", "output tok/s"), ("requests_per_s", "req/s")):
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{m[key]:.2f} {label}")
        if isinstance(m.get("completed"), int):
            parts.append(f"{m['completed']} completed / {m.get('failed', 0)} failed")
        if isinstance(m.get("acceptance_rate"), (int, float)):
            parts.append(f"draft acceptance {m['acceptance_rate']:.2f}")
        if parts:
            lines.append("Measured: " + "; ".join(parts) + ".")
    return lines


def header_lines(exp_engine: str, config: TrialConfig, ctx: Context, notes: list[Note]) -> list[str]:
    """The comment block every file starts with: what, from where, and every knob's fate."""
    lines = [f"Generated by `tuner export` for {exp_engine}.", *measured_lines(ctx),
             f"Config: {config.to_json()}", "Knobs:"]
    lines += [f"  {n}" for n in notes]
    return lines


def comment(lines: list[str], prefix: str = "# ") -> str:
    return "".join(f"{prefix}{line}".rstrip() + "\n" for line in lines)


# --------------------------------------------------------------------------------------------------- shell --- #
def shell_command(argv: list[str]) -> str:
    """argv as one shell line, one option per continued line when long."""
    if len(argv) <= 3:
        return shlex.join(argv)
    lead = 3 if argv[:2] == ["python", "-m"] else 1
    out, cur = [], list(argv[:lead])
    for tok in argv[lead:]:
        if tok.startswith("-"):
            out.append(shlex.join(cur))
            cur = [tok]
        else:
            cur.append(tok)
    out.append(shlex.join(cur))
    return " \\\n  ".join(out)


def shell_script(exp_engine: str, config: TrialConfig, ctx: Context, notes: list[Note], argv: list[str],
                 prepare: list[list[str]] | None = None, env: Mapping[str, str] | None = None) -> str:
    """A runnable bash script: the header comments, the preparation steps, then `exec` the server."""
    text = "#!/usr/bin/env bash\n" + comment(header_lines(exp_engine, config, ctx, notes)) + "set -euo pipefail\n"
    for cmd in prepare or []:
        text += shlex.join(cmd) + "\n"
    for k, v in (env or {}).items():
        text += f"export {k}={shlex.quote(v)}\n"
    return text + "exec " + shell_command(argv) + "\n"


def compute_dtype(quant: str) -> str:
    return COMPUTE_DTYPE.get(quant, "bfloat16")


def fmt_float(x: float) -> str:
    """0.05 -> '0.05', 1.0 -> '1.0' (stable text for argv)."""
    return repr(round(float(x), 4))


def bnb_prequantize(src: str, quant: str) -> tuple[str, list[str]]:
    """A command that saves `src` quantized by bitsandbytes the way tuner loads `quant` (for engines that only
    read pre-quantized 8-bit / FP4 checkpoints). Returns the output directory and the command."""
    dst = f"{model_name(src)}-{quant}"
    if quant == "bnb-int8":
        kw = "load_in_8bit=True"
    else:
        kw = f"load_in_4bit=True, bnb_4bit_quant_type={_py(quant[4:])}, bnb_4bit_compute_dtype=torch.bfloat16"
    code = ("import torch; from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig; "
            f"m = AutoModelForCausalLM.from_pretrained({_py(src)}, dtype=torch.bfloat16, device_map=\"cuda\", "
            f"quantization_config=BitsAndBytesConfig({kw})); m.save_pretrained({_py(dst)}); "
            f"AutoTokenizer.from_pretrained({_py(src)}).save_pretrained({_py(dst)})")
    return dst, ["python", "-c", code]


def _py(text: str) -> str:
    """A double-quoted Python string literal (reads well inside single-quoted shell words)."""
    return json.dumps(text)
