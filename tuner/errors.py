"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations


class TunerError(Exception):
    """A bad value from the user. Its message names the value and what is accepted."""

    exit_code = 2


class UnsupportedConfig(TunerError):
    """A configuration this device or library cannot run (e.g. torchao int4 on CPU)."""


def one_line(e: BaseException) -> str:
    """An exception as one line of a failure reason: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def os_error_line(e: OSError) -> str:
    """An operating-system error (a path that is a file where a folder is needed, a dangling link, a full disk, a
    permission) as one line naming its path(s)."""
    if not e.filename:
        return one_line(e)
    paths = repr(str(e.filename)) + (f" -> {str(e.filename2)!r}" if e.filename2 else "")
    return f"{paths}: {e.strerror or type(e).__name__}: expected a path tuner can create, read and write"
