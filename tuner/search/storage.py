"""Where a search's studies live: the storage URL (checked before anything is written), the Optuna storage opened on
it, the study's name, and the lock every worker of a storage shares.

Several workers (`tuner search` / `tuner worker` on the same --study and --storage) hold `StorageLock` while they
count the study's trials, create their trial and sample its configuration (tuner.search.loop): a file lock next to a
SQLite or journal file, a PostgreSQL advisory lock (released by the server if the worker dies).
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from pathlib import Path
from typing import Any

from tuner.errors import TunerError, one_line

DEFAULT_STORAGE = "sqlite:///results/tuner.db"
LOCK_SUFFIX = ".tuner-lock"
PG_LOCK_KEY = zlib.crc32(b"tuner-search-storage-lock")  # one advisory lock per PostgreSQL database
HEARTBEAT_S = 10.0  # `TUNER_HEARTBEAT_S`'s default: a RUNNING trial's worker beats this often; grace period 3x
_URL = re.compile(r"^[a-z][a-z0-9+]*://")


# ---------------------------------------------------------------------------------------------- URLs --- #
def sqlalchemy_url(url: str) -> str:
    """`postgresql://` with psycopg2 when psycopg (v3, SQLAlchemy 2.1's default driver) is missing."""
    import importlib.util

    if url.startswith(("postgresql://", "postgres://")) and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def check_storage_url(url: str, what: str = "--storage", results_dir: Path | None = None) -> str:
    """A storage URL checked without connecting: its form, that SQLAlchemy has its dialect and driver, and for a
    SQLite file that its directory exists. A reader (the dashboard: `results_dir` None) may name a file that does not
    exist yet (the app waits for a search). A writer (a search: `results_dir` is the results directory it creates)
    may not name an in-memory database (lost when the search ends) nor a directory, and its file's directory may be
    `results_dir`. `what` names the value in an error (--storage, $TUNER_STORAGE)."""
    if not _URL.match(url or ""):
        raise TunerError(f"{what} {url!r} is invalid: expected an Optuna storage URL such as {DEFAULT_STORAGE} or "
                         "postgresql://user:pw@host:5432/db")
    from sqlalchemy.engine import make_url

    try:
        make_url(sqlalchemy_url(url)).get_dialect()
    except Exception as e:  # ArgumentError (bad URL), NoSuchModuleError (unknown scheme), ImportError (driver)
        raise TunerError(f"{what} {url!r} is unusable: {one_line(e)[:160]}: expected sqlite:///FILE or "
                         "postgresql://USER@HOST:PORT/DB") from None
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        in_memory = str(path) in ("", ":memory:")
        if results_dir is not None and in_memory:
            raise TunerError(f"{what} {url!r} is invalid: an in-memory database is lost when the search ends; "
                             "expected sqlite:///FILE")
        if results_dir is not None and path.is_dir():
            raise TunerError(f"{what} {url!r}: {str(path)!r} is a directory: expected a database file path")
        made_by_search = results_dir is not None and path.parent.resolve() == results_dir.resolve()
        if not in_memory and not path.parent.is_dir() and not made_by_search:
            raise TunerError(f"{what} {url!r}: directory {str(path.parent)!r} does not exist")
    return url


# ------------------------------------------------------------------------------------------- storage --- #
def open_storage(url: str, create: bool = True, read_only: bool | None = None) -> Any:
    """An Optuna storage for `url`, checked reachable before anything is written. SQLite files need an existing
    directory; other URLs (postgresql://...) must accept a connection. With `create=False` the storage must exist
    already, and a SQLite file is opened read-only (no tables are ever created in a file that is not a study
    database) unless `read_only=False` (a worker joining a study writes trials into it). `postgresql://` uses
    psycopg2 when psycopg (v3, SQLAlchemy 2.1's default driver) is not installed (`sqlalchemy_url`).
    Heartbeats (`TUNER_HEARTBEAT_S`, default `HEARTBEAT_S`; grace period 3x) let a worker mark the RUNNING trial of
    a dead worker FAIL."""
    import warnings

    import optuna

    if not _URL.match(url or ""):
        raise TunerError(f"storage {url!r} is invalid: expected an Optuna storage URL such as "
                         f"{DEFAULT_STORAGE} or postgresql://user:pw@host/db")
    target = sqlalchemy_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if not create and not path.is_file():
            raise TunerError(f"storage {url!r}: no such database file {str(path)!r}")
        if not path.parent.is_dir():
            raise TunerError(f"storage {url!r}: directory {str(path.parent)!r} does not exist")
        if (not create) if read_only is None else read_only:
            target = f"sqlite:///file:{path.resolve()}?mode=ro&uri=true"
    try:
        beat = float(os.environ.get("TUNER_HEARTBEAT_S", str(HEARTBEAT_S)))
        beat = beat if beat > 0 else HEARTBEAT_S
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeat_interval
        return optuna.storages.RDBStorage(target, heartbeat_interval=int(max(1, beat)),
                                          grace_period=int(max(2, 3 * beat)), engine_kwargs=engine_kwargs(target))
    except Exception as e:
        msg = one_line(e)
        if not create and "readonly" in msg:
            msg = "not an Optuna study database"
        raise TunerError(f"storage {url!r} is unreachable: {msg[:200]}") from None


def engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine settings: a SQLite writer waits up to 60 s for another's lock; a server connection is
    checked before use."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    return {"pool_pre_ping": True}


# --------------------------------------------------------------------------------------- study names --- #
def default_study_name(model: str, metric: str, target: str) -> str:
    base = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{base}-{metric.replace(':', '-')}-{target}").strip("-")


def check_study_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name or ""):
        raise TunerError(f"study name {name!r} is invalid: expected 1-128 characters of letters, digits, '.', '_', '-' "
                         "starting with a letter or digit")
    return name


# ---------------------------------------------------------------------------------------------- lock --- #
class StorageLock:
    """A lock shared by every worker of a storage: `fcntl.flock` on `<file>.tuner-lock` next to a SQLite or journal
    file, `pg_advisory_lock` on PostgreSQL (released by the server if the worker dies). Other storages get a
    process-local lock only. Re-entrant acquire is not supported; `release` is idempotent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held = False
        self._fd: int | None = None
        self._path: Path | None = None
        self._created = False
        self._conn: Any = None
        self._engine: Any = None

    @staticmethod
    def file_for(url: str) -> Path | None:
        for prefix in ("sqlite:///", "journal:///"):
            if url.startswith(prefix):
                p = url[len(prefix):]
                return None if p in ("", ":memory:") else Path(p + LOCK_SUFFIX)
        return None

    def acquire(self) -> None:
        if self.held:
            return
        if self.url.startswith(("postgresql", "postgres:")):
            self._pg_acquire()
        else:
            path = self.file_for(self.url)
            if path is not None and path.parent.is_dir():
                import fcntl

                if self._fd is None:
                    self._created = not path.exists()
                    self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                    self._path = path
                fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.held = True

    def _pg_acquire(self) -> None:
        if self._conn is None:
            import sqlalchemy

            try:
                self._engine = sqlalchemy.create_engine(sqlalchemy_url(self.url), poolclass=sqlalchemy.pool.NullPool)
                self._conn = self._engine.connect()
                self._conn.execution_options(isolation_level="AUTOCOMMIT")
            except Exception as e:
                raise TunerError(f"storage {self.url!r} is unreachable: {one_line(e)[:200]}") from None
        from sqlalchemy import text

        self._conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": PG_LOCK_KEY})

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._conn is not None:
            from sqlalchemy import text

            with contextlib.suppress(Exception):
                self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PG_LOCK_KEY})
        elif self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self, remove_if_created: bool = False) -> None:
        """Release and close; `remove_if_created` drops a lock file this process created (bad storage: nothing
        is left behind)."""
        self.release()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if remove_if_created and self._created and self._path is not None:
                self._path.unlink(missing_ok=True)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._engine.dispose()
            self._conn = self._engine = None

    def __enter__(self) -> StorageLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
