"""`tuner worker`: one more process for an existing search study (same flags as `tuner search`).

    tuner search --model smollm2-135m --latency-target 3s --trials 30 --study s1 --storage postgresql://... &
    tuner worker --model smollm2-135m --latency-target 3s --trials 30 --study s1 --storage postgresql://...

Workers share the study's --trials budget (all of them together stop at N trials), never sample the same
configuration twice at the same time, and take over nothing: a trial whose worker dies is marked failed. Unlike
`tuner search`, a worker refuses to create the study: it must exist in --storage already.
"""

from __future__ import annotations

import argparse

from tuner.errors import TunerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tuner.cli.search import add_arguments

    p = sub.add_parser("worker", help="join an existing search study as one more worker",
                       description="Join an existing `tuner search` study (same --study and --storage, same "
                                   "settings) and share its --trials budget with the other workers.")
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from tuner.cli import search

    if not args.study:
        raise TunerError("--study is required: a worker joins an existing study (the name given to `tuner search`)")
    if not args.storage:
        raise TunerError("--storage is required: a worker joins a study in an existing storage (e.g. "
                         "postgresql://user@host:5432/db or sqlite:///results/tuner.db)")
    return search.run(args, join=True)
