"""`sinklab check-component MODULE [MODULE...]`: the contract checks of sinklab's tests on the components and
metrics that a module of your own package registers (a package name covers its submodules).

It imports the modules (as SINKLAB_PLUGINS would), then runs every check of sinklab.contracts on each component
(per knob value and mask, as tests/test_contracts.py does for sinklab's own) and each metric: one line per failed
check, `FAIL <check>: <case>: <why>`, and a count. Exit code 0 when every check passes, 1 when one fails, 2 when a
module cannot be imported or registers nothing.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Iterator, Optional, Sequence

from sinklab.errors import UserError, describe


def owned_by(obj: type, modules: Sequence[str]) -> bool:
    return any(obj.__module__ == m or obj.__module__.startswith(m + ".") for m in modules)


def checks_of(modules: Sequence[str]) -> list[tuple[str, Callable[[], None]]]:
    """(what, run) for every check of every component and metric the modules register."""
    from sinklab.contracts import components, metrics
    from sinklab.metrics import METRICS
    from sinklab.model.registry import FAMILIES

    runs: list[Iterator] = [components.runs(cls) for family in FAMILIES for cls in family if owned_by(cls, modules)]
    runs += [metrics.runs(cls) for cls in METRICS if owned_by(cls, modules)]
    if not runs:
        raise UserError(f"{', '.join(modules)} registers no component and no metric; allowed: a module that "
                        "registers with @ATTENTION_OPS.register(...) (or POSITIONS, NORMS, NORM_POSITIONS, FFNS, "
                        "GATES, ATTN_BIASES; sinklab.model.registry) or @METRICS.register(...) (sinklab.metrics.base)")
    return [check for run in runs for check in run]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sinklab check-component", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="+", metavar="MODULE", help="e.g. mypkg.ops.myop (importable: installed or on "
                    "PYTHONPATH)")
    ap.add_argument("-k", dest="keyword", default=None, help="only the checks whose line contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line for each passed check too")
    args = ap.parse_args(argv)
    from sinklab.plugins import load_plugins

    load_plugins(args.modules, where="sinklab check-component")
    checks = [(what, run) for what, run in checks_of(args.modules) if args.keyword is None or args.keyword in what]
    failed, t0 = 0, time.perf_counter()
    for what, run in checks:
        try:
            run()
        except Exception as err:  # noqa: BLE001  (every failure is reported, one line each)
            failed += 1
            print(f"FAIL {what}: {describe(err)}", flush=True)
        else:
            if args.verbose:
                print(f"ok   {what}", flush=True)
    print(f"{len(checks) - failed} of {len(checks)} contract checks passed for {', '.join(args.modules)} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0
