"""Export a trial's configuration to a serving engine: pure functions `config (+ trial context) -> Export`.

Targets are registered lazily, name -> "module:attr", so importing this package imports no target.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.export.common import Context, Export, Note

TARGETS: dict[str, str] = {
    "vllm": "tuner.export.vllm:export",
    "sglang": "tuner.export.sglang:export",
    "tgi": "tuner.export.tgi:export",
    "llamacpp": "tuner.export.llamacpp:export",
    "transformers": "tuner.export.transformers:export",
}

__all__ = ["TARGETS", "Context", "Export", "Note", "exporter", "export"]


def exporter(target: str) -> Callable[[TrialConfig, Context | None], Export]:
    """The export function of `target`; one-line error naming the accepted targets."""
    if target not in TARGETS:
        raise TunerError(f"unknown export target {target!r}: expected one of {', '.join(TARGETS)}")
    module, attr = TARGETS[target].split(":")
    return getattr(importlib.import_module(module), attr)


def export(target: str, config: TrialConfig, ctx: Context | None = None) -> Export:
    fn = exporter(target)
    if config.engine == "endpoint":
        raise TunerError(f"--to {target}: this config was measured on a running endpoint ({config.endpoint}) that tuner "
                         "did not launch, so there is no server configuration to export: expected a trial of engine "
                         "transformers, llamacpp or vllm")
    if config.engine != "transformers" and target != config.engine:
        raise TunerError(f"--to {target}: this config was measured on engine {config.engine} (quant {config.quant} "
                         f"is that engine's own type); expected --to {config.engine}")
    return fn(config, ctx or Context())
