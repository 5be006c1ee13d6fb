"""`tuner export`: turn a trial of a search (or a TrialConfig JSON) into a serving configuration for vLLM, SGLang,
TGI, llama.cpp or transformers. Prints to stdout unless -o is given; every knob that is not carried over exactly
is also reported on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

TARGET_NAMES = ("vllm", "sglang", "tgi", "llamacpp", "transformers")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from tuner.export.common import DEFAULT_GPU_GIB
    from tuner.search.storage import DEFAULT_STORAGE

    p = subparsers.add_parser(
        "export", help="export a trial's config to vLLM, SGLang, TGI, llama.cpp or transformers",
        description="Export a trial's configuration (--trial N, or --best for the search's recommendation) as a "
                    "serving configuration. Knobs that do not carry over exactly are named on stderr and in the "
                    "output's comments.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--study", help="Optuna study name (as given to `tuner search`)")
    src.add_argument("--config", metavar="FILE", help="a TrialConfig, bench or export JSON instead of a study")
    p.add_argument("--storage", default=DEFAULT_STORAGE, help=f"Optuna storage URL (default: {DEFAULT_STORAGE})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--trial", type=int, metavar="N", help="trial number")
    which.add_argument("--best", action="store_true", help="the search's recommended trial")
    p.add_argument("--to", required=True, choices=TARGET_NAMES, help="target engine")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="write instead of printing: the extension picks the file (.yaml, .sh, .py, .env; .json = "
                        "export JSON that `tuner bench --config` reads); a directory ending in '/' gets them all")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or the export JSON")
    p.add_argument("--model-path", metavar="PATH",
                   help="model reference to emit instead of the default (a checkpoint dir, repo id or .gguf)")
    p.add_argument("--gpu-memory-gib", type=float, default=DEFAULT_GPU_GIB, metavar="GIB",
                   help=f"target GPU memory for the KV-fraction formula (default: {DEFAULT_GPU_GIB:g})")
    p.add_argument("--k8s", action="store_true",
                   help="with --to vllm|llamacpp: Kubernetes manifests instead (k8s.yaml: Deployment + Service; "
                        "vLLM also production-stack-values.yaml for the vllm-stack Helm chart)")
    return p


def run(args: argparse.Namespace) -> int:
    from tuner.config import TrialConfig
    from tuner.errors import TunerError
    from tuner.export import Context, export
    from tuner.export.locate import checkpoint_params, locate, measured_settings
    from tuner.export.write import check_path, plan, render, write_files

    if args.k8s and args.to not in ("vllm", "llamacpp"):
        raise TunerError(f"--k8s with --to {args.to}: expected --to vllm or --to llamacpp")
    if args.gpu_memory_gib <= 0:
        raise TunerError(f"--gpu-memory-gib {args.gpu_memory_gib:g} is invalid: expected a positive number of GiB")
    if args.study is not None:
        if args.trial is None and not args.best:
            raise TunerError("give --trial N or --best with --study")
        from tuner.export.trials import load_trial

        rec = load_trial(args.study, args.storage, args.trial, args.best)
        config, ctx_kw = rec.config, {"study": rec.study, "trial": rec.number, "engine": rec.engine,
                                      "metrics": rec.metrics, "workload": rec.workload}
    else:
        if args.trial is not None or args.best:
            raise TunerError("--trial/--best select a trial of --study; they do not apply to --config")
        config, ctx_kw = _from_file(args.config, TrialConfig)
    paths = locate(config, args.model_path)
    ctx_kw.update(measured_settings(config, ctx_kw.get("engine"), paths, args.model_path))
    ctx = Context(paths=paths, gpu_memory_gib=args.gpu_memory_gib, params=checkpoint_params(config.model),
                  **ctx_kw)
    exp = export(args.to, config, ctx)
    if args.k8s:
        import dataclasses

        from tuner.export.k8s import manifests

        exp = dataclasses.replace(exp, files=manifests(exp))

    files: dict[str, str] = {}
    if args.output:
        files = plan(exp, args.output, args.format, is_dir=Path(args.output).is_dir())
        for path in files:  # refuse before anything is printed or written
            check_path(path, args.force)
    for note in exp.warnings:
        print(f"tuner export: warning: {note.knob}: {note.kind}: {note.text}", file=sys.stderr)
    if not files:
        sys.stdout.write(render(exp, args.format))
        return 0
    for path in write_files(files, args.force):
        print(f"tuner export: wrote {path}", file=sys.stderr)
    return 0


def _from_file(path: str, cls: Any) -> tuple[Any, dict[str, Any]]:
    import json

    from tuner.errors import TunerError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TunerError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    try:
        config = cls.from_json(text)
    except TunerError as e:
        raise TunerError(f"--config {path!r}: {e}: expected a TrialConfig, bench or export JSON") from None
    data = json.loads(text)
    measured = data.get("measured") if isinstance(data, dict) else None
    engine = metrics = None
    if isinstance(measured, dict):
        engine, metrics = measured.get("engine"), measured.get("metrics")
    elif isinstance(data, dict) and isinstance(data.get("metrics"), dict):  # a bench JSON
        engine, metrics = data.get("engine"), data.get("metrics")
    return config, {"engine": engine if isinstance(engine, dict) else None,
                    "metrics": metrics if isinstance(metrics, dict) else None}
