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
    from tuner.engines.registry import backend, names, spoken

    fn = exporter(target)
    measured_on = backend(config.engine)
    if not measured_on.launched:
        raise TunerError(f"--to {target}: this config was measured on a running endpoint ({config.endpoint}) that tuner "
                         "did not launch, so there is no server configuration to export: expected a trial of engine "
                         f"{spoken(names(launched=True))}")
    if measured_on.export_to not in (None, target):  # its quant and knobs are that target's own
        raise TunerError(f"--to {target}: this config was measured on engine {config.engine} (quant {config.quant} "
                         f"is that engine's own type); expected --to {measured_on.export_to}")
    return fn(config, ctx or Context())
