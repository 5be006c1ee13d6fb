"""Atomic writes, the one home for them: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tuner.errors import TunerError


def write_atomic(path: Path, write: Callable[[IO[Any]], None], binary: bool = False) -> None:
    """`write(f)` into a temp file in the same folder (opened "wb" when `binary`), then fsync + rename (0644).
    Creates the folder if needed; an exception (Ctrl-C included) leaves neither the file nor the temp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are plain files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: Path, data: Any, sort_keys: bool = False) -> None:
    """JSON, indented, with a trailing newline."""

    def dump(f: IO[str]) -> None:
        json.dump(data, f, indent=2, default=str, sort_keys=sort_keys)
        f.write("\n")

    write_atomic(path, dump)


def check_folder(path: Path, name: str) -> Path:
    """`path` as a folder tuner may create (its first existing ancestor a folder, or itself one), else one line naming
    `name` (the flag or variable that gave it) and the part of the path in the way."""
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"is under {str(part)!r}, a file"
                raise TunerError(f"{name} {str(path)!r} {what}: expected a folder (created if missing)")
            return path
    return path
