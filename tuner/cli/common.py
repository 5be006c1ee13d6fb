"""Argument helpers shared by commands: config knobs and workload flags, validated before anything heavy loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from tuner.config import ENGINE_KNOBS, ENGINE_NAMES, FORMATS, GGUF_TYPES, KV_TYPES, TrialConfig
from tuner.engines.registry import ENGINES
from tuner.errors import TunerError
from tuner.files import write_json_atomic as write_json_atomic  # re-exported for the commands
from tuner.measure.workload import WorkloadSpec, parse_range


def add_config_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    c = TrialConfig  # every knob's default: its one home
    g = p.add_argument_group("configuration (the four knobs)")
    g.add_argument("--model", required=model_required, help="alias (see `tuner models`), checkpoint dir or .gguf")
    g.add_argument("--engine", help=f"serving engine: {' | '.join(ENGINE_NAMES)} (default {c.engine})")
    g.add_argument("--quant", metavar="FORMAT", help=f"transformers: {', '.join(FORMATS)} (default "
                                                     f"{ENGINES['transformers'].default_quant}); llamacpp: "
                                                     f"{', '.join(GGUF_TYPES)} (default {ENGINES['llamacpp'].default_quant})")
    g.add_argument("--kv-type", help=f"KV-cache type, llamacpp: {', '.join(KV_TYPES['llamacpp'])} (default {c.kv_type})")
    g.add_argument("--batch-cap", type=int, help=f"max concurrently running sequences (default {c.batch_cap})")
    g.add_argument("--kv-fraction", type=float,
                   help=f"fraction of free memory the KV cache may take, in (0, 1] (default {c.kv_fraction:g})")
    g.add_argument("--draft", help=f"none | ngram:K | draft:<model>:K | early-exit:L (default {c.draft})")
    for name, (engine, default, accepted, what) in ENGINE_KNOBS.items():
        g.add_argument("--" + name.replace("_", "-"), type=str if isinstance(default, str) else int,
                       help=f"{engine}: {what}; {accepted}")
    g.add_argument("--device", help=f"auto | cpu | cuda (default {c.device})")
    g.add_argument("--endpoint", metavar="URL", help="measure a running OpenAI-compatible server at URL instead of "
                                                     "launching one (engine endpoint; the API key comes from "
                                                     "$TUNER_API_KEY; --model names its tokenizer)")
    g.add_argument("--served-model", metavar="NAME", help="endpoint: the model name to request (default: the first "
                                                          "of its /v1/models)")
    g.add_argument("--config", metavar="FILE", help="take the configuration from a JSON file (bench or export JSON)")


WORKLOAD_DEFAULTS: dict[str, Any] = {  # the workload flags' defaults: WorkloadSpec's, their one home
    f.name: f.default for f in dataclasses.fields(WorkloadSpec)
    if f.name in ("requests", "rate", "arrival", "concurrency", "input_len", "output_len", "shared_prefix", "trace",
                  "seed")}


def add_workload_args(p: argparse.ArgumentParser) -> None:
    d = WORKLOAD_DEFAULTS
    g = p.add_argument_group("workload (with --config FILE, a workload recorded in FILE is the default)")
    g.add_argument("--requests", type=int, help=f"number of requests (default {d['requests']})")
    g.add_argument("--rate", type=float, help=f"open-loop arrival rate, req/s (default {d['rate']:g})")
    g.add_argument("--arrival", help=f"poisson | constant (default {d['arrival']})")
    g.add_argument("--concurrency", type=int, help="closed loop: keep C requests in flight (overrides --rate)")
    g.add_argument("--input-len", help="prompt tokens A:B, uniform (default {}:{})".format(*d["input_len"]))
    g.add_argument("--output-len", help="output tokens A:B, uniform (default {}:{})".format(*d["output_len"]))
    g.add_argument("--shared-prefix", type=int,
                   help=f"tokens of system prompt shared by all requests (default {d['shared_prefix']})")
    g.add_argument("--trace", metavar="FILE", help="replay a JSONL trace (prompt, max_tokens, arrival_s)")
    g.add_argument("--seed", type=int, help=f"workload seed (default {d['seed']})")


def recorded_workload(path: str | None) -> dict[str, Any]:
    """The workload a bench JSON (`workload`) or an export JSON (`measured.workload`) was measured under."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}  # config_from_args reports the problem
    if not isinstance(data, dict):
        return {}
    w = data.get("workload") or (data.get("measured") or {}).get("workload") or {}
    return {k: v for k, v in w.items() if k in WORKLOAD_DEFAULTS} if isinstance(w, dict) else {}


CONFIG_FLAGS = ("model", "engine", "quant", "batch_cap", "kv_fraction", "kv_type", "draft", "device", *ENGINE_KNOBS,
                "endpoint", "served_model")


def config_from_args(args: argparse.Namespace) -> TrialConfig:
    """Build and validate the TrialConfig (cheap checks, including that the model source exists)."""
    from tuner.measure.run import check_sources

    if args.config:
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as e:
            raise TunerError(f"--config {args.config!r} is unreadable ({e.strerror}): expected a JSON file") from None
        try:
            config = TrialConfig.from_json(text)
        except TunerError as e:
            raise TunerError(f"--config {args.config!r}: {e}: expected a TrialConfig, bench or export JSON") from None
        given = {k: getattr(args, k) for k in CONFIG_FLAGS if getattr(args, k, None) is not None}
        if given:
            config = config.replace(**given)  # explicit flags override the file, validated
    else:
        if not args.model:
            raise TunerError("--model is required (an alias, a checkpoint directory or a .gguf file) unless --config")
        knobs = {k: getattr(args, k) for k in CONFIG_FLAGS[1:] if getattr(args, k, None) is not None}
        if knobs.get("endpoint") and "engine" not in knobs:
            knobs["engine"] = "endpoint"
        if knobs.get("engine") in ENGINES and "quant" not in knobs:
            # the engine's own default format (llama.cpp: its type names, the unquantized F16 GGUF; an endpoint:
            # what it serves); an unknown engine is refused by TrialConfig with the accepted names
            knobs["quant"] = ENGINES[knobs["engine"]].default_quant
        config = TrialConfig(model=args.model, **knobs)
    check_sources(config)
    return config


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """Explicit flags, else the workload recorded in --config, else the defaults."""
    w = dict(WORKLOAD_DEFAULTS)
    w.update(recorded_workload(getattr(args, "config", None)))
    for key in WORKLOAD_DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            w[key] = value
    if args.concurrency is not None or (w["concurrency"] and args.rate is None):
        w["rate"] = None
    elif args.rate is not None:
        w["concurrency"] = None
    if w["trace"]:
        from tuner.measure.workload import read_trace

        read_trace(w["trace"])  # validate before loading the model

    def span(v: Any, name: str) -> tuple[int, int]:
        return tuple(v) if isinstance(v, (list, tuple)) else parse_range(str(v), name)  # type: ignore[return-value]

    return WorkloadSpec(
        requests=w["requests"], rate=w["rate"], arrival=w["arrival"], concurrency=w["concurrency"],
        input_len=span(w["input_len"], "--input-len"), output_len=span(w["output_len"], "--output-len"),
        shared_prefix=w["shared_prefix"], seed=w["seed"], trace=w["trace"],
    )


def check_output_path(path: str | None, flag: str = "--json") -> Path | None:
    """Fail early (before measuring) if the output cannot be written."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        raise TunerError(f"{flag} {path!r} is a directory: expected a file path")
    if not p.parent.exists():
        raise TunerError(f"{flag} {path!r}: directory {str(p.parent)!r} does not exist")
    if not p.parent.is_dir():
        raise TunerError(f"{flag} {path!r}: {str(p.parent)!r} is not a directory: expected a file path in a folder")
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise TunerError(f"{flag} {path!r} is not writable here: expected a file path tuner may write")
    return p


