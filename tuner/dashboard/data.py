"""Where the dashboard's data comes from: the storage URL the app reads (`--storage`, $TUNER_STORAGE, the search's
default), its checks before anything connects, a read-only Optuna storage, and the URL as the page shows it.

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

from tuner.errors import TunerError
from tuner.search.answer import DEFAULT_STORAGE

STORAGE_ENV = "TUNER_STORAGE"


def storage_from_argv(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The storage URL the app reads: `--storage URL` among the script's arguments (`streamlit run app.py --
    --storage URL`), else $TUNER_STORAGE, else the search's default."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--storage")
    known, _ = p.parse_known_args(list(argv))
    return known.storage or environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def check_storage_url(url: str, what: str = "--storage") -> str:
    """A storage URL the dashboard can read, checked without connecting: its syntax, that SQLAlchemy has its
    driver, and for SQLite that the directory exists (a missing file is fine: the app waits for a search)."""
    if not re.match(r"^[a-z][a-z0-9+]*://", url or ""):
        raise TunerError(f"{what} {url!r} is invalid: expected an Optuna storage URL such as {DEFAULT_STORAGE} "
                         "or postgresql://user:pw@host/db")
    from sqlalchemy.engine import make_url

    try:
        from tuner.search.loop import sqlalchemy_url

        make_url(sqlalchemy_url(url)).get_dialect()
    except Exception as e:  # ArgumentError (bad URL), NoSuchModuleError (unknown scheme), ImportError (driver)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TunerError(f"{what} {url!r} is unusable: {msg[:160]}") from None
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if str(path) not in ("", ":memory:") and not path.parent.is_dir():
            raise TunerError(f"{what} {url!r}: directory {str(path.parent)!r} does not exist")
    return url


def open_storage_readonly(url: str) -> Any:
    """An Optuna RDBStorage for an existing database (a missing SQLite file is a TunerError, not a new file)."""
    from tuner.search.answer import open_storage

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
