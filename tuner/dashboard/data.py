"""Where the dashboard's data comes from: the storage URL the app reads (`--storage`, $TUNER_STORAGE, the search's
default), a read-only Optuna storage, and the URL as the page shows it (tuner.search.storage checks a URL before
anything connects, and opens it).

The shaping of what a study holds lives beside it: tuner/dashboard/study.py (a study's settings and its trials as
TrialViews), fields.py (the numeric fields a chart axis can use), views.py (the trials table, hover text, a trial's
detail), figures.py (chart points, the Pareto line, target lines), why.py (the answer, constraints, importances),
exports.py (serving configs), curves.py (capacity: latency-load curves and the Plotly figures), predicted.py
(`--strategy predict`: predicted vs measured) and whatif.py (every configuration's predicted capacity re-ranked
under another SLO or workload).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner.search.storage import DEFAULT_STORAGE

STORAGE_ENV = "TUNER_STORAGE"


def storage_from_argv(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The storage URL the app reads: `--storage URL` among the script's arguments (`streamlit run app.py --
    --storage URL`), else $TUNER_STORAGE, else the search's default."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--storage")
    known, _ = p.parse_known_args(list(argv))
    return known.storage or environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def open_storage_readonly(url: str) -> Any:
    """An Optuna RDBStorage for an existing database (a missing SQLite file is a TunerError, not a new file)."""
    from tuner.search.storage import open_storage

    return open_storage(url, create=False)


def display_url(url: str) -> str:
    """The URL with its password masked (for the page and the terminal)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def sqlite_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
