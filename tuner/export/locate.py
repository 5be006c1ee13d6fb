"""Find, without loading or writing anything, the local files an export can point at: the GGUF file behind an
alias or a .gguf model, and the GPTQ checkpoint tuner cached for a model. Used by the CLI only; the pure export
functions fall back to portable references when nothing is found."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.models import ALIASES, alias_gguf_on_disk, cache_root


def gguf_path(model: str) -> Path | None:
    if model in ALIASES:
        return alias_gguf_on_disk(model)
    path = Path(model).expanduser()
    return path.resolve() if model.endswith(".gguf") and path.is_file() else None


def gptq_path(model: str) -> Path | None:
    """tuner's cached GPTQ checkpoint for `model` (see tuner.quantize.gptq_dir), when exactly one is found."""
    src = gguf_path(model) if (model in ALIASES or model.endswith(".gguf")) else Path(model).expanduser()
    if src is None:
        return None
    quant = cache_root() / "quant"
    if not quant.is_dir():
        return None
    found = [d for d in quant.glob(f"{src.stem}-*-gptq-int4-g64") if (d / "config.json").is_file()]
    return found[0] if len(found) == 1 else None


def locate(config: TrialConfig, model_path: str | None = None) -> dict[str, str]:
    """ctx.paths for `config`: --model-path overrides, then what is found on disk."""
    paths: dict[str, str] = {}
    if model_path:
        paths["model"] = model_path
        if model_path.endswith(".gguf"):
            paths["gguf"] = model_path
        if config.quant == "gptq-int4":
            paths["gptq"] = model_path
    if "gguf" not in paths and (p := gguf_path(config.model)):
        paths["gguf"] = str(p)
    if config.quant == "gptq-int4" and "gptq" not in paths and (p := gptq_path(config.model)):
        paths["gptq"] = str(p)
    d = config.draft_spec
    if d.kind == "draft" and d.model and (p := gguf_path(d.model)):
        paths["draft_gguf"] = str(p)
    return paths


def checkpoint_params(model: str) -> float | None:
    """Parameter count of a checkpoint directory from its *.safetensors headers (no tensor is read)."""
    path = Path(model).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    total = 0
    try:
        for f in files:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return float(total) or None


def measured_settings(config: TrialConfig, engine: dict[str, Any] | None, paths: dict[str, str],
                      model_path: str | None = None) -> dict[str, Any]:
    """What a server engine resolved and served when the trial was measured (llama.cpp: -c and the quantized GGUF;
    vLLM: the converted checkpoint and VLLM_CPU_KVCACHE_SPACE), so its export is that command. Updates `paths` in place; returns extra Context fields."""
    from tuner.engines.registry import backend

    settings = (engine or {}).get("settings") or {}
    target = backend(config.engine).export_to  # the target whose terms the engine recorded its settings in
    if target is None:  # in-process, or a server tuner did not launch: nothing a launched server resolved
        return {}
    # the files that were served (model, draft, their sources) and their sha256, as the engine recorded them: the
    # export names the measured files (serve.sh's defaults, checked there), wherever they are now
    served = dict(settings.get("paths") or {})
    if target == "vllm" and settings.get("model_dir"):
        served.setdefault("model", settings["model_dir"])
    if target == "llamacpp" and settings.get("gguf"):
        served.setdefault("served_gguf", settings["gguf"])
    for key, value in served.items():
        if not (model_path and key in ("model", "gguf", "served_gguf")):
            paths[key] = value
    digests = {k: v for k, v in (settings.get("sha256") or {}).items() if isinstance(v, str)}
    if target == "vllm":  # the converted checkpoint that was served, and the KV space it was given
        return {"kv_cache_gib": settings.get("kv_cache_gib"), "digests": digests}
    avail = settings.get("available_bytes")
    return {"ctx_tokens": settings.get("ctx_tokens"), "digests": digests,
            "available_gib": avail / 2**30 if isinstance(avail, (int, float)) else None}
