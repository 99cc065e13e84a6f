"""`sinklab check-component MODULE [MODULE...]`: the contract checks of sinklab's tests on the components and
metrics that a module of your own package registers (a package name covers its submodules).

It imports the modules (as SINKLAB_PLUGINS would), then runs every check of sinklab.contracts on each component
(per knob value and mask, as tests/model/test_contracts.py does for sinklab's own) and each metric: one line per failed
check, `FAIL <check>: <case>: <why>`, and a count. Exit code 0 when every check passes, 1 when one fails, 2 when a
module cannot be imported or registers nothing.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

from sinklab.cli.base import OneLineParser
from sinklab.contracts import checks
from sinklab.errors import describe

SUMMARY = "run the contract tests on your own component or metric module"  # the line in `sinklab --help`


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog="sinklab check-component", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="+", metavar="MODULE", help="e.g. mypkg.ops.myop (importable: installed or on "
                    "PYTHONPATH)")
    ap.add_argument("-k", dest="keyword", default=None, help="only the checks whose line contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line for each passed check too")
    args = ap.parse_args(argv)
    chosen = [(what, run) for what, run in checks(args.modules, where="sinklab check-component")
              if args.keyword is None or args.keyword in what]
    failed, t0 = 0, time.perf_counter()
    for what, run in chosen:
        try:
            run()
        except Exception as err:  # noqa: BLE001  (every failure is reported, one line each)
            failed += 1
            print(f"FAIL {what}: {describe(err)}", flush=True)
        else:
            if args.verbose:
                print(f"ok   {what}", flush=True)
    print(f"{len(chosen) - failed} of {len(chosen)} contract checks passed for {', '.join(args.modules)} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0
