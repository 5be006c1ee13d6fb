"""`tuner dashboard`: open the Streamlit dashboard (app.py) on a study storage, bound to 127.0.0.1 unless told
otherwise. Equivalent to `streamlit run app.py -- --storage URL` with the server flags below; everything is
checked (storage URL, port, host, app, streamlit) before Streamlit starts, and bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

APP = Path(__file__).resolve().parents[2] / "app.py"
DEFAULT_PORT = 8501
DEFAULT_HOST = "127.0.0.1"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from tuner.dashboard.data import STORAGE_ENV
    from tuner.search.storage import DEFAULT_STORAGE

    p = subparsers.add_parser(
        "dashboard", help="open the Streamlit dashboard",
        description="Serve the dashboard (Pareto view, trials, trial detail, recommendation, exports) of the "
                    "studies in an Optuna storage; it refreshes while a search runs.")
    p.add_argument("--storage", default=None,
                   help=f"Optuna storage URL (default: ${STORAGE_ENV}, else {DEFAULT_STORAGE})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to serve on (default {DEFAULT_PORT})")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to bind (default {DEFAULT_HOST}; 0.0.0.0 exposes it to the network)")
    return p


def streamlit_argv(app: Path, storage: str, host: str, port: int) -> list[str]:
    """The `streamlit run` command line: local, headless, no usage statistics, no file watching."""
    return [sys.executable, "-m", "streamlit", "run", str(app),
            "--server.address", host, "--server.port", str(port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--browser.serverAddress", host,
            "--server.fileWatcherType", "none", "--server.runOnSave", "false",
            "--global.developmentMode", "false", "--client.toolbarMode", "minimal",
            "--", "--storage", storage]


def check_port(host: str, port: int) -> None:
    from tuner.errors import TunerError

    if not 1 <= port <= 65535:
        raise TunerError(f"--port {port} is invalid: expected a port number in 1..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise TunerError(f"--host {host!r} is invalid: cannot resolve it ({e})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise TunerError(f"--port {port} on {host}: cannot listen there ({e.strerror or e}): expected a free "
                             "port on a local address") from None


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from tuner.dashboard.data import STORAGE_ENV, display_url
    from tuner.errors import TunerError
    from tuner.search.storage import DEFAULT_STORAGE, check_storage_url

    if args.storage is not None:
        storage, what = args.storage, "--storage"
    else:
        storage, what = os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE, f"${STORAGE_ENV}"
    check_storage_url(storage, what)
    check_port(args.host, args.port)
    if not APP.is_file():
        raise TunerError(f"dashboard app {str(APP)!r} not found: `tuner dashboard` runs from a source checkout")
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise TunerError("streamlit and plotly are not installed: pip install 'tuner[dashboard]'")
    argv = streamlit_argv(APP, storage, args.host, args.port)
    print(f"tuner dashboard: {display_url(storage)} at http://{args.host}:{args.port} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os.execv(argv[0], argv)  # Streamlit replaces this process: signals and the exit code are its own
    return 0  # pragma: no cover
