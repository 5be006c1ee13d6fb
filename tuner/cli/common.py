"""Argument helpers shared by commands: config knobs and workload flags, validated before anything heavy loads."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tuner.config import FORMATS, TrialConfig
from tuner.errors import TunerError
from tuner.workload import WorkloadSpec, parse_range


def add_config_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    g = p.add_argument_group("configuration (the four knobs)")
    g.add_argument("--model", required=model_required, help="alias (see `tuner models`), checkpoint dir or .gguf")
    g.add_argument("--quant", default="bf16", metavar="FORMAT", help=f"one of: {', '.join(FORMATS)} (default bf16)")
    g.add_argument("--batch-cap", type=int, default=1, help="max concurrently running sequences (default 1)")
    g.add_argument("--kv-fraction", type=float, default=0.05,
                   help="fraction of free memory the KV cache may take, in (0, 1] (default 0.05)")
    g.add_argument("--draft", default="none", help="none | ngram:K | draft:<model>:K | early-exit:L")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--config", metavar="FILE", help="take the configuration from a JSON file (bench or export JSON)")


def add_workload_args(p: argparse.ArgumentParser, requests: int = 32) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=requests, help=f"number of requests (default {requests})")
    g.add_argument("--rate", type=float, default=4.0, help="open-loop arrival rate, req/s (default 4)")
    g.add_argument("--arrival", default="poisson", help="poisson | constant (default poisson)")
    g.add_argument("--concurrency", type=int, help="closed loop: keep C requests in flight (overrides --rate)")
    g.add_argument("--input-len", default="64:256", help="prompt tokens A:B, uniform (default 64:256)")
    g.add_argument("--output-len", default="32:64", help="output tokens A:B, uniform (default 32:64)")
    g.add_argument("--shared-prefix", type=int, default=0, help="tokens of system prompt shared by all requests")
    g.add_argument("--trace", metavar="FILE", help="replay a JSONL trace (prompt, max_tokens, arrival_s)")
    g.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> TrialConfig:
    """Build and validate the TrialConfig (cheap checks, including that the model source exists)."""
    from tuner.models import resolve_source

    if args.config:
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as e:
            raise TunerError(f"--config {args.config!r} is unreadable ({e.strerror}): expected a JSON file") from None
        config = TrialConfig.from_json(text)
        if args.model:
            config = config.replace(model=args.model)
    else:
        if not args.model:
            raise TunerError("--model is required (an alias, a checkpoint directory or a .gguf file) unless --config")
        config = TrialConfig(model=args.model, quant=args.quant, batch_cap=args.batch_cap,
                             kv_fraction=args.kv_fraction, draft=args.draft, device=args.device)
    resolve_source(config.model)
    if config.draft_spec.kind == "draft":
        resolve_source(config.draft_spec.model)
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TunerError("--device cuda: no CUDA device is visible; expected auto or cpu on this machine")
    return config


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    if args.trace:
        from tuner.workload import read_trace

        read_trace(args.trace)  # validate before loading the model
    return WorkloadSpec(
        requests=args.requests, rate=None if args.concurrency else args.rate, arrival=args.arrival,
        concurrency=args.concurrency, input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"), shared_prefix=args.shared_prefix,
        seed=args.seed, trace=args.trace,
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
    return p


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temp file + rename, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
