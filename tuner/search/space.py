"""Search spaces as data (`search_spaces/*.yaml`): each knob's choices or range, conditions between knobs,
the engine-default baseline, the workload and the quality suite. `suggest_config` turns an Optuna trial into a
TrialConfig (define-by-run, so a conditional knob is only sampled where its condition holds).

File format (every key optional except `knobs`):

    knobs:
      quant:       {choices: [bf16, bnb-nf4, gptq-int4]}
      batch_cap:   {choices: [1, 2, 4, 8]}            # or {low: 1, high: 32, log: true}
      draft:       {choices: [none, "ngram:3"], when: {batch_cap: [1]}}   # else 'none'
      kv_fraction: {low: 0.005, high: 0.05, log: true, when: {draft: [none]}}  # else the baseline's (unused)
      kv_type:     {choices: [auto, q8_0]}            # llamacpp only (-ctk/-ctv)
      batch_cap:   {choices: [1, 4, 16], increasing: true}   # capacity tends to grow with it: see startup_sweep
      threads, ubatch: llamacpp; batched_tokens, prefix_cache, chunked_prefill, reserved_cpus: vllm (config.ENGINE_KNOBS)
    engine: llamacpp                     # transformers (default) | llamacpp | vllm: who serves every trial
    baseline: {quant: fp32, batch_cap: 1, kv_fraction: 0.01, draft: none}
    workload: {requests: 120, input_len: "64:192", output_len: "32:48"}   # prompts; the capacity search picks rates
    quality:  {tasks: [arc_easy, piqa], limit: 50, max_limit: 200}
    capacity: {probe_requests: "30:120", max_probes: 5, timeout: 10m}   # per trial; flags override
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.config import (
    ENGINE_KNOBS,
    KV_TYPES,
    TrialConfig,
    engine_knob_error,
    parse_draft,
)
from tuner.engines.registry import ENGINES, backend
from tuner.errors import TunerError

KNOBS = ("quant", "batch_cap", "draft", "kv_fraction", "kv_type", *ENGINE_KNOBS)  # sampling order: a `when:` may
# name an earlier knob
DEFAULTS: dict[str, Any] = {"quant": "bf16", "batch_cap": 1, "kv_fraction": 0.05, "draft": "none", "kv_type": "auto",
                            **{k: spec[1] for k, spec in ENGINE_KNOBS.items()}}
# what each engine serves when the user changes nothing: the baseline every space measures first
ENGINE_BASELINE: dict[str, dict[str, Any]] = {name: {"quant": b.baseline_quant} for name, b in ENGINES.items()}
TOP_KEYS = {"knobs", "baseline", "workload", "quality", "capacity", "description", "engine"}
CAPACITY_KEYS = {"probe_requests", "max_probes", "timeout", "saturation_requests"}
SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    when: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    increasing: bool = False  # capacity tends to grow with this knob (a batch cap): the start-up takes its top
    top: Any = None  # the highest value the file lists (a baseline value added to the choices does not count)

    def describe(self) -> str:
        if self.choices is not None:
            return ", ".join(map(str, self.choices))
        return f"[{self.low:g}, {self.high:g}]" + (" log" if self.log else "")


@dataclass(frozen=True)
class Space:
    path: str
    knobs: dict[str, Knob]
    baseline: dict[str, Any]
    workload: dict[str, Any]
    quality: dict[str, Any]
    digest: str = ""  # sha256 of the file's text: a resumed study must use the same space
    capacity: dict[str, Any] = field(default_factory=dict)  # the capacity search's budget per trial
    engine: str = "transformers"  # the engine every trial is served by (several: the baseline's, engines[0])
    engines: tuple[Space, ...] = ()  # a study across engines: one space per engine, `engine` sampled first
    endpoint: str = ""  # engine endpoint: the running server's URL (from --endpoint, never from the file)
    served_model: str = ""  # engine endpoint: the model name it is asked for (--served-model)


def default_space_path(device: str, engine: str = "transformers") -> Path:
    return SPACES_DIR / backend(engine).space_file(device)


def _err(path: str, key: str, msg: str) -> TunerError:
    return TunerError(f"space file {path!r}: {key}: {msg}")


def _check_value(path: str, key: str, knob: str, value: Any, engine: str = "transformers") -> Any:
    """Validate one knob value, raising with the key path."""
    if knob == "quant":
        allowed = backend(engine).quants()
        if value not in allowed:
            raise _err(path, key, f"unknown quantization format {value!r} for engine {engine}: expected one of "
                                  f"{', '.join(allowed)}")
    elif knob == "kv_type":
        if value not in KV_TYPES[engine]:
            raise _err(path, key, f"KV type {value!r} is not accepted by engine {engine}: expected one of "
                                  f"{', '.join(KV_TYPES[engine])}")
    elif knob == "batch_cap":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _err(path, key, f"batch cap {value!r} is invalid: expected an integer >= 1")
    elif knob in ENGINE_KNOBS:
        if isinstance(DEFAULTS[knob], str) and isinstance(value, bool):
            value = "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as a boolean
        problem = engine_knob_error(knob, value, engine)
        if problem:
            raise _err(path, key, problem)
    elif knob == "kv_fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise _err(path, key, f"KV fraction {value!r} is invalid: expected a number in (0, 1]")
    elif knob == "draft":
        try:
            value = str(parse_draft(str(value)))
        except TunerError as e:
            raise _err(path, key, str(e)) from None
    return value


def _parse_knob(path: str, name: str, raw: Any, earlier: list[str], engine: str) -> Knob:
    where = f"knobs.{name}"
    if name not in KNOBS:
        raise _err(path, where, f"unknown knob: expected one of {', '.join(KNOBS)}")
    if not isinstance(raw, dict):
        raise _err(path, where, "expected a mapping with choices, or low/high")
    unknown = set(raw) - {"choices", "low", "high", "log", "when", "increasing"}
    if unknown:
        raise _err(path, f"{where}.{sorted(unknown)[0]}",
                   "unknown key: expected choices, low, high, log, when, increasing")
    increasing = raw.get("increasing", False)
    if not isinstance(increasing, bool):
        raise _err(path, f"{where}.increasing", f"{increasing!r} is invalid: expected true or false")
    if increasing and (name in ("quant", "draft", "kv_type") or isinstance(DEFAULTS[name], str)):
        raise _err(path, f"{where}.increasing", "only a numeric knob can be increasing: expected it on batch_cap, "
                                                "kv_fraction or an integer engine knob")
    when: dict[str, tuple[Any, ...]] = {}
    for other, values in (raw.get("when") or {}).items():
        if other not in earlier:
            raise _err(path, f"{where}.when.{other}", f"condition on {other!r}: expected a knob listed before "
                                                      f"{name!r} ({', '.join(earlier) or 'none'})")
        if not isinstance(values, list) or not values:
            raise _err(path, f"{where}.when.{other}", "expected a non-empty list of values")
        when[other] = tuple(_check_value(path, f"{where}.when.{other}[{i}]", other, v, engine)
                            for i, v in enumerate(values))
    if "choices" in raw:
        choices = raw["choices"]
        if not isinstance(choices, list) or not choices:
            raise _err(path, f"{where}.choices", "expected a non-empty list")
        vals = tuple(_check_value(path, f"{where}.choices[{i}]", name, v, engine) for i, v in enumerate(choices))
        if len(set(vals)) != len(vals):
            raise _err(path, f"{where}.choices", "duplicate values")
        return Knob(name, choices=vals, when=when, increasing=increasing, top=max(vals) if increasing else None)
    if name in ("quant", "draft", "kv_type") or isinstance(DEFAULTS[name], str):
        raise _err(path, where, "expected choices (a list)")
    if "low" not in raw or "high" not in raw:
        raise _err(path, where, "expected choices, or both low and high")
    low = _check_value(path, f"{where}.low", name, raw["low"], engine)
    high = _check_value(path, f"{where}.high", name, raw["high"], engine)
    if low >= high:
        raise _err(path, where, f"low {low} must be below high {high}")
    return Knob(name, low=float(low), high=float(high), log=bool(raw.get("log", False)), when=when,
                increasing=increasing, top=high if increasing else None)


def load_space(path: str | Path) -> Space:
    """Read and validate a space file; errors name the key path."""
    import hashlib

    import yaml

    p = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except OSError as e:
        raise TunerError(f"space file {p!r} is unreadable ({e.strerror}): expected a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise TunerError(f"space file {p!r} is not valid YAML{where}: expected a mapping of knobs") from None
    if not isinstance(data, dict):
        raise TunerError(f"space file {p!r}: expected a YAML mapping with a 'knobs' key")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise _err(p, sorted(unknown)[0], f"unknown key: expected {', '.join(sorted(TOP_KEYS))}")
    if not isinstance(data.get("knobs"), dict) or not data["knobs"]:
        raise _err(p, "knobs", "expected a mapping of knob name to choices/range")
    engine = data.get("engine", "transformers")
    try:
        backend(engine)
    except TunerError as e:
        raise _err(p, "engine", str(e)) from None
    order = [k for k in KNOBS if k in data["knobs"]] + [k for k in data["knobs"] if k not in KNOBS]
    knobs: dict[str, Knob] = {}
    for name in order:
        knobs[name] = _parse_knob(p, name, data["knobs"][name], list(knobs), engine)
    baseline = dict(DEFAULTS, batch_cap=1, draft="none", **ENGINE_BASELINE[engine])
    for key, value in (data.get("baseline") or {}).items():
        if key not in KNOBS:
            raise _err(p, f"baseline.{key}", f"unknown knob: expected one of {', '.join(KNOBS)}")
        baseline[key] = _check_value(p, f"baseline.{key}", key, value, engine)
    for name, knob in knobs.items():  # the baseline must be a point of the space, so Optuna can enqueue it
        v = baseline[name]
        if knob.choices is not None and v not in knob.choices:
            knobs[name] = dataclasses.replace(knob, choices=(v, *knob.choices))
        elif knob.choices is None and not knob.low <= v <= knob.high:
            raise _err(p, f"baseline.{name}", f"{v} is outside knobs.{name} range [{knob.low:g}, {knob.high:g}]")
    for section in ("workload", "quality", "capacity"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise _err(p, section, "expected a mapping")
    unknown = set(data.get("capacity") or {}) - CAPACITY_KEYS
    if unknown:
        raise _err(p, f"capacity.{sorted(unknown)[0]}", f"unknown key: expected {', '.join(sorted(CAPACITY_KEYS))}")
    return Space(p, knobs, baseline, dict(data.get("workload") or {}), dict(data.get("quality") or {}),
                 hashlib.sha256(text.encode()).hexdigest(), dict(data.get("capacity") or {}), engine)


def restrict_to_device(space: Space, device: str) -> tuple[Space, list[str]]:
    """Drop formats this device cannot run (keeping the baseline). Returns the space and one note per drop."""
    knob = space.knobs.get("quant")
    if knob is None or knob.choices is None:
        return space, []
    engine = backend(space.engine).engine()

    keep, notes = [], []
    for q in knob.choices:
        why = engine.format_reason(q, device)
        if why and q != space.baseline["quant"]:
            notes.append(f"{q} left out: {why}")
        else:
            keep.append(q)
    knobs = dict(space.knobs, quant=dataclasses.replace(knob, choices=tuple(keep)))
    return dataclasses.replace(space, knobs=knobs), notes


def combine_spaces(spaces: list[Space]) -> tuple[Space, list[str]]:
    """One study across engines: the `engine` knob is sampled first, then that engine's own knobs (named
    `<engine>.<knob>` in Optuna, so each engine keeps its own choices). The workload, capacity budget and quality
    suite are the first space's, so every engine is measured the same way; quality tasks some engine cannot score
    are left out (noted). The baseline is the first engine's default. Returns the space and its notes."""
    import hashlib

    if len(spaces) == 1:
        return spaces[0], []
    names = [s.engine for s in spaces]
    if len(set(names)) != len(names):
        raise TunerError(f"engines {', '.join(names)}: each engine may appear once: expected distinct engines")
    first, notes = spaces[0], []
    tasks = list(first.quality.get("tasks") or [])
    for s in spaces[1:]:
        theirs = s.quality.get("tasks")
        if theirs is not None:
            for t in [t for t in tasks if t not in theirs]:
                notes.append(f"quality task {t} left out: the {s.engine} space ({s.path}) does not score it")
                tasks.remove(t)
    if not tasks and first.quality.get("tasks"):
        raise TunerError(f"engines {', '.join(names)}: no quality task is scored by every engine's space: expected "
                         "--quality-tasks naming tasks each engine scores")
    quality = dict(first.quality, **({"tasks": tasks} if tasks else {}))
    baseline = {"engine": first.engine, **{f"{first.engine}.{k}": first.baseline[k] for k in first.knobs}}
    digest = hashlib.sha256("".join(s.digest for s in spaces).encode()).hexdigest()
    knobs = {"engine": Knob("engine", choices=tuple(names))}
    return Space(",".join(s.path for s in spaces), knobs, baseline, first.workload, quality, digest, first.capacity,
                 first.engine, tuple(spaces)), notes


def _suggest(trial: Any, knob: Knob, prefix: str = "") -> Any:
    name = prefix + knob.name
    if knob.choices is not None:
        return trial.suggest_categorical(name, list(knob.choices))
    if isinstance(DEFAULTS[knob.name], int):  # batch cap and the integer engine knobs
        return trial.suggest_int(name, int(knob.low), int(knob.high), log=knob.log)
    return trial.suggest_float(name, knob.low, knob.high, log=knob.log)


def startup_sweep(space: Space, seed: int, limit: int) -> list[dict[str, Any]]:
    """The search's first configurations after the engine defaults: every format (`quant` choice) at the top of
    each `increasing` knob (the largest batch cap), in a seeded random order, at most `limit` of them; the other
    knobs are left to the sampler. On a continuous-batching engine capacity grows with the batch cap until memory or
    a per-token bound stops it, so the format that serves most is found where formats differ most, and TPE then
    refines around it; a space without an increasing knob (or a format knob) gets no sweep. Across engines the
    engines take turns. Returns Optuna parameter dicts for `enqueue_trial`."""
    import random

    def one(sub: Space, prefix: str) -> list[dict[str, Any]]:
        quant = sub.knobs.get("quant")
        tops = {prefix + k.name: k.top for k in sub.knobs.values() if k.increasing and not k.when}
        if quant is None or quant.choices is None or not tops:
            return []
        base = {prefix + k: v for k, v in sub.baseline.items()}
        out = [{**({"engine": sub.engine} if prefix else {}), prefix + "quant": q, **tops} for q in quant.choices]
        out = [p for p in out if any(base.get(k) != v for k, v in p.items() if k != "engine")]
        random.Random(seed).shuffle(out)
        return out

    per_engine = [one(s, f"{s.engine}.") for s in space.engines] if space.engines else [one(space, "")]
    turns = [p for group in itertools.zip_longest(*per_engine) for p in group if p is not None]
    return turns[:max(0, limit)]


def switched_off_value(space: Space, name: str) -> Any:
    """What a knob takes where its `when:` does not hold: no draft; otherwise the baseline's (unused) value."""
    return DEFAULTS[name] if name == "draft" else space.baseline[name]


def suggest_config(trial: Any, space: Space, model: str, device: str) -> TrialConfig:
    """Sample one configuration (works with optuna.Trial and optuna.trial.FixedTrial)."""
    prefix = ""
    if space.engines:
        engine = trial.suggest_categorical("engine", [s.engine for s in space.engines])
        space, prefix = {s.engine: s for s in space.engines}[engine], f"{engine}."
    values: dict[str, Any] = {}
    for name, knob in space.knobs.items():
        if all(values.get(k) in allowed for k, allowed in knob.when.items()):
            values[name] = _suggest(trial, knob, prefix)
        else:
            values[name] = switched_off_value(space, name)
    merged = {k: values.get(k, space.baseline[k]) for k in KNOBS}
    return TrialConfig(model=model, device=device, engine=space.engine, endpoint=space.endpoint,
                       served_model=space.served_model, **merged)


# ---------------------------------------------------------------- configurations already measured --- #
class _Open(Exception):
    """A continuous knob is still to be sampled: its completions cannot all have been measured."""


def _completions(space: Space, known: dict[str, Any], prefix: str = "") -> list[tuple[tuple[str, Any], ...]]:
    """Every configuration (as the applicable knobs' values, in Optuna's parameter names) that agrees with the
    parameters in `known`; knobs a `when:` switches off do not count. Raises _Open where a continuous knob is open."""
    if space.engines and not prefix:
        engines = [known["engine"]] if "engine" in known else [s.engine for s in space.engines]
        out = []
        for e in engines:
            sub = {s.engine: s for s in space.engines}.get(e)
            if sub is not None:
                out += [(("engine", e), *c) for c in _completions(sub, known, f"{e}.")]
        return out
    partial: list[list[tuple[str, Any, bool]]] = [[]]  # (knob, value, applies): values as suggest_config sets them
    for name, knob in space.knobs.items():
        grown = []
        for c in partial:
            values = {k: v for k, v, _ in c}
            if not all(values.get(k) in allowed for k, allowed in knob.when.items()):
                # switched off here: the value suggest_config gives it, not part of the configuration's key
                grown.append([*c, (name, switched_off_value(space, name), False)])
                continue
            name_p = prefix + name
            if name_p in known:
                choices: tuple[Any, ...] = (known[name_p],)
            elif knob.choices is not None:
                choices = knob.choices
            else:
                raise _Open(name_p)
            grown += [[*c, (name, v, True)] for v in choices]
        partial = grown
    return [tuple((prefix + k, v) for k, v, applies in c if applies) for c in partial]


def config_key(space: Space, params: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """The configuration a trial's parameters select (None when a parameter it needs is missing)."""
    try:
        found = _completions(space, params)
    except _Open:
        return None
    return found[0] if len(found) == 1 else None


def all_measured(space: Space, known: dict[str, Any], seen: set[tuple[tuple[str, Any], ...]]) -> bool:
    """True when every configuration agreeing with `known` is in `seen`: sampling it would measure a
    configuration twice. False while a continuous knob is open (its values are never exhausted)."""
    try:
        return all(c in seen for c in _completions(space, known))
    except _Open:
        return False
