"""Where an export goes: what `-o PATH` means for a target (`plan`, pure) and writing it (`write_files`).

Writing refuses to overwrite without `force`, refuses relative paths that leave the working tree (an absolute
path is taken as explicit), and is atomic per file: each file is written to a temporary sibling, flushed, then
renamed into place; every path is checked before anything is created, so bad input writes nothing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tuner.errors import TunerError
from tuner.export.common import Export

JSON_NAME = "export.json"


def render(exp: Export, fmt: str = "text") -> str:
    """What `tuner export` prints: the export JSON, or every file (a `# ==> name <==` line before each)."""
    if fmt == "json":
        return exp.to_json()
    if len(exp.files) == 1:
        return next(iter(exp.files.values()))
    return "\n".join(f"# ==> {name} <==\n{text}" for name, text in exp.files.items())


def plan(exp: Export, out: str, fmt: str = "text", is_dir: bool = False) -> dict[str, str]:
    """Map `-o out` to {path: content}. A directory (`is_dir`, or a path ending in '/') receives every file plus
    export.json; otherwise the extension picks the file: .json is the export JSON (read by `tuner bench --config`),
    any other must match exactly one of the target's files (.yaml/.yml, .sh, .py, .env)."""
    if fmt == "json":
        return {out: exp.to_json()}
    if is_dir or out.endswith(("/", os.sep)):
        files = {**exp.files, JSON_NAME: exp.to_json()}
        return {str(Path(out) / name): text for name, text in files.items()}
    suffix = Path(out).suffix.lower()
    if suffix == ".json":
        return {out: exp.to_json()}
    wanted = ".yaml" if suffix == ".yml" else suffix
    matches = [name for name in exp.files if Path(name).suffix == wanted]
    if len(matches) == 1:
        return {out: exp.files[matches[0]]}
    accepted = sorted({Path(n).suffix for n in exp.files} | {".json"})
    raise TunerError(f"cannot write the {exp.target} export to {out!r}: give a path ending in "
                     f"{', '.join(accepted)} or a directory ending in '/'")


def work_tree(cwd: Path) -> Path:
    """The git work tree around `cwd`, or `cwd` itself outside git."""
    for d in (cwd, *cwd.parents):
        if (d / ".git").exists():
            return d
    return cwd


def check_path(path: str | Path, force: bool = False, cwd: Path | None = None) -> Path:
    """The resolved destination of `path`, or a TunerError: relative paths must stay inside the working tree,
    existing files need `force`, directories are never replaced."""
    raw = Path(path).expanduser()
    here = Path(cwd or os.getcwd()).resolve()
    full = (here / raw).resolve() if not raw.is_absolute() else raw.resolve()
    if not raw.is_absolute():
        tree = work_tree(here)
        if not full.is_relative_to(tree):
            raise TunerError(f"output path {str(path)!r} is outside the working tree {str(tree)!r}: give an "
                             "absolute path to write there")
    if full.is_dir():
        raise TunerError(f"output path {str(path)!r} is a directory: end it with '/' to write every file into it")
    if full.exists() and not force:
        raise TunerError(f"output file {str(path)!r} exists: pass --force to overwrite it")
    if full.parent.exists() and not full.parent.is_dir():
        raise TunerError(f"cannot write {str(path)!r}: {str(full.parent)!r} is not a directory")
    return full


def write_files(files: Mapping[str, str], force: bool = False, cwd: Path | None = None) -> list[Path]:
    """Write {path: text} atomically; checks every path first. Returns the written paths."""
    targets = [(check_path(p, force, cwd), text) for p, text in files.items()]
    if len({t for t, _ in targets}) != len(targets):
        raise TunerError("two outputs resolve to the same file")
    umask = os.umask(0)
    os.umask(umask)
    created: list[Path] = []
    temps: list[tuple[str, Path]] = []
    try:
        for full, text in targets:
            missing = [d for d in (full.parent, *full.parent.parents) if not d.exists()]
            for d in reversed(missing):
                d.mkdir()
                created.append(d)
            fd, tmp = tempfile.mkstemp(prefix=f".{full.name}.", suffix=".tmp", dir=full.parent)
            temps.append((tmp, full))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, (0o777 if full.suffix in (".sh", ".py") else 0o666) & ~umask)
        for tmp, full in temps:
            os.replace(tmp, full)
    except OSError as e:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
        raise TunerError(f"could not write {str(e.filename or '')!r}: {e.strerror or e}") from None
    return [full for full, _ in targets]
