"""`tuner engines`: the serving engines tuner can measure on, whether each can run here, and why not."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engines", help="list the serving engines and whether each can run here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from tuner.engines.registry import availability

    rows = availability()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['engine']:<14} {'available' if r['available'] else 'unavailable':<12} {r['detail']}")
    return 0
