"""`sinklab report SWEEP_DIR [--out DIR] [--baseline KEY=VALUE ...] [--json]`: read a sweep, write its tables and plots
(`sinklab.report`), print where they are, or with --json one JSON object of the numbers (every job's values, the seed
statistics, the paired differences, the claims' verdicts and the rule). Bad input is one line on stderr and exit
code 1."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from sinklab.cli.base import finite
from sinklab.errors import UserError
from sinklab.report.build import build_report
from sinklab.report.jobs import STALE_MINUTES
from sinklab.report.table import status_counts

SUMMARY = "tables and plots from a (finished or running) sweep dir"  # the line in `sinklab --help`


def parse_baseline(items: Sequence[str]) -> Optional[dict]:
    """['model/gate=none', 'seed=0'] -> {'model/gate': 'none', 'seed': 0} (values read as YAML); None for none."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UserError(f"--baseline {item!r} is not KEY=VALUE; allowed: a swept key and its value, e.g. "
                            "--baseline model/gate=none")
        out[key] = yaml.safe_load(value) if value else ""
    return out or None


def as_json(res: dict) -> str:
    """The numbers of a report as one strict-JSON object (NaN / inf as null)."""
    keys = ("swept", "baseline", "baseline_from", "rule", "rows", "aggregate", "differences", "claims")
    files = {k: str(res[k]) for k in ("out_dir", "md", "csv", "aggregate_csv", "differences_csv", "claims_csv")
             if res[k] is not None}
    out = {"files": files, "plots": [str(p) for p in res["plots"]], **{k: res[k] for k in keys}}
    return json.dumps(finite(json.loads(json.dumps(out, default=_plain))), allow_nan=False)


def _plain(v):
    """numpy scalars as Python numbers, anything else JSON does not know (a status, a path) as text."""
    return v.item() if hasattr(v, "item") and callable(v.item) else str(v)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; 0 on success, 1 (and one line on stderr) for bad input."""
    ap = argparse.ArgumentParser(prog="sinklab report", description="Tables and plots for a Hydra multirun sweep.")
    ap.add_argument("sweep_dir", type=Path, nargs="+", metavar="SWEEP_DIR",
                    help="the multirun dir (holds multirun.yaml and 0/, 1/, ...); several dirs of one preset (seeds "
                         "added by a later sweep) are reported as one sweep, into --out")
    ap.add_argument("--out", type=Path, default=None,
                    help="output dir (default: SWEEP_DIR/report; required with several SWEEP_DIRs)")
    ap.add_argument("--paper-tables", type=Path, default=None, help="paper_tables.yaml (default: the packaged one)")
    ap.add_argument("--stale-minutes", type=float, default=STALE_MINUTES,
                    help="a job whose files have not changed for this long is not running any more (default 10)")
    ap.add_argument("--metrics", nargs="+", default=[], metavar="NAME",
                    help="logged metrics to add as columns, e.g. act/resid_kurtosis act/massive_top, or a registered "
                         "metric's name for its headline values (entropy: act/attn_entropy; sinklab.metrics.METRICS), "
                         "besides the preset's experiment.report_metrics")
    ap.add_argument("--baseline", nargs="+", default=[], metavar="KEY=VALUE",
                    help="the baseline setting each setting is compared with, paired by seed: swept keys other than "
                         "the seed and values the sweep ran (default: the preset's experiment.baseline, else each "
                         "swept key's default, or its first swept value when the default was not run), e.g. "
                         "--baseline optim.weight_decay=0.1")
    ap.add_argument("--claims", default=None, metavar="PRESET",
                    help="judge the claims (and baseline) of this preset (conf/experiment/PRESET.yaml) or yaml file "
                         "instead of the sweep's own, e.g. sink_uses on an outliers_quant sweep of the same models")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object of the numbers instead of the list of files")
    args = ap.parse_args(argv)
    try:
        # with --json stdout carries exactly one object: anything printed while building goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            res = build_report(args.sweep_dir, args.out, paper_tables=args.paper_tables,
                               stale_minutes=args.stale_minutes, metrics=args.metrics,
                               baseline=parse_baseline(args.baseline), claims_from=args.claims)
    except UserError as e:
        print(f"sinklab report: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(as_json(res))
        return 0
    print(f"{len(res['rows'])} jobs ({status_counts(r['status'] for r in res['rows'])})")
    if res["baseline_note"]:  # which setting the paired differences are from, and how to name another
        print(res["baseline_note"] if res["differences"] is not None else
              f"no paired differences (no setting shares a seed with the baseline): {res['baseline_note']}")
    for claim in res["claims"]:
        print(f"claim {claim['claim']}: {claim['verdict']}" + (f" ({claim['reason']})" if claim["reason"] else ""))
    for p in [res["md"], res["csv"], res["aggregate_csv"], res["differences_csv"], res["claims_csv"], *res["plots"]]:
        if p is not None:
            print(p)
    return 0
