"""`tuner` command line. Each subcommand lives in its own module `tuner.cli.<name>` exposing
`add_parser(subparsers)` and `run(args) -> int`; modules are imported lazily (a registry of names, like lm-eval's).

User errors (TunerError, argparse errors) and paths the OS refuses (OSError) print one line and exit with code 2, with
no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> module implementing it; help text shown in `tuner --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("tuner.cli.bench", "measure one serving configuration under load"),
    "models": ("tuner.cli.models", "list the models tuner can load"),
    "engines": ("tuner.cli.engines", "list the serving engines and whether each can run here"),
    "eval": ("tuner.cli.eval", "score a configuration's quality with lm-eval"),
    "search": ("tuner.cli.search", "search the four knobs with Optuna under a latency target"),
    "worker": ("tuner.cli.worker", "join an existing search study as one more worker"),
    "export": ("tuner.cli.export", "export a trial's config to vLLM, SGLang, TGI, llama.cpp or transformers"),
    "dashboard": ("tuner.cli.dashboard", "open the Streamlit dashboard"),
    "profile": ("tuner.cli.profile", "measure an engine's step times on this host (for tuner predict)"),
    "predict": ("tuner.cli.predict", "predict a configuration's capacity from its engine profile"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input on one line with exit code 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tuner", description="Find the fastest way to serve an LLM under a latency target.")
    from tuner import __version__

    parser.add_argument("--version", action="version", version=f"tuner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    wanted = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (module, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module) is None:
            continue
        if wanted == name:  # only the command being run pays for its imports
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a job scheduler, a container stop) stops a command as Ctrl-C does: the engines and servers it
    started are stopped, what finished is kept, exit 130 (it used to end the process where it stood)."""
    import signal
    import threading

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    from tuner.errors import TunerError
    from tuner.quiet import quiet_libraries

    quiet_libraries()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:])
    module = importlib.import_module(COMMANDS[args.command][0])
    stop_on_sigterm()
    try:
        return int(module.run(args) or 0)
    except TunerError as e:
        print(f"tuner {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a path the OS refused (a folder that is a file, a full disk): one line naming it
        from tuner.errors import os_error_line

        print(f"tuner {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tuner {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
