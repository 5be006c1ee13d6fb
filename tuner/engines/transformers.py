"""The transformers engine (in-process): loads the model with its format and serves it through continuous batching
(tuner.engines.transformers_cb), or through assisted generation (tuner.engines.assisted) when the config drafts,
loading the draft's assistant model too. The registry's engine module for engine `transformers`."""

from __future__ import annotations

import importlib.util
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Engine


def open_engine(config: TrialConfig, ignore_eos: bool, log_path: Any = None) -> tuple[Engine, Any, Any]:
    """(engine, model, tokenizer): the model loaded here (returned for the draft-output check and the roofline)."""
    from tuner.quantize import load_model

    model, tokenizer = load_model(config)
    return make_engine(model, tokenizer, config, ignore_eos), model, tokenizer


def make_engine(model: Any, tokenizer: Any, config: TrialConfig, ignore_eos: bool) -> Engine:
    """Continuous batching without a draft; assisted generation with one (its assistant model loaded here, at the
    target's compute dtype)."""
    if config.draft == "none":
        from tuner.engines.transformers_cb import ContinuousBatchingEngine

        return ContinuousBatchingEngine(model, tokenizer, config, ignore_eos=ignore_eos)
    from tuner.engines.assisted import AssistedEngine

    if config.draft_spec.kind == "draft":
        from tuner.quantize import load_model

        quant = "fp32" if config.quant == "fp32" else "bf16"  # the assistant runs at the target's compute dtype
        assistant = load_model(TrialConfig(model=config.draft_spec.model, quant=quant, device=config.device))
        return AssistedEngine(model, tokenizer, config, ignore_eos=ignore_eos, assistant=assistant)
    return AssistedEngine(model, tokenizer, config, ignore_eos=ignore_eos)


def without_draft(config: TrialConfig, model: Any, tokenizer: Any, ignore_eos: bool) -> Engine:
    """A draft's reference: the same assisted-generation engine (same weights, same batch-1 decoders), no draft."""
    from tuner.engines.assisted import AssistedEngine

    return AssistedEngine(model, tokenizer, config.replace(draft="none"), ignore_eos=ignore_eos)


def serves_on_host_cpu(config: TrialConfig, device: str) -> bool:
    return device == "cpu"


def availability() -> tuple[bool, str]:
    ok = importlib.util.find_spec("transformers") is not None
    return ok, "in-process continuous batching / assisted generation" if ok else "pip install transformers"


def format_reason(quant: str, device: str) -> str | None:
    from tuner.quantize import unsupported_reason

    return unsupported_reason(quant, device)


def check_runs(device: str, model: str, endpoint: str | None = None, served_model: str | None = None) -> None:
    """Nothing to check before a search: the model loads in the trial's own process."""
