"""A sweep's report: read every job, write the tables and plots (the command: `sinklab.cli.report`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from sinklab.config.claims import parse_claims
from sinklab.config.store import CONF_DIR
from sinklab.errors import UserError
from sinklab.evals import EVALUATIONS
from sinklab.report.baseline import check_baseline, choose_baseline
from sinklab.report.jobs import STALE_MINUTES, Sweep, load_sweeps, select
from sinklab.report.paper import load_paper_tables
from sinklab.report.plots import make_plots
from sinklab.report.stats import setting_differences
from sinklab.stats import CONFIDENCE
from sinklab.report.table import aggregate, job_table, none_for_missing, write_csv, write_markdown
from sinklab.report.verdicts import MIN_PAIRS, NOT_REPRODUCED_SHARE, REPRODUCED_SHARE, RULE, claims_table


def preset_path(name: str) -> Path:
    """`--claims NAME` -> conf/experiment/NAME.yaml, or NAME itself when it is a yaml file; else one line."""
    for path in (Path(name), CONF_DIR / "experiment" / f"{name}.yaml"):
        if path.suffix == ".yaml" and path.is_file():
            return path
    presets = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    raise UserError(f"--claims {name}: no such preset or yaml file (allowed: {', '.join(presets)}, or a path)")


def claims_spec(cfg, claims_from: Optional[str] = None) -> tuple[str, dict]:
    """(where they come from, {baseline, claims}) of a sweep: its config's experiment.baseline and .claims; for a
    sweep that has neither (it started before its preset stated claims), the preset's file
    conf/experiment/<experiment.name>.yaml as it is now; with `claims_from` (a preset name or a yaml file), that
    file's (another preset's claims judged on this sweep's settings, e.g. a sweep that ran the same models)."""
    spec = {k: select(cfg, f"experiment.{k}") for k in ("baseline", "claims")}
    name = select(cfg, "experiment.name")
    path = CONF_DIR / "experiment" / f"{name}.yaml"
    if claims_from is not None:
        path = preset_path(claims_from)
        preset = OmegaConf.load(path)
        return f"{path} (--claims)", {k: select(preset, f"experiment.{k}") for k in spec}
    if any(v is not None for v in spec.values()) or not isinstance(name, str) or not path.is_file():
        return "the sweep's config", spec
    preset = OmegaConf.load(path)
    return f"{path.relative_to(CONF_DIR.parent)} (the sweep's config has none)", \
        {k: select(preset, f"experiment.{k}") for k in spec}


def sweep_claims(sweep: Sweep, claims_from: Optional[str] = None) -> tuple[str, dict]:
    """`claims_spec` of a sweep; of a combined one (`load_sweeps`), the claims every dir states alike (claims are
    stated before the runs: dirs that state different ones are one line, unless `claims_from` names which)."""
    source, spec = claims_spec(sweep.cfg, claims_from)
    if claims_from is None and len(sweep.dirs) > 1:
        for d, cfg in zip(sweep.dirs[1:], sweep.dir_cfgs[1:]):
            other = claims_spec(cfg)[1]
            if OmegaConf.to_container(OmegaConf.create(other)) != OmegaConf.to_container(OmegaConf.create(spec)):
                raise UserError(f"SWEEP_DIRs {sweep.dirs[0]} and {d} state different claims or baselines "
                                "(experiment.claims / experiment.baseline); allowed: sweeps that state the same, or "
                                "--claims PRESET to judge one preset's on all")
    return source, spec


def build_report(sweep_dir, out_dir=None, *, paper_tables: Optional[Path] = None, now: Optional[float] = None,
                 stale_minutes: float = STALE_MINUTES, metrics: Sequence[str] = (),
                 baseline: Optional[dict] = None, claims_from: Optional[str] = None) -> dict:
    """Read every job of a sweep (``sweep_dir``; a list of dirs: one preset's sweeps as one, `load_sweeps`, with
    ``out_dir`` required) and write report.md, report.csv, and, when a setting has several seeds,
    report_aggregate.csv (the seed statistics) and report_differences.csv (each setting's difference from the
    baseline setting, paired by seed: ``baseline``, checked against the sweep, else the preset's experiment.baseline,
    else the swept keys' defaults, `sinklab.report.baseline`); with the preset's claims, report_claims.csv (their
    verdicts); and the PNG plots, into ``out_dir`` (default SWEEP_DIR/report).
    `metrics`: logged names to add as columns (besides the preset's experiment.report_metrics and the metrics its
    claims name). `claims_from`: judge that preset's (or yaml file's) claims instead of the sweep's own.

    Returns {"out_dir", "md", "csv", "aggregate_csv", "differences_csv", "claims_csv" (each None when not written),
    "plots": [paths], "rows": [one dict per job], "columns", "aggregate", "differences" (None, else one dict per
    row), "claims" (one dict per claim, with its pairs), "baseline" (the compared-with setting), "baseline_from"
    (how it was chosen) and "baseline_note" (that and how to choose another; both None without one), "swept",
    "rule"}; missing values are None.
    """
    dirs = [Path(d) for d in sweep_dir] if isinstance(sweep_dir, (list, tuple)) else [Path(sweep_dir)]
    if out_dir is None and len(dirs) > 1:
        raise UserError(f"{len(dirs)} SWEEP_DIRs need --out, the dir of their combined report (each sweep's own "
                        "report stays in SWEEP_DIR/report)")
    out_dir = Path(out_dir) if out_dir is not None else dirs[0] / "report"
    sweep = load_sweeps(dirs, now=now, stale_minutes=stale_minutes)
    if baseline:
        check_baseline(sweep, baseline)
    source, spec = sweep_claims(sweep, claims_from)
    preset_baseline, claims = parse_claims(spec, EVALUATIONS)
    tables = load_paper_tables(paper_tables)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir} cannot be made a directory ({e.strerror}); allowed: a directory or a new "
                        "path in a writable one") from e
    logged = {name for j in sweep.jobs for name in j.final}
    named = [m for c in claims for m in (c.metric, c.against_metric) if m in logged]  # what the claims test
    jobs, metrics = job_table(sweep, tables, [*metrics, *named])
    agg = aggregate(jobs, sweep.swept, metrics)
    # compared only where seeds pair the jobs; a default baseline is composed only then
    chosen = choose_baseline(sweep, baseline, preset_baseline, source) if agg is not None else None
    diffs = setting_differences(jobs, sweep.swept, metrics, chosen.setting) if chosen is not None else None
    note = chosen.line(sweep) if chosen is not None else None
    verdicts, claim_rows = claims_table(sweep, claims)
    csv_path = write_csv(out_dir / "report.csv", jobs)
    written = {name: write_csv(out_dir / f"report_{name}.csv", df) if df is not None else None
               for name, df in (("aggregate", agg), ("differences", diffs), ("claims", verdicts))}
    plots = make_plots(out_dir, sweep, jobs, claim_rows)
    md_path = write_markdown(out_dir / "report.md", sweep, jobs, metrics, agg, plots, out_dir, tables, diffs, verdicts,
                             source, note)
    return {"out_dir": out_dir, "md": md_path, "csv": csv_path, "aggregate_csv": written["aggregate"],
            "differences_csv": written["differences"], "claims_csv": written["claims"], "plots": plots,
            "rows": jobs.to_dict("records"), "columns": list(jobs.columns),
            "aggregate": None if agg is None else none_for_missing(agg).to_dict("records"),
            "differences": None if diffs is None else none_for_missing(diffs).to_dict("records"),
            "claims": claim_rows, "claims_from": source,
            "baseline": chosen.setting if chosen is not None else baseline or preset_baseline,
            "baseline_from": chosen.why if chosen is not None else None, "baseline_note": note, "swept": sweep.swept,
            "rule": {"text": RULE, "confidence": CONFIDENCE, "interval": "Student's t-interval of the mean",
                     "min_pairs": MIN_PAIRS, "reproduced_share": REPRODUCED_SHARE,
                     "not_reproduced_share": NOT_REPRODUCED_SHARE}}
