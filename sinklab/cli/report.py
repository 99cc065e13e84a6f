"""`sinklab report SWEEP_DIR [--out DIR]`: read a sweep, write its tables and plots (`sinklab.report`), print where
they are. Bad input is one line on stderr and exit code 1."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from sinklab.errors import UserError
from sinklab.report.build import build_report
from sinklab.report.jobs import STALE_MINUTES
from sinklab.report.table import status_counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; 0 on success, 1 (and one line on stderr) for bad input."""
    ap = argparse.ArgumentParser(prog="sinklab report", description="Tables and plots for a Hydra multirun sweep.")
    ap.add_argument("sweep_dir", type=Path, help="the multirun dir (holds multirun.yaml and 0/, 1/, ...)")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: SWEEP_DIR/report)")
    ap.add_argument("--paper-tables", type=Path, default=None, help="paper_tables.yaml (default: the packaged one)")
    ap.add_argument("--stale-minutes", type=float, default=STALE_MINUTES,
                    help="a job whose files have not changed for this long is not running any more (default 10)")
    ap.add_argument("--metrics", nargs="+", default=[], metavar="NAME",
                    help="logged metrics to add as columns, e.g. act/resid_kurtosis act/massive_top, or a registered "
                         "metric's name for its headline values (entropy: act/attn_entropy; sinklab.metrics.METRICS), "
                         "besides the preset's experiment.report_metrics")
    args = ap.parse_args(argv)
    try:
        res = build_report(args.sweep_dir, args.out, paper_tables=args.paper_tables,
                           stale_minutes=args.stale_minutes, metrics=args.metrics)
    except UserError as e:
        print(f"sinklab report: error: {e}", file=sys.stderr)
        return 1
    print(f"{len(res['rows'])} jobs ({status_counts(r['status'] for r in res['rows'])})")
    for p in [res["md"], res["csv"], res["aggregate_csv"], *res["plots"]]:
        if p is not None:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
