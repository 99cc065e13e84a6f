"""`sinklab components`: every registered architecture component, the config key and value that select it, its knobs
with their defaults, and the conf/model/ files that select it. Generated from the registries, so it is complete."""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from sinklab.config.catalog import catalog

SUMMARY = "every registered architecture component, its knobs and config files"  # the line in `sinklab --help`


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sinklab components", description=__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    args = ap.parse_args(argv)
    entries = catalog()
    if args.json:
        print(json.dumps(entries, indent=1, default=str))
        return 0
    for e in entries:
        knobs = ", ".join(f"{k}={v}" for k, v in e["knobs"].items())
        print(f"{e['key'] + '=' + e['name']:<27} {e['about']}")
        if knobs:
            print(f"{'':<28}knobs: {knobs}")
        print(f"{'':<28}files: {', '.join(e['files']) or '(none: set ' + e['key'] + ' on the command line)'}")
    return 0
