"""The one verdict rule of sinklab, applied to the claims a preset states (`sinklab.config.claims`).

The rule (experiments/README.md, "Claims and the verdict rule"), on the paired differences d_i (the claim's jobs minus
their baseline partners, one per seed) with the claimed sign s (+1 higher, -1 lower):

- **not testable**: fewer than MIN_PAIRS pairs, the metric logged by no job, the setting or its baseline not run,
  or the claim's precondition (``requires``) fails on the jobs it names (the baseline's by default);
- **reproduced**: s * d_i > 0 in at least REPRODUCED_SHARE of the pairs (4 of 5) AND the CONFIDENCE t-interval of
  the mean of d_i lies wholly on the claimed side of 0;
- **not reproduced**: s * d_i > 0 in at most NOT_REPRODUCED_SHARE of the pairs, or the interval lies wholly on the
  wrong side of 0;
- **partly**: otherwise.

A difference of exactly 0 does not count for the claimed sign.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from sinklab.config.claims import Claim, settings_text
from sinklab.report.columns import bounds
from sinklab.report.jobs import Sweep, is_seed_key
from sinklab.report.stats import describe, difference_bounds, matches, pairs
from sinklab.stats import CONFIDENCE
from sinklab.runs.status import Status

MIN_PAIRS = 3  # fewer paired seeds: not testable
REPRODUCED_SHARE = 0.8  # the claimed sign in at least this share of the pairs (4 of 5), and the interval excludes 0
NOT_REPRODUCED_SHARE = 0.5  # the claimed sign in at most this share of the pairs (or the interval on the wrong side)
REPRODUCED, PARTLY, NOT_REPRODUCED, NOT_TESTABLE = "reproduced", "partly", "not reproduced", "not testable"
RULE = (f"reproduced: the claimed sign in >= {REPRODUCED_SHARE:.0%} of the paired seeds and the {CONFIDENCE:.0%} "
        f"t-interval of the mean paired difference excludes 0 on the claimed side; not reproduced: the claimed sign "
        f"in <= {NOT_REPRODUCED_SHARE:.0%} of the pairs, or the interval excludes 0 on the wrong side; partly: "
        f"otherwise; not testable: fewer than {MIN_PAIRS} pairs, the metric or the setting missing, or a failed "
        "precondition")
COLUMNS = ["claim", "text", "setting", "baseline", "metric", "direction", "pairs", "diff_mean", "diff_ci_low",
           "diff_ci_high", "claimed_sign", "verdict", "reason"]


def verdict(diffs: Sequence[float], sign: int, ci: tuple[float, float]) -> tuple[str, str]:
    """(verdict, reason) of the rule for paired differences ``diffs``, claimed sign ``sign`` (+1 / -1) and the
    interval ``ci`` of their mean."""
    d = np.asarray(diffs, dtype=float)
    if len(d) < MIN_PAIRS:
        return NOT_TESTABLE, f"{len(d)} pair(s) of seeds; at least {MIN_PAIRS} needed"
    share = float(np.mean(sign * d > 0))
    lo, hi = ci
    claimed_side = lo > 0 if sign > 0 else hi < 0
    wrong_side = hi < 0 if sign > 0 else lo > 0
    if share >= REPRODUCED_SHARE and claimed_side:
        return REPRODUCED, ""
    if share <= NOT_REPRODUCED_SHARE or wrong_side:
        return NOT_REPRODUCED, "the interval excludes 0 on the wrong side" if wrong_side else \
            f"the claimed sign in {share:.0%} of the pairs"
    return PARTLY, "the interval includes 0" if not claimed_side else f"the claimed sign in {share:.0%} of the pairs"


def _logged(sweep: Sweep, name: str) -> pd.Series:
    """Each job's final value of a logged name (or an evaluation's column), NaN where it is not completed or has
    none."""
    return pd.Series([j.final.get(name, math.nan) if j.status is Status.COMPLETED else math.nan for j in sweep.jobs],
                     dtype=float)


def _key_values(sweep: Sweep, keys: Sequence[str]) -> pd.DataFrame:
    return pd.DataFrame({k: [j.value(k) for j in sweep.jobs] for k in keys}, dtype=object)


def _quantity_bounds(claim: Claim) -> tuple[float, float]:
    """The range of a paired difference of the claim's quantity (twice as wide for metric - against_metric)."""
    lo, hi = difference_bounds(bounds(claim.metric))
    factor = 1 if claim.against_metric is None or claim.within else 2
    return factor * lo, factor * hi


def evaluate(sweep: Sweep, claim: Claim) -> dict[str, Any]:
    """The claim's row of the verdict table, plus its pairs (``pairs``: [{seed..., value, base, diff}]) for the JSON
    and the plot."""
    logged = {name for j in sweep.jobs for name in j.final}
    row: dict[str, Any] = {"claim": claim.id, "text": claim.text, "setting": settings_text(claim.treated),
                           "baseline": "the same jobs" if claim.within else settings_text(claim.partner),
                           "metric": claim.quantity, "direction": claim.direction, "pairs": 0,
                           "diff_mean": None, "diff_ci_low": None, "diff_ci_high": None, "claimed_sign": "",
                           "verdict": NOT_TESTABLE, "reason": "", "pair_values": []}
    missing = [m for m in (claim.metric, claim.against_metric) if m and m not in logged]
    seeds = [k for k in sweep.swept if is_seed_key(k)]
    keep = seeds + [k for k in sweep.swept if not is_seed_key(k) and k not in claim.treated]
    values = _key_values(sweep, list(dict.fromkeys([*claim.treated, *claim.partner, *keep])))
    unrun = [s for s in (claim.treated, claim.partner) if not matches(values, s).any()]
    if missing or unrun:
        row["reason"] = f"metric {missing[0]} logged by no job" if missing else \
            f"setting not run: {settings_text(unrun[0])}"
        return row
    quantity = _logged(sweep, claim.metric)
    if claim.against_metric:
        quantity = quantity - _logged(sweep, claim.against_metric)
    p = pairs(values, quantity, claim.treated, claim.partner, keep)
    d = p["value"] if claim.within else p["value"] - p["base"]
    s = describe(d, _quantity_bounds(claim))
    n_claimed = int((claim.sign * d > 0).sum())
    row.update(pairs=s["n"], diff_mean=s["mean"], diff_ci_low=s["ci_low"], diff_ci_high=s["ci_high"],
               claimed_sign=f"{n_claimed} of {s['n']}",
               pair_values=[{**{k: r[k] for k in seeds}, "job": sweep.jobs[r["job"]].name,
                             "base_job": sweep.jobs[r["base_job"]].name, "diff": float(diff)}
                            for r, diff in zip(p.to_dict("records"), d)])
    row["verdict"], row["reason"] = verdict(d, claim.sign, (s["ci_low"], s["ci_high"]))
    failed = _precondition(sweep, claim, p) if row["verdict"] != NOT_TESTABLE else None
    if failed:
        row["verdict"], row["reason"] = NOT_TESTABLE, failed
    return row


def _precondition(sweep: Sweep, claim: Claim, p: pd.DataFrame) -> Optional[str]:
    """Why the claim's precondition fails on the jobs it names (the pairs' baseline jobs, their setting jobs, or
    each); None when it holds (or there is none)."""
    req = claim.requires
    if req is None:
        return None
    logged = _logged(sweep, req.metric)
    for side in req.sides:
        mean = logged.iloc[p["base_job" if side == "baseline" else "job"].to_numpy()].mean()
        if math.isnan(mean):
            return f"precondition: {req.metric} logged by no {side} job"
        if not req.holds(mean):
            return f"precondition fails: {side} mean of {req.metric} {req.bounds_text} (it is {mean:.4g})"
    return None


def claims_table(sweep: Sweep, claims: Sequence[Claim]) -> tuple[Optional[pd.DataFrame], list[dict]]:
    """The verdict table (COLUMNS, one row per claim; None without claims) and every claim's row with its pairs."""
    rows = [evaluate(sweep, c) for c in claims]
    if not rows:
        return None, []
    return pd.DataFrame([{k: r[k] for k in COLUMNS} for r in rows], columns=COLUMNS, dtype=object), rows
