"""`tuner models`: the models tuner can load (bundled aliases and cached conversions)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the models tuner can load")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from tuner.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']:<24} {r['kind']:<18} {r['status']:<12} {r['description']}")
    return 0
