"""Seed statistics of a sweep: per setting n, mean, std, median, min-max and a 95% confidence interval of the mean,
and each setting's difference from a baseline setting, paired by seed.

The interval is Student's t-interval of the mean (``scipy.stats.ttest_1samp(...).confidence_interval``): with the
5 seeds of a typical sweep a bootstrap has too few distinct resamples to be trusted, the t-interval assumes roughly
normal seed-to-seed noise and says so. A "setting" is a job's values of the swept keys other than the seed
(``jobs.is_seed_key``); two jobs are paired when they have the same seed and the same values of the keys that the
comparison does not change.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import pandas as pd

from sinklab.config.claims import settings_text
from sinklab.report.columns import Column
from sinklab.report.jobs import is_seed_key
from sinklab.report.paper import values_match
from sinklab.runs.status import Status
from sinklab.stats import mean_ci

STATS = ("n", "mean", "std", "median", "min", "max", "ci_low", "ci_high")  # per metric, in report_aggregate.csv


def describe(values: Sequence[float], bounds: tuple[float, float] = (-math.inf, math.inf)) -> dict[str, float]:
    """n, mean, std (sample), median, min, max and the t-interval of the mean, the interval kept within the
    physical ``bounds`` of the values (a mean cannot leave them); NaN where undefined."""
    x = pd.Series(values, dtype=float).dropna()
    lo, hi = mean_ci(x)
    return {"n": len(x), "mean": x.mean(), "std": x.std(), "median": x.median(), "min": x.min(), "max": x.max(),
            "ci_low": max(lo, bounds[0]) if not math.isnan(lo) else lo,
            "ci_high": min(hi, bounds[1]) if not math.isnan(hi) else hi}


def difference_bounds(bounds: tuple[float, float]) -> tuple[float, float]:
    """The range of a difference of two values within ``bounds``."""
    span = bounds[1] - bounds[0]
    return -span, span


# --------------------------------------------------------------------------------------------------- pairing
def matches(values: pd.DataFrame, setting: dict) -> pd.Series:
    """Rows of ``values`` (one column per key) whose value of every key of ``setting`` matches it
    (``paper.values_match``: numbers within a tolerance, strings case-insensitively); False for a key not a column."""
    ok = pd.Series(True, index=values.index)
    for key, want in setting.items():
        if key not in values:
            return pd.Series(False, index=values.index)
        ok &= values[key].map(lambda v, w=want: values_match(w, v))
    return ok


def _hashable(v: Any) -> Any:
    return repr(v) if isinstance(v, (list, dict)) else v


def pairs(values: pd.DataFrame, quantity: pd.Series, treated: dict, partner: dict, keep: Sequence[str]) -> pd.DataFrame:
    """The pairs of jobs for a comparison: a job of ``treated`` with the job of ``partner`` that has the same values
    of the ``keep`` columns (the seed and every swept key the comparison does not change). ``quantity``: each job's
    value, NaN where it has none (not completed, not logged); jobs without one are left out, and the first job of a
    duplicated (setting, seed) counts. Returns one row per pair: ``keep`` columns, ``value``, ``base``, ``job``,
    ``base_job``, in the order of the treated jobs."""
    have = quantity.notna()
    keys = values[list(keep)].map(_hashable)
    frame = keys.assign(value=quantity, job=values.index)

    def side(setting: dict) -> pd.DataFrame:
        chosen = frame[matches(values, setting) & have]
        return chosen.drop_duplicates(subset=list(keep)) if keep else chosen.head(1)

    base = side(partner).rename(columns={"value": "base", "job": "base_job"})
    return side(treated).merge(base, on=list(keep)) if keep else side(treated).merge(base, how="cross")


def completed_values(jobs: pd.DataFrame, col: str) -> pd.Series:
    """A metric column as floats, NaN for jobs that are not completed."""
    return jobs[col].astype(float).where(jobs["status"].eq(Status.COMPLETED))


def setting_differences(jobs: pd.DataFrame, swept: list[str], metrics: list[Column],
                        baseline: dict) -> Optional[pd.DataFrame]:
    """For every setting that is not a baseline one, and every metric: the difference from the baseline setting (the
    setting with the baseline's values of its keys), paired by seed: n pairs, mean, its t-interval (within the
    difference's physical range), and how many pairs are higher and lower. None without a baseline or when no
    setting has a pair."""
    seeds = [k for k in swept if k in jobs and is_seed_key(k)]
    keys = [k for k in swept if k in jobs and not is_seed_key(k)]
    if not baseline or not keys:
        return None
    values = jobs[list(dict.fromkeys(keys + seeds))]
    settings = values[keys].map(_hashable).drop_duplicates()
    rows = []
    for idx in settings.index:
        setting = {k: values.at[idx, k] for k in keys}
        if all(k in setting and values_match(v, setting[k]) for k, v in baseline.items()):
            continue  # a baseline setting
        partner = {**setting, **baseline}
        for m in metrics:
            p = pairs(values, completed_values(jobs, m.col), setting, partner, seeds + [k for k in keys
                                                                                        if k not in partner])
            if p.empty:
                continue
            d = p["value"] - p["base"]
            s = describe(d, difference_bounds(m.bounds))
            rows.append({**setting, "baseline": settings_text(baseline), "metric": m.col, "pairs": s["n"],
                         "diff_mean": s["mean"], "diff_ci_low": s["ci_low"], "diff_ci_high": s["ci_high"],
                         "higher": int((d > 0).sum()), "lower": int((d < 0).sum())})
    return pd.DataFrame(rows) if rows else None


