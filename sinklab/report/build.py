"""A sweep's report: read every job, write the tables and plots (the command: `sinklab.cli.report`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from sinklab.errors import UserError
from sinklab.report.jobs import STALE_MINUTES, load_sweep
from sinklab.report.paper import load_paper_tables
from sinklab.report.plots import make_plots
from sinklab.report.table import aggregate, job_table, none_for_missing, write_csv, write_markdown


def build_report(sweep_dir, out_dir=None, *, paper_tables: Optional[Path] = None, now: Optional[float] = None,
                 stale_minutes: float = STALE_MINUTES, metrics: Sequence[str] = ()) -> dict:
    """Read every job of a sweep and write report.md, report.csv (and report_aggregate.csv when a setting has
    several seeds) and the PNG plots into ``out_dir`` (default SWEEP_DIR/report). `metrics`: logged names to add as
    columns (besides the preset's experiment.report_metrics).

    Returns {"out_dir", "md", "csv", "aggregate_csv" (or None), "plots": [paths], "rows": [one dict per job],
    "columns", "aggregate" (or None, else one dict per setting), "swept": [keys]}; missing values are None.
    """
    sweep_dir = Path(sweep_dir)
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir / "report"
    sweep = load_sweep(sweep_dir, now=now, stale_minutes=stale_minutes)
    tables = load_paper_tables(paper_tables)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir} cannot be made a directory ({e.strerror}); allowed: a directory or a new "
                        "path in a writable one") from e
    jobs, metrics = job_table(sweep, tables, metrics)
    agg = aggregate(jobs, sweep.swept, metrics)
    csv_path = write_csv(out_dir / "report.csv", jobs)
    agg_path = write_csv(out_dir / "report_aggregate.csv", agg) if agg is not None else None
    plots = make_plots(out_dir, sweep, jobs)
    md_path = write_markdown(out_dir / "report.md", sweep, jobs, metrics, agg, plots, out_dir, tables)
    return {"out_dir": out_dir, "md": md_path, "csv": csv_path, "aggregate_csv": agg_path, "plots": plots,
            "rows": jobs.to_dict("records"), "columns": list(jobs.columns),
            "aggregate": None if agg is None else none_for_missing(agg).to_dict("records"), "swept": sweep.swept}
