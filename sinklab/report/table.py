"""The report's tables: one row per job and the mean ± std over seeds, written as CSV and as report.md."""
from __future__ import annotations

import difflib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from sinklab.errors import UserError
from sinklab.io import atomic_write
from sinklab.keys import SINK1, VAL_LOSS
from sinklab.report.columns import Column, fmt, metric_columns
from sinklab.report.jobs import Sweep, is_seed_key
from sinklab.report.paper import PAPER_CITE, PAPER_COLUMNS, PAPER_LABELS, experiment_info, match_paper_row, \
    paper_values
from sinklab.report.stats import describe
from sinklab.stats import CONFIDENCE
from sinklab.report.verdicts import RULE
from sinklab.runs.status import Status

STATUS_ORDER = (Status.COMPLETED, Status.RUNNING, Status.PREEMPTED, Status.FAILED, Status.STALLED, Status.KILLED,
                Status.UNKNOWN, Status.PENDING)


def expand_metric_names(names: Sequence[str], logged: Optional[set[str]] = None) -> list[str]:
    """A registered metric's name (`sinklab.metrics.METRICS`, e.g. entropy) stands for the log keys it headlines
    (act/attn_entropy); a logged name stays as it is. With `logged` (every name some job logged), a metric's headline
    keys that no job logged are left out where it logged some of them (the `heads` metric logs the head types a
    model has, heads/rope/sink1 but no heads/alibi/sink1); all of them stay where it logged none."""
    from sinklab.metrics import METRICS

    out: list[str] = []
    for name in names:
        keys = list(METRICS.get(name).headline) if name in METRICS else [name]
        if name in METRICS and logged is not None and any(k in logged for k in keys):
            keys = [k for k in keys if k in logged]
        out.extend(keys)
    return list(dict.fromkeys(out))


def job_table(sweep: Sweep, tables: dict, extra: Sequence[str] = ()) -> tuple[pd.DataFrame, list[Column]]:
    """One row per job: job, swept keys, status, steps, final metrics (the sink and loss columns, the preset's
    experiment.report_metrics, then `extra`), paper values, error, dir; and the metrics. Missing values are None."""
    sweep_exp = experiment_info(sweep.cfg)
    logged = {name for j in sweep.jobs for name in j.final}
    extra = expand_metric_names([*sweep_exp["report_metrics"], *extra], logged)
    unknown = [name for name in extra if name not in logged]
    if unknown and any(j.status == Status.COMPLETED for j in sweep.jobs):
        near = difflib.get_close_matches(unknown[0], sorted(logged), n=3)
        raise UserError(f"metric {unknown[0]!r} (--metrics / experiment.report_metrics) was logged by no job of "
                        f"{sweep.where}; " + (f"did you mean {', '.join(near)}?" if near else
                                             f"logged: {', '.join(sorted(logged)[:12])}, ..."))
    metrics = metric_columns(logged, extra)
    records = []
    for job in sweep.jobs:
        exp = experiment_info(job.cfg) if job.cfg is not None else sweep_exp
        table = tables.get(exp["paper_table"]) if exp["paper_table"] else None
        records.append({"job": job.name, **{k: job.value(k) for k in sweep.swept}, "status": job.status,
                        "steps": job.steps, **{m.col: job.final.get(m.src) for m in metrics},
                        **paper_values(match_paper_row(table, exp["paper_match"], job.value)),
                        "error": job.error, "dir": str(job.path) if job.path else ""})
    wanted = {c for r in records for c in r if c.startswith("paper_")}
    if sweep_exp["paper_table"] and isinstance(tables.get(sweep_exp["paper_table"]), list):
        wanted |= {"paper_sink1", "paper_loss"}  # shown even where no row matched
    columns = ["job", *sweep.swept, "status", "steps", *[m.col for m in metrics],
               *[c for c in PAPER_COLUMNS if c in wanted], "error", "dir"]
    return none_for_missing(pd.DataFrame(records, columns=columns, dtype=object)), metrics


def none_for_missing(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` as Python objects, with None where a value is missing."""
    df = df.astype(object)
    return df.where(df.notna(), None)


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict)) else v


def group_ids(df: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """For each row, the number of its setting of ``keys`` (lists compared as JSON), numbered in order of first
    appearance; all rows are one group when there are no keys."""
    settings = df[keys].map(_hashable).itertuples(index=False, name=None)
    return pd.factorize(pd.Series(list(settings), index=df.index, dtype=object))[0]


def aggregate(df: pd.DataFrame, swept: list[str], metrics: list[Column]) -> Optional[pd.DataFrame]:
    """Per setting of the non-seed swept keys: the number of jobs and of completed ones, then for each metric over
    the completed jobs (``<col>_<stat>``, stat in ``stats.STATS``): n, mean, sample std, median, min, max and the 95%
    t-interval of the mean within the metric's physical range; then the paper's values. None when no setting has
    more than one job."""
    keys = [k for k in swept if not is_seed_key(k)]
    ids = group_ids(df, keys)
    if np.bincount(ids).max() < 2:
        return None
    done = df["status"].eq(Status.COMPLETED)
    values = df[[m.col for m in metrics]].astype(float).where(done, axis=0)
    stats = pd.DataFrame([{f"{m.col}_{stat}": v for m in metrics for stat, v in
                           describe(values.loc[ids == g, m.col], m.bounds).items()} for g in range(ids.max() + 1)])
    firsts = df.groupby(ids).head(1).reset_index(drop=True)  # a setting's keys and paper values
    counts = pd.DataFrame({"jobs": np.bincount(ids), "completed": done.groupby(ids).sum().to_numpy()})
    return pd.concat([firsts[keys], counts, stats, firsts[[c for c in df if c.startswith("paper_")]]], axis=1)


# ------------------------------------------------------------------------------------------------- writing
def _csv_cell(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)  # floats as their repr


def write_csv(path: Path, df: pd.DataFrame) -> Path:
    """``df`` as CSV: missing values empty, numbers as written, booleans lower case, lists and dicts as JSON."""
    return atomic_write(path, df.map(_csv_cell, na_action="ignore").to_csv(index=False, lineterminator="\r\n"))


def _md_cell(s: str, limit: int = 0) -> str:
    s = " ".join(str(s).split())
    if limit and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s.replace("|", "\\|")


def _cells(df: pd.DataFrame) -> pd.DataFrame:
    """Every value formatted for markdown by its column (see ``columns.fmt``); errors cut at 80 characters."""
    return df.apply(lambda c: c.map(lambda v: _md_cell(fmt(v, c.name), 80 if c.name == "error" else 0)))


def _markdown(cells: pd.DataFrame, labels: dict[str, str]) -> str:
    """Formatted cells as a markdown pipe table, headers renamed by ``labels``."""
    cells = cells.rename(columns=lambda c: _md_cell(labels.get(c, c)))
    return cells.to_markdown(index=False, disable_numparse=True)


def status_counts(statuses: Iterable[Status]) -> str:
    """'completed 2, running 1, failed 1' in STATUS_ORDER."""
    counts = pd.Series(list(statuses), dtype=object).value_counts()
    return ", ".join(f"{s} {counts[s]}" for s in STATUS_ORDER if s in counts)


def _paper_table_line(exp: dict[str, Any], tables: dict) -> list[str]:
    """The report.md line on the experiment's paper table and how its rows were matched; without a table, the line
    naming the published source the preset follows (none if it names none)."""
    name = exp["paper_table"]
    if not name:
        ref = exp["reference"]
        return [f"- Reference: {ref} (no transcribed table: no paper columns)"] if ref else []
    table = tables.get(name)
    if table is None:
        return [f"- Paper table: `{name}` (not in paper_tables.yaml)"]
    if isinstance(table, dict) and "figure_only" in table:
        return [f"- Paper table: `{name}`: figure only in the paper: {table['figure_only']}"]
    how = ", ".join(f"`{f}` = `{k}`" for f, k in exp["paper_match"].items())
    return [f"- Paper table: `{name}`" + (f", matched on {how}" if how else "")
            + f"; {PAPER_CITE}. Reference points, not targets at this scale."]


def _seed_statistics(agg: pd.DataFrame, keys: list[str], metrics: list[Column], labels: dict) -> list[str]:
    """report.md's long table of the seed statistics: one row per setting and metric that has a value."""
    rows = []
    for setting in agg.to_dict("records"):
        for m in metrics:
            if not setting[f"{m.col}_n"]:
                continue
            v = {stat: fmt(setting[f"{m.col}_{stat}"], m.col) for stat in ("mean", "median", "min", "max", "ci_low",
                                                                         "ci_high")}
            rows.append({**{k: fmt(setting[k]) for k in keys}, "metric": labels.get(m.col, m.col),
                         "n": str(setting[f"{m.col}_n"]), "mean": v["mean"],
                         f"{CONFIDENCE:.0%} CI": f"[{v['ci_low']}, {v['ci_high']}]" if v["ci_low"] else "",
                         "median": v["median"], "min - max": f"{v['min']} - {v['max']}"})
    return ["", f"## Seed statistics (completed jobs; {CONFIDENCE:.0%} t-interval of the mean)", "",
            _markdown(pd.DataFrame(rows).map(_md_cell), {})] if rows else []


def _differences(diffs: pd.DataFrame, keys: list[str], labels: dict, note: str) -> list[str]:
    """report.md's table of each setting's difference from the baseline, paired by seed, after ``note`` (which
    baseline, why, and how to choose another)."""
    rows = [{**{k: fmt(d[k]) for k in keys if k in d}, "metric": labels.get(d["metric"], d["metric"]),
             "pairs": str(d["pairs"]), "mean difference": fmt(d["diff_mean"], d["metric"]),
             f"{CONFIDENCE:.0%} CI": f"[{fmt(d['diff_ci_low'], d['metric'])}, {fmt(d['diff_ci_high'], d['metric'])}]"
             if fmt(d["diff_ci_low"]) else "", "higher / lower": f"{d['higher']} / {d['lower']}"}
            for d in diffs.to_dict("records")]
    return ["", f"## Paired differences from the baseline ({diffs['baseline'].iloc[0]}; by seed, "
                f"{CONFIDENCE:.0%} t-interval)", "", *([f"{note[:1].upper()}{note[1:]}.", ""] if note else []),
            _markdown(pd.DataFrame(rows).map(_md_cell), {})]


def _claims(claims: pd.DataFrame, source: str) -> list[str]:
    """report.md's verdict table of the preset's claims (stated in ``source``), with the rule."""
    cells = claims.assign(**{c: [fmt(v, m) for v, m in zip(claims[c], claims["metric"])]
                             for c in ("diff_mean", "diff_ci_low", "diff_ci_high")})
    cells[f"{CONFIDENCE:.0%} CI"] = ["[" + lo + ", " + hi + "]" if lo else "" for lo, hi in
                                     zip(cells.pop("diff_ci_low"), cells.pop("diff_ci_high"))]
    cells = cells[["claim", "text", "setting", "baseline", "metric", "direction", "pairs", "diff_mean",
                   f"{CONFIDENCE:.0%} CI", "claimed_sign", "verdict", "reason"]]
    labels = {"diff_mean": "mean paired difference", "claimed_sign": "claimed sign"}
    return ["", "## Claims", "", f"Claims from {source}. The rule (experiments/README.md): {RULE}.", "",
            _markdown(_cells(cells), labels)]


def write_markdown(path: Path, sweep: Sweep, jobs: pd.DataFrame, metrics: list[Column], agg: Optional[pd.DataFrame],
                   plots: list[Path], out_dir: Path, tables: dict, diffs: Optional[pd.DataFrame] = None,
                   claims: Optional[pd.DataFrame] = None, claims_from: str = "",
                   baseline_note: Optional[str] = None) -> Path:
    """report.md: what was swept and how it was matched to the paper, the jobs table, mean ± std over seeds, the seed
    statistics, the paired differences from the baseline (``baseline_note``: which, why, and how to choose another),
    the claims' verdicts, plots."""
    exp = experiment_info(sweep.cfg)
    dirs = "Sweep dirs" if len(sweep.dirs) > 1 else "Sweep dir"
    lines = [f"# Sweep report: {exp['name'] or sweep.dir.name}", "", f"- {dirs}: `{sweep.where}`",
             f"- Experiment: `{exp['name'] or '-'}`", *_paper_table_line(exp, tables)]
    regen = f"sinklab report {sweep.where} --out {out_dir}"
    lines += [f"- Swept: {', '.join(f'`{k}`' for k in sweep.swept) or 'nothing (single setting)'}",
              f"- Jobs: {len(jobs)} ({status_counts(jobs['status'])})",
              f"- Generated: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}",
              f"- Regenerate: `{regen}` (or `python -m sinklab report {sweep.where} --out {out_dir}`)",
              "", "Final values are the last logged ones; Sink_k in %, losses in nats.", "", "## Jobs", ""]
    labels = {m.col: m.label for m in metrics} | PAPER_LABELS
    lines.append(_markdown(_cells(jobs.drop(columns="dir")), labels))
    keys = [k for k in sweep.swept if not is_seed_key(k)]
    if agg is not None:
        cells = _cells(agg)
        for m in metrics:  # "mean ± std"; the mean alone when there is no std, empty when there is no mean
            mean, std = cells[f"{m.col}_mean"], cells[f"{m.col}_std"]
            cells[m.col] = mean.where(mean.eq("") | std.eq(""), mean + " ± " + std)
        order = keys + ["jobs", "completed", *(m.col for m in metrics)]
        cells = cells[order + [c for c in cells if c.startswith("paper_")]]  # then the paper's values
        lines += ["", "## Mean ± std over seeds (completed jobs)", "", _markdown(cells, labels)]
        lines += _seed_statistics(agg, keys, metrics, labels)
    if diffs is not None:
        lines += _differences(diffs, keys, labels, baseline_note or "")
    if claims is not None:
        lines += _claims(claims, claims_from)
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    else:
        lines += ["", f"No plots: no job has logged {SINK1} or {VAL_LOSS} yet."]
    return atomic_write(path, "\n".join(lines) + "\n")
