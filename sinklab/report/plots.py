"""The report's plots: each final metric against each swept key, and Sink_1 over training steps."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import matplotlib
import matplotlib.ticker
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from sinklab.io import atomic_write
from sinklab.keys import PERCENT
from sinklab.report.columns import SINK1_METRIC, VAL_LOSS_METRIC, Column, fmt, short_keys
from sinklab.report.jobs import Job, Sweep, is_seed_key
from sinklab.report.paper import experiment_info
from sinklab.report.stats import describe
from sinklab.stats import CONFIDENCE
from sinklab.report.table import group_ids
from sinklab.runs.status import Status

RC = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 9,
      "xtick.labelsize": 10, "ytick.labelsize": 10, "axes.grid": True, "grid.alpha": 0.3}
# (metric, y label, paper column, what it is in titles) of the plots against each swept key
VS_KEY = ((SINK1_METRIC, "Sink$_1$ (%)", "paper_sink1", "Sink$_1$"),
          (VAL_LOSS_METRIC, "validation loss (nats)", "paper_loss", "validation loss"))
# how a job that is not completed is drawn against a swept key (see _drawn_as): (legend label, marker style)
UNFINISHED = {
    Status.RUNNING: ("running", dict(marker="o", mfc="white", mew=1.5, ms=7, zorder=3)),
    Status.PREEMPTED: ("preempted", dict(marker="s", mfc="white", mew=1.5, ms=7, zorder=3)),
    Status.FAILED: ("failed / killed", dict(marker="x", mec="tab:red", ms=9, mew=2, zorder=4)),
}
PAPER_STYLE = dict(marker="*", ms=13, mfc="gold", mew=1.2, ls="none", zorder=5)


def x_scale(values: Sequence[float]) -> tuple[str, dict]:
    """'log' when all values are positive and span a decade or more; 'symlog' (linear around 0) when a zero
    joins positive values that span a decade; else 'linear'."""
    vals = [float(v) for v in values]
    pos = [v for v in vals if v > 0]
    if len(pos) >= 2 and max(pos) / min(pos) >= 10:
        if len(pos) == len(vals):
            return "log", {}
        if all(v >= 0 for v in vals):
            return "symlog", {"linthresh": min(pos), "linscale": 0.5}
    return "linear", {}


def _drawn_as(status: Status) -> Status:
    """The UNFINISHED entry of a job that is not completed: failed, killed and stalled ones are drawn as failed."""
    if status.failed:
        return Status.FAILED
    return Status.PREEMPTED if status is Status.PREEMPTED else Status.RUNNING


def _new_axes(size=(7.0, 4.6)):
    fig = Figure(figsize=size, dpi=150, layout="constrained")
    return fig, fig.add_subplot()


def _set_x_axis(ax, xs: pd.Series, numeric: bool, cats: list[str], key: str) -> None:
    """Swept values as ticks: log scale when they span decades, categories as labels."""
    scale, kw = x_scale(xs) if numeric else ("linear", {})
    if numeric:
        ax.set_xscale(scale, **kw)
        ticks = sorted(set(xs.astype(float)))
        if len(ticks) <= 12:  # label the swept values themselves
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.margins(x=0.06)
    else:
        long = max(len(c) for c in cats) > 6
        ax.set_xticks(range(len(cats)), cats, rotation=30 if long else 0, ha="right" if long else "center")
        ax.set_xlim(-0.5, len(cats) - 0.5)
    ax.set_xlabel(key + {"log": " (log scale)", "symlog": " (log scale, linear around 0)"}.get(scale, ""))


def _mean_line(ax, x: pd.Series, y: pd.Series, metric: Column, color, label: str, numeric: bool) -> None:
    """The mean of ``y`` at each ``x``, with its 95% t-interval (kept within the metric's physical range) where some
    x has several values; a line through the means only when x is numeric."""
    stats = pd.DataFrame({x_: describe(v, metric.bounds) for x_, v in y.groupby(x)}).T
    seeds = bool((stats["n"] > 1).any())
    mean = stats["mean"].astype(float)
    yerr = [(mean - stats["ci_low"].astype(float)).fillna(0.0), (stats["ci_high"].astype(float) - mean).fillna(0.0)]
    ax.errorbar(stats.index, mean, yerr=yerr if seeds else None, color=color, marker="o", ms=7, capsize=3,
                lw=1.6 if numeric else 0, elinewidth=1.6, zorder=3,
                label=label or (f"ours: each seed, the mean and its {CONFIDENCE:.0%} CI" if seeds else "ours"))


def figure_vs_key(jobs: pd.DataFrame, key: str, swept: list[str], metric: Column, ylabel: str, paper_col: str,
                  title: str) -> Optional[Figure]:
    """Final ``metric`` against the swept ``key``: one point per job (completed filled, running hollow, preempted a
    hollow square, failed, killed or stalled a red x), the mean over completed seeds as a line with its 95%
    t-interval (within the metric's physical range), one series per setting of the other swept keys, and the
    paper's values as stars.
    None when no job has a value."""
    rows = jobs[jobs[key].notna()]
    y = rows[metric.col].astype(float)
    if y.isna().all():
        return None
    numeric = rows[key].map(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)).all()
    cats = list(dict.fromkeys(rows[key].map(fmt)))
    x = rows[key].astype(float) if numeric else rows[key].map(fmt).map(cats.index).astype(float)
    others = [k for k in swept if k != key and not is_seed_key(k)]
    short = short_keys(swept)
    ids = group_ids(rows, others)
    n_series = ids.max() + 1
    colors = matplotlib.colormaps["tab10"]
    fig, ax = _new_axes()
    drawn, paper_drawn = set(), False
    for si in range(n_series):
        color, members = colors(si % 10), rows[ids == si]
        sx = x[ids == si] + (0.0 if numeric or n_series == 1 else (si - (n_series - 1) / 2) * 0.08)
        sy, status = y[ids == si], members["status"]
        done = status.eq(Status.COMPLETED) & sy.notna()
        ax.plot(sx[done], sy[done], "o", color=color, ms=6, alpha=0.55, zorder=3)
        drawn_as = status.map(_drawn_as).where(~status.eq(Status.COMPLETED) & sy.notna())
        for how in drawn_as.dropna().unique():
            ax.plot(sx[drawn_as == how], sy[drawn_as == how], ls="none", **{"mec": color, **UNFINISHED[how][1]})
            drawn.add(how)
        if done.any():
            label = ", ".join(f"{short[k]}={fmt(members[k].iloc[0])}" for k in others)
            _mean_line(ax, sx[done], sy[done], metric, color, label, numeric)
        if paper_col in members:  # the paper's value for each setting of this series
            paper = pd.DataFrame({"x": sx, "y": members[paper_col]}).dropna().drop_duplicates().sort_values("x")
            if len(paper):
                ax.plot(paper["x"], paper["y"], mec="black" if n_series == 1 else color, **PAPER_STYLE)
                paper_drawn = True
    extra = [Line2D([], [], mec="black", label="paper (Gu et al.)", **PAPER_STYLE)] if paper_drawn else []
    extra += [Line2D([], [], ls="none", label=label, **{"mec": "gray", **style})
              for how, (label, style) in UNFINISHED.items() if how in drawn]
    handles = ax.get_legend_handles_labels()[0] + extra
    if handles:
        ax.legend(handles=handles, loc="best", framealpha=0.85)
    _set_x_axis(ax, rows[key], numeric, cats, key)
    ax.set_ylabel(ylabel)
    if metric.bounds == PERCENT and ax.get_ylim()[0] > 0:
        ax.set_ylim(bottom=0)  # a rate in %: show it from 0
    ax.set_title(title)
    return fig


def figure_over_steps(jobs: list[Job], table: pd.DataFrame, swept: list[str], title: str) -> Optional[Figure]:
    """One line per job of Sink_1 against the training step; legend = swept values and the status of jobs that are
    not completed; failed, killed and stalled jobs dashed with a red x at their last point. None when no job logged
    Sink_1."""
    src = SINK1_METRIC.src
    lines = [(j, r) for j, r in zip(jobs, table.to_dict("records")) if j.metrics.series.get(src)]
    if not lines:
        return None
    short = short_keys(swept)
    fig, ax = _new_axes((8.0, 4.8))
    many = len(lines) > 10
    cmap = matplotlib.colormaps["viridis" if many else "tab10"]
    for i, (job, row) in enumerate(lines):
        steps, vals = zip(*job.metrics.series[src])
        label = ", ".join(f"{short[k]}={fmt(row[k])}" for k in swept) or f"job {job.name}"
        if row["status"] is not Status.COMPLETED:
            label += f" ({row['status']})"
        failed = row["status"].failed
        ax.plot(steps, vals, ls="--" if failed else "-", color=cmap(i / (len(lines) - 1)) if many else cmap(i % 10),
                lw=1.6, marker="." if len(steps) < 30 else None, label=label)
        if failed:
            ax.plot([steps[-1]], [vals[-1]], "x", color="tab:red", ms=10, mew=2.2, zorder=4)
    ax.set_xlabel("training step")
    ax.set_ylabel("Sink$_1$ (%)")
    ax.set_title(title)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 if len(lines) <= 16 else 2, framealpha=0.85)
    return fig


def figure_claims(claims: list[dict], title: str) -> Optional[Figure]:
    """One panel per claim with pairs: each pair's difference (claim minus baseline) a point, their mean with its
    95% t-interval, 0 as a line, the claimed direction and the verdict in the panel's title. None without pairs."""
    shown = [c for c in claims if c["pair_values"]]
    if not shown:
        return None
    fig = Figure(figsize=(7.0, 1.0 + 1.25 * len(shown)), dpi=150, layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for ax, c in zip(axes, shown):
        d = [p["diff"] for p in c["pair_values"]]
        ax.plot(d, [0.0] * len(d), "o", color="tab:blue", alpha=0.55, ms=6, label="a pair of seeds")
        if c["diff_ci_low"] is not None and not pd.isna(c["diff_ci_low"]):
            lo, hi = c["diff_mean"] - c["diff_ci_low"], c["diff_ci_high"] - c["diff_mean"]
            ax.errorbar([c["diff_mean"]], [0.35], xerr=[[lo], [hi]], fmt="D", color="black", capsize=4,
                        label=f"mean, {CONFIDENCE:.0%} CI")
        ax.axvline(0.0, color="tab:red", lw=1.0)
        ax.set_ylim(-0.5, 0.85)
        ax.set_yticks([])
        ax.set_title(f"{c['claim']}: {c['metric']} {c['direction']} ({c['verdict']})", fontsize=9, loc="left")
    axes[0].legend(loc="upper right", fontsize=7, framealpha=0.85)
    axes[-1].set_xlabel("paired difference (the claim's setting minus its baseline)")
    fig.suptitle(title, fontsize=11)
    return fig


def safe_name(key: str) -> str:
    """A swept key as part of a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") or "value"


def figures(sweep: Sweep, table: pd.DataFrame, claims: Sequence[dict] = ()) -> dict[str, Figure]:
    """The plots of a sweep by file name: ``<metric>_vs_<key>.png`` for each non-seed swept key,
    ``sink1_over_steps.png`` and ``claims.png`` (the claims' paired differences); those without data are left
    out."""
    name = experiment_info(sweep.cfg)["name"] or sweep.dir.name
    out: dict[str, Optional[Figure]] = {}
    with matplotlib.rc_context(RC):
        for key in (k for k in sweep.swept if not is_seed_key(k)):
            for metric, ylabel, paper_col, what in VS_KEY:
                out[f"{metric.col}_vs_{safe_name(key)}.png"] = figure_vs_key(
                    table, key, sweep.swept, metric, ylabel, paper_col, f"{name}: final {what} vs {key}")
        out["sink1_over_steps.png"] = figure_over_steps(sweep.jobs, table, sweep.swept,
                                                        f"{name}: Sink$_1$ during training")
        out["claims.png"] = figure_claims(list(claims), f"{name}: the claims, paired by seed")
    return {f: fig for f, fig in out.items() if fig is not None}


def make_plots(out_dir: Path, sweep: Sweep, table: pd.DataFrame, claims: Sequence[dict] = ()) -> list[Path]:
    """Write the plots of ``figures`` as PNGs into ``out_dir``."""
    return [atomic_write(out_dir / f, lambda fh, fig=fig: fig.savefig(fh, format="png"))
            for f, fig in figures(sweep, table, claims).items()]
