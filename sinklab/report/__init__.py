"""Sweep report: one table row per job of a Hydra multirun, plots, and the paper's numbers beside ours.

    sinklab report SWEEP_DIR [--out DIR]          # or: python -m sinklab report SWEEP_DIR [--out DIR]

A sweep dir holds ``multirun.yaml`` and one dir per job (``0/``, ``1/``, ...) with ``.hydra/config.yaml``,
``.hydra/overrides.yaml``, ``metrics.csv`` (Lightning CSVLogger format, sparse rows) and ``status.json``.
Any of these may be missing: the report works on a sweep that is still running or where jobs failed.
Jobs that ``multirun.yaml`` promises but that have no dir yet are listed as ``pending``.

Outputs in DIR (default SWEEP_DIR/report): ``report.md``, ``report.csv``, ``report_aggregate.csv`` (when some
swept setting has several seeds: n, mean, std, median, min, max and the 95% t-interval per metric),
``report_differences.csv`` (each setting's difference from the baseline setting, paired by seed; ``baseline`` says
which: --baseline, the preset's, else the swept keys' defaults),
``report_claims.csv`` (the verdicts of the preset's claims), ``sink1_vs_<key>.png``, ``val_loss_vs_<key>.png``,
``sink1_over_steps.png``, ``claims.png``.

Modules: ``jobs`` reads the sweep (job dirs, status, overrides, metrics.csv, the evaluation CSVs), ``paper`` matches
each job to the paper's table, ``columns`` says which metrics are shown and how, ``stats`` computes the seed
statistics and paired differences from the setting ``baseline`` chooses, ``verdicts`` applies the verdict rule to
the claims, ``table`` aggregates and writes the CSV and markdown, ``plots`` draws, ``build`` puts them together; the
command is ``sinklab.cli.report``.
"""
from sinklab.report.build import build_report
from sinklab.report.jobs import load_sweep, read_metrics
from sinklab.report.paper import load_paper_tables, match_paper_row, paper_values, values_match
from sinklab.report.plots import x_scale

__all__ = ["build_report", "load_sweep", "read_metrics", "load_paper_tables", "match_paper_row",
           "paper_values", "values_match", "x_scale"]
