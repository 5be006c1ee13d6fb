"""Quality of a transformers config (the registry's quality module for engine `transformers`): lm-eval on the very
model object `load_model(config)` returns, the baseline the fp32 model of the same weights, the KLD over full
distributions (tuner.quality.kld); cached as tuner.quality.gate describes."""

from __future__ import annotations

import gc
import time
from typing import Any

from tuner.config import TrialConfig, resolve_device
from tuner.errors import UnsupportedConfig
from tuner.quality.common import (
    BASELINE,
    assemble_result,
    cache_key,
    cache_path,
    cached_result,
    library_versions,
    run_suite,
    store_result,
)


def check_inputs(config: TrialConfig, names: tuple[str, ...]) -> None:
    """The format and its baseline run on the device (cheap when the device is auto and they run anywhere)."""
    from tuner.quantize import unsupported_reason

    quants = sorted({config.quant, BASELINE})
    if config.device == "auto" and not any(unsupported_reason(q, d) for q in quants for d in ("cpu", "cuda")):
        return  # runs anywhere: no need to import torch to find the device (keeps cache hits instant)
    device = resolve_device(config.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedConfig("device 'cuda' was requested but no CUDA GPU is visible: use --device cpu or auto")
    for quant in quants:
        reason = unsupported_reason(quant, device)
        if reason:
            raise UnsupportedConfig(f"format {quant!r} is unsupported on {device}: {reason}")


def score_quality(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                  progress: bool = True) -> Any:
    """QualityResult of `config` (tasks, drop and KLD vs the fp32 baseline, scored first), through the cache."""
    from tuner.models import resolve_source, source_hash
    from tuner.quality.gate import score_quality as score_any
    from tuner.quality.kld import score_kld

    t0 = time.perf_counter()
    model_hash = source_hash(resolve_source(config.model))
    versions = library_versions(config.quant)
    key = cache_key(model_hash, config.quant, names, limit, seed, kld_tokens, versions)
    path = cache_path(key)
    hit = cached_result(path, key, config, names, t0)
    if hit is not None:
        return hit

    baseline = None
    own_start = t0
    if config.quant != BASELINE:
        baseline = score_any(config.replace(quant=BASELINE), names, limit, seed, kld_tokens=kld_tokens,
                             progress=progress)
        own_start = time.perf_counter()  # compute_s counts this format's own work, not the baseline's

    from tuner.quantize import load_model

    model, tokenizer = load_model(config)
    try:
        scores = run_suite(model, tokenizer, names, limit, seed)
        kld, _ = score_kld(config, model_hash, kld_tokens, versions, progress, model, tokenizer)
    finally:
        del model, tokenizer
        gc.collect()

    return store_result(path, key, assemble_result(config, scores, baseline, kld, limit, seed, model_hash, versions,
                                                   t0, own_start))


def screen_kld(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int, model_hash: str,
               progress: bool = True) -> tuple[Any, bool, dict[str, str]]:
    """The KLD alone (no lm-eval), through its cache: (KLDResult, cached, versions)."""
    from tuner.quality.kld import score_kld

    versions = library_versions(config.quant)
    kld, cached = score_kld(config, model_hash, kld_tokens, versions, progress)
    return kld, cached, versions


def baseline_description(model: str, source: Any) -> str:
    from tuner.models import ALIASES

    if source.kind == "alias":
        return (f"fp32 dequantized from the bundled GGUF (already 4-bit lineage: {ALIASES[model].lineage_quant if model in ALIASES else '?'}), "
                "not the original bf16 checkpoint")
    if source.kind == "gguf":
        return (f"fp32 dequantized from the GGUF file {source.path.name} (it keeps that file's quantization), "
                "not the original checkpoint")
    return f"the checkpoint's own weights in fp32 ({source.path})"
