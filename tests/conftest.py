from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_tuner(*args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None):
    """Run the real `tuner` command line in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=cwd or REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_one_line_error(proc, *needles: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, naming what was wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def tuner_cli():
    return run_tuner
