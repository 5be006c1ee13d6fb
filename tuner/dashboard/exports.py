"""The serving configs of a trial for every `tuner.export` target, and its TrialConfig as JSON."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tuner.dashboard.study import TrialView
from tuner.errors import TunerError


def exports(v: TrialView, study: str | None, targets: Sequence[str] | None = None,
            paths: Callable[[Any], Mapping[str, str]] | None = None) -> list[dict[str, Any]]:
    """The serving configs of a COMPLETE trial for every `tuner.export` target: {target, engine, command, files
    {name: text}, notes, warnings, json} or {target, error}. `paths(config)` gives the model references
    (`tuner.export.locate.locate`, as `tuner export` does); without it the pure defaults are used."""
    from tuner.config import TrialConfig
    from tuner.export import TARGETS, Context, export

    if v.state != "COMPLETE":
        raise TunerError(f"trial {v.number} is {v.state}: only COMPLETE trials can be exported")
    if not v.row.config:
        raise TunerError(f"trial {v.number} has no 'config' attribute: it cannot be exported")
    from tuner.export.locate import measured_settings

    config = TrialConfig.from_dict(dict(v.row.config))
    located = dict(paths(config)) if paths else {}
    ctx = Context(study=study, trial=v.number, engine=v.engine, metrics=v.row.metrics or None, paths=located,
                  **measured_settings(config, v.engine, located))
    out = []
    for target in targets or list(TARGETS):
        try:
            exp = export(target, config, ctx)
        except TunerError as e:
            out.append({"target": target, "error": str(e)})
            continue
        out.append({"target": target, "engine": exp.engine, "command": exp.command(), "files": dict(exp.files),
                    "notes": [str(n) for n in exp.notes], "warnings": [str(n) for n in exp.warnings],
                    "json": exp.to_json()})
    return out


def config_json(v: TrialView) -> str:
    """The trial's TrialConfig as JSON (what `tuner bench --config` reads)."""
    from tuner.config import TrialConfig

    return TrialConfig.from_dict(dict(v.row.config)).to_json()
