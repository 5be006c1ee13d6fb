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
