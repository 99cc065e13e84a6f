"""Statistics shared by the report (seed intervals) and the evaluations (rank correlations), below both.

`mean_ci` is Student's t-interval of the mean (``scipy.stats.ttest_1samp(...).confidence_interval``); `spearman` is
scipy's rank correlation, clipped to [-1, 1] and None where it is undefined. scipy is imported inside each: `sinklab
--help` and a report without seeds pay nothing for it.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import numpy as np

CONFIDENCE = 0.95  # of every interval in the report


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The t-interval of the mean of ``values`` (NaN dropped): (mean, mean) when they are all equal, (NaN, NaN)
    with fewer than 2."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if len(x) < 2:
        return math.nan, math.nan
    if np.ptp(x) == 0:
        return float(x[0]), float(x[0])
    from scipy import stats  # here: only a sweep with seeds pays for its import

    with warnings.catch_warnings():  # a near-constant sample: scipy warns of precision loss, the interval is fine
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_1samp(x, 0.0).confidence_interval(confidence_level=confidence)
    return float(ci.low), float(ci.high)


def spearman(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation of x and y in [-1, 1]; None under 3 points or where a column is constant."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    rho = float(spearmanr(x, y).statistic)
    return None if rho != rho else min(1.0, max(-1.0, rho))
