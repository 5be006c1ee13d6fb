"""A piece of heavy work handed to `tuner.child` as a file: a bench job (one configuration measured: its capacity
under an SLO, or one fixed load) or an eval job (one configuration's quality, gated on a budget).

A job is a frozen dataclass. The parent writes it as JSON (atomically: tuner.files) and the child reads it back with
every field checked against its type: an unknown field, a missing one, a value of the wrong type or a file that is
not there is one line naming it (TunerError, exit 2). No setting goes through command-line text on the way, and
every default is taken from its one home (tuner.measure.capacity, tuner.measure.bench, tuner.quality.gate), never restated here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.files import write_json_atomic
from tuner.measure.bench import BenchOptions
from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import WorkloadSpec
from tuner.quality.gate import DEFAULT_CONFIDENCE


@dataclass(frozen=True)
class BenchJob:
    """`tuner bench` of one configuration, its result JSON written to `out_path`."""

    kind: ClassVar[str] = "bench"
    config: TrialConfig
    workload: WorkloadSpec
    out_path: str
    capacity: CapacityOptions | None = None  # None: one fixed load (the workload's rate or concurrency)
    server_log: str | None = None  # a server engine's output (appended)
    timeout_s: float = BenchOptions.timeout_s
    ignore_eos: bool = BenchOptions.ignore_eos
    measure_bandwidth: bool = BenchOptions.measure_bandwidth


@dataclass(frozen=True)
class EvalJob:
    """`tuner eval` of one configuration (gated when `max_quality_drop` is set), its result JSON written to
    `out_path`; the quality cache lives under `results_dir` (None: $TUNER_RESULTS or ./results)."""

    kind: ClassVar[str] = "eval"
    config: TrialConfig
    tasks: tuple[str, ...]
    limit: int
    seed: int
    out_path: str
    max_quality_drop: float | None = None
    max_limit: int | None = None
    confidence: float = DEFAULT_CONFIDENCE
    max_kld: float | None = None
    kld_tokens: int | None = None  # None: tuner.quality.kld's default
    results_dir: str | None = None


Job = BenchJob | EvalJob
KINDS: dict[str, type] = {"bench": BenchJob, "eval": EvalJob}


def encode(value: Any) -> Any:
    """A job (or any of its parts) as plain JSON values: a dataclass as an object of all its fields, a tuple as a
    list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def job_to_dict(job: Job) -> dict[str, Any]:
    return {"kind": job.kind, **encode(job)}


def write_job(path: Path, job: Job) -> None:
    write_json_atomic(Path(path), job_to_dict(job))


def read_job(path: str | Path) -> Job:
    """The job in `path`, every field checked; TunerError (one line naming the file and the value) otherwise."""
    where = f"job {str(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TunerError(f"{where} is unreadable ({e.strerror}): expected a job file written by tuner") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise TunerError(f"{where} is not valid JSON ({e}): expected a job file written by tuner") from None
    return job_from_dict(data, where)


def job_from_dict(data: Any, where: str = "job") -> Job:
    if not isinstance(data, dict):
        raise TunerError(f"{where} is a JSON {type(data).__name__}: expected an object with a kind "
                         f"({' or '.join(KINDS)})")
    kind = data.get("kind")
    if kind not in KINDS:
        raise TunerError(f"{where}: kind {kind!r} is invalid: expected {' or '.join(KINDS)}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    return decode(KINDS[kind], fields, where, "")


# ------------------------------------------------------------------------------------------- decoding --- #
def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return f"an object ({hint.__name__})"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        return "a list"
    if origin is dict:
        return "an object"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def decode(hint: Any, value: Any, where: str, field: str) -> Any:
    """`value` (from JSON) as the type `hint`, checked; `field` is its dotted name in the job."""
    def bad() -> TunerError:
        return TunerError(f"{where}: {field or 'job'} {_short(value)} is invalid: expected {_name(hint)}")

    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return decode_dataclass(hint, value, where, field)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own error, which names the field inside it
            return decode(options[0], value, where, field)
        for a in options:
            try:
                return decode(a, value, where, field)
            except TunerError:
                pass
        raise bad()
    if origin is tuple:
        if not isinstance(value, list):
            raise bad()
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, where, f"{field}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise TunerError(f"{where}: {field} {value!r} is invalid: expected a list of {len(args)}")
        return tuple(decode(a, v, where, f"{field}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        return {decode(args[0], k, where, field): decode(args[1], v, where, f"{field}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad()
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"job field {field}: type {hint!r} has no JSON form")  # a job class the codec does not cover


def decode_dataclass(cls: type, value: Any, where: str, field: str) -> Any:
    if not isinstance(value, dict):
        raise TunerError(f"{where}: {field or 'job'} {_short(value)} is invalid: expected {_name(cls)}")
    known = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in known}
    dot = f"{field}." if field else ""
    unknown = sorted(set(value) - names)
    if unknown:
        raise TunerError(f"{where}: unknown field {dot}{unknown[0]}: expected one of {', '.join(sorted(names))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in known:
        if f.name in value:
            kwargs[f.name] = decode(hints[f.name], value[f.name], where, dot + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TunerError(f"{where}: field {dot}{f.name} is missing: expected {_name(hints[f.name])}")
    try:
        return cls(**kwargs)
    except TunerError as e:
        raise TunerError(f"{where}: {field or 'job'}: {e}") from None
    except (TypeError, ValueError) as e:
        raise TunerError(f"{where}: {field or 'job'} is invalid: {e}") from None
