"""Serving engines behind one small contract (`tuner.engines.base.Engine`), found through a lazy registry.

An engine that runs in-process (transformers continuous batching, assisted generation) and one driven over the
OpenAI-compatible HTTP API (llama.cpp's server, vLLM, SGLang, TGI) plug into the same load generator and metrics.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:attr" (imported only when used)
ENGINES: dict[str, str] = {
    "transformers-cb": "tuner.engines.transformers_cb:ContinuousBatchingEngine",
    "transformers-assisted": "tuner.engines.assisted:AssistedEngine",
    "llamacpp": "tuner.engines.llamacpp:LlamaCppEngine",
    "vllm": "tuner.engines.vllm:VllmEngine",
    "endpoint": "tuner.engines.endpoint:EndpointEngine",
}


def get_engine_class(name: str) -> Any:
    from tuner.errors import TunerError

    if name not in ENGINES:
        raise TunerError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
    module, attr = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def engine_for(config: Any) -> str:
    """The engine that serves a config: llama.cpp's server for engine llamacpp; on transformers, drafts go through
    assisted generation, the rest through CB."""
    if config.engine in ("llamacpp", "vllm", "endpoint"):
        return config.engine
    return "transformers-assisted" if config.draft != "none" else "transformers-cb"


def availability() -> list[dict[str, Any]]:
    """Per engine (config.engine values): can it run here, and the reason or where it is."""
    import importlib.util

    from tuner.engines.llamacpp import availability as llamacpp
    from tuner.engines.vllm import availability as vllm

    ok = importlib.util.find_spec("transformers") is not None
    rows = [{"engine": "transformers", "available": ok,
             "detail": "in-process continuous batching / assisted generation" if ok else "pip install transformers"}]
    ok, why = llamacpp()
    rows.append({"engine": "llamacpp", "available": ok, "detail": why})
    ok, why = vllm()
    rows.append({"engine": "vllm", "available": ok, "detail": why})
    rows.append({"engine": "endpoint", "available": True,
                 "detail": "any running OpenAI-compatible server: --endpoint URL (API key from $TUNER_API_KEY)"})
    return rows
