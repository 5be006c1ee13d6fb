"""Quality of a transformers config (the registry's quality module for engine `transformers`): lm-eval on the very
model object `load_model(config)` returns, the baseline the fp32 model of the same weights, the KLD over full
distributions (tuner.quality.kld); its two steps of tuner.quality.template's scoring template, cached as
tuner.quality.gate describes."""

from __future__ import annotations

import gc
from typing import Any

from tuner.config import TrialConfig, resolve_device
from tuner.errors import UnsupportedConfig
from tuner.quality.common import BASELINE, TaskScore, cache_key, library_versions, run_suite
from tuner.quality.template import Plan


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


def plan_scoring(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool = True) -> Plan:
    """The template's first step (tuner.quality.template): the cache key of the weights + format (not the device or
    the serving knobs), the fp32 model of the same weights as the baseline."""
    from tuner.models import resolve_source, source_hash

    model_hash = source_hash(resolve_source(config.model))
    versions = library_versions(config.quant)
    key = cache_key(model_hash, config.quant, names, limit, seed, kld_tokens, versions)
    baseline = None if config.quant == BASELINE else config.replace(quant=BASELINE)
    return Plan(model_hash, versions, key, baseline)


def score_config(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool, plan: Plan) -> tuple[tuple[TaskScore, ...], Any]:
    """lm-eval on the very model `load_model(config)` returns, and its KLD from the fp32 reference (one load)."""
    from tuner.quality.kld import score_kld
    from tuner.quantize import load_model

    model, tokenizer = load_model(config)
    try:
        scores = run_suite(model, tokenizer, names, limit, seed)
        kld, _ = score_kld(config, plan.model_hash, kld_tokens, plan.versions, progress, model, tokenizer)
    finally:
        del model, tokenizer
        gc.collect()
    return scores, kld


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
