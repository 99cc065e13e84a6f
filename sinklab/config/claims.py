"""The claims an experiment preset states, checked once before any work (`sinklab report` tests them).

A preset names its baseline setting and its claims (experiments/README.md, "Claims and the verdict rule"):

    experiment:
      baseline: {model/gate: none}                 # swept key -> value: what settings are compared with
      claims:
        - {id: g1_removes_sink, text: "G1 removes the sink", setting: {model/gate: elementwise},
           metric: sink/sink1, direction: lower, requires: {metric: sink/sink1, above: 10}}
        - {id: x0_penalty, setting: {experiment.variant: softmax}, metric: streaming/x0_y60_ppl,
           against_metric: streaming/x4_y60_ppl, direction: higher}

A claim's jobs are those of ``{**baseline, **setting}``; each is paired with the job of ``{**setting, **baseline}``
of the same seed (and the same value of every other swept key). With ``against_metric`` the compared quantity of a
job is ``metric - against_metric``; a setting that equals the baseline then tests that quantity itself (two metrics
of the same jobs). ``baseline`` in a claim replaces the preset's for that claim; ``requires`` is a precondition on
the baseline jobs' mean (``above`` and / or ``below``), e.g. "there must be a sink to remove", or with ``of: setting``
/ ``of: both`` on the setting's jobs / on each side's, e.g. "both must retrieve before eviction can cost them". A
metric may be any logged name (sink/sink1) or a column of a registered evaluation's sweep CSV (quant/w4a4_gap:
``sinklab eval quant --sweep``), which must be one that evaluation writes (the columns it declares,
`sinklab.evals.registry`): the evaluations sit above the config, so the callers that check a preset for a run or a
report (sinklab-train, `sinklab report`) hand their registry, `sinklab.evals.EVALUATIONS`, to `parse_claims`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sinklab.errors import UserError, word

from .messages import unknown_key_message
from .schema import not_allowed

DIRECTIONS = ("lower", "higher")
CLAIM_KEYS = ("id", "text", "setting", "baseline", "metric", "against_metric", "direction", "requires")
REQUIRED_KEYS = ("id", "setting", "metric", "direction")
REQUIRES_KEYS = ("metric", "above", "below", "of")
REQUIRES_OF = ("baseline", "setting", "both")  # whose jobs' mean a precondition is checked on


class ColumnOwners(Protocol):
    """What claims ask of the evaluations' registry (`sinklab.evals.EVALUATIONS`): the evaluation that writes a
    report column NAME/<column> and the column's own name, or None for a column of no evaluation (sink/sink1)."""

    def owner(self, column: str) -> Optional[tuple[Any, str]]: ...


@dataclass(frozen=True)
class Requirement:
    """The mean of ``metric`` over the jobs ``of`` the claim (its baseline's, its setting's, or each side's) must be
    above ``above`` and / or below ``below``."""

    metric: str
    above: Optional[float] = None
    below: Optional[float] = None
    of: str = "baseline"  # REQUIRES_OF

    def holds(self, mean: float) -> bool:
        return (self.above is None or mean > self.above) and (self.below is None or mean < self.below)

    @property
    def sides(self) -> tuple[str, ...]:
        """The jobs whose mean is checked: ("baseline",), ("setting",) or both."""
        return ("baseline", "setting") if self.of == "both" else (self.of,)

    @property
    def bounds_text(self) -> str:
        """'above 10', 'below 0.5' or 'above 1 and below 2'."""
        bounds = [f"above {self.above:g}" if self.above is not None else "",
                  f"below {self.below:g}" if self.below is not None else ""]
        return " and ".join(b for b in bounds if b)


@dataclass(frozen=True)
class Claim:
    """One claim: the ``setting`` moves ``metric`` (minus ``against_metric``) in ``direction`` from ``baseline``."""

    id: str
    setting: dict
    baseline: dict
    metric: str
    direction: str
    text: str = ""
    against_metric: Optional[str] = None
    requires: Optional[Requirement] = None
    treated: dict = field(init=False)  # the setting of the claim's jobs
    partner: dict = field(init=False)  # the setting of the jobs they are paired with

    def __post_init__(self) -> None:
        object.__setattr__(self, "treated", {**self.baseline, **self.setting})
        object.__setattr__(self, "partner", {**self.setting, **self.baseline})

    @property
    def within(self) -> bool:
        """The setting is the baseline: metric and against_metric of the same jobs are compared."""
        return self.treated == self.partner

    @property
    def sign(self) -> int:
        """+1 when the claimed difference is positive (higher), -1 when negative (lower)."""
        return 1 if self.direction == "higher" else -1

    @property
    def quantity(self) -> str:
        return self.metric + (f" - {self.against_metric}" if self.against_metric else "")


def settings_text(setting: dict) -> str:
    """{model/gate: none, seed: 0} -> 'model/gate=none, seed=0'."""
    return ", ".join(f"{k}={word(v)}" for k, v in setting.items())


def _setting(value: Any, key: str) -> dict:
    if not isinstance(value, dict) or not value or not all(isinstance(k, str) and k for k in value):
        raise UserError(not_allowed(key, value, "a mapping of swept keys to values, e.g. {model/gate: none}"))
    bad = next((k for k, v in value.items() if isinstance(v, (dict, list))), None)
    if bad is not None:
        raise UserError(not_allowed(f"{key}.{bad}", value[bad], "one value (a number, a string, true, false)"))
    return dict(value)


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(not_allowed(key, value, "a non-empty string"))
    return value


def _metric(value: Any, key: str, evaluations: Optional[ColumnOwners]) -> str:
    """A claim's metric: a logged name, or ``NAME/<column>`` of a registered evaluation that writes that column."""
    name = _text(value, key)
    owner = evaluations.owner(name) if evaluations is not None else None
    if owner is not None and owner[0].column_bounds(owner[1]) is None:
        evaluation = owner[0]
        raise UserError(not_allowed(key, name, f"a column of the {evaluation.name} evaluation: {evaluation.name}/"
                                               "<a name matching " + " or ".join(p for p, _ in evaluation.bounds) + ">"))
    return name


def _number(value: Any, key: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(not_allowed(key, value, "a finite number or null"))
    return float(value)


def _requirement(value: Any, key: str, metric: str, evaluations: Optional[ColumnOwners]) -> Optional[Requirement]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserError(not_allowed(key, value, "a mapping {metric: NAME, above: X, below: Y, of: WHOSE} (metric: the "
                                                "claim's by default; at least one of above, below; of: baseline by "
                                                "default, setting or both)"))
    for k in value:
        if k not in REQUIRES_KEYS:
            raise UserError(unknown_key_message(f"{key}.{k}", REQUIRES_KEYS))
    of = value.get("of", "baseline")
    if of not in REQUIRES_OF:
        raise UserError(not_allowed(f"{key}.of", of, ", ".join(REQUIRES_OF)))
    req = Requirement(_metric(value.get("metric", metric), f"{key}.metric", evaluations),
                      _number(value.get("above"), f"{key}.above"), _number(value.get("below"), f"{key}.below"), of)
    if req.above is None and req.below is None:
        raise UserError(f"{key} has neither above nor below; allowed: a number for at least one of them")
    return req


def parse_claims(experiment: Any, evaluations: Optional[ColumnOwners] = None) -> tuple[dict, list[Claim]]:
    """(the preset's baseline setting, its claims) from the plain ``experiment`` node (a dict; None or no claims:
    ``({}, [])``). Anything malformed is one UserError naming the key and what is allowed; a metric NAME/<column> of
    one of `evaluations` (`sinklab.evals.EVALUATIONS`) must be a column that evaluation writes (without
    `evaluations`, any name is a logged metric's)."""
    experiment = experiment if isinstance(experiment, dict) else {}
    baseline = experiment.get("baseline")
    baseline = _setting(baseline, "experiment.baseline") if baseline is not None else {}
    claims = experiment.get("claims")
    if claims is None:
        return baseline, []
    if not isinstance(claims, list):
        raise UserError(not_allowed("experiment.claims", claims, "a list of claims, each {id, setting, metric, "
                                                               "direction, ...} (experiments/README.md)"))
    out: list[Claim] = []
    for i, raw in enumerate(claims):
        where = f"experiment.claims[{i}]"
        if not isinstance(raw, dict):
            raise UserError(not_allowed(where, raw, "a mapping with keys " + ", ".join(CLAIM_KEYS)))
        for k in raw:
            if k not in CLAIM_KEYS:
                raise UserError(unknown_key_message(f"{where}.{k}", CLAIM_KEYS))
        missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
        if missing:
            raise UserError(f"{where}.{missing[0]} is missing; required: {', '.join(REQUIRED_KEYS)}")
        cid = _text(raw["id"], f"{where}.id")
        where = f"experiment.claims[{i}] ({cid})"
        if cid in {c.id for c in out}:
            raise UserError(f"{where}: the id {cid!r} is taken by an earlier claim; allowed: a new id")
        if raw["direction"] not in DIRECTIONS:
            raise UserError(not_allowed(f"{where}.direction", raw["direction"], "one of " + ", ".join(DIRECTIONS)))
        own = raw.get("baseline")
        base = _setting(own, f"{where}.baseline") if own is not None else baseline
        if not base:
            raise UserError(f"{where} has no baseline; allowed: experiment.baseline or the claim's own baseline, a "
                            "mapping of swept keys to values")
        against = raw.get("against_metric")
        claim = Claim(cid, _setting(raw["setting"], f"{where}.setting"), base,
                      _metric(raw["metric"], f"{where}.metric", evaluations), raw["direction"],
                      str(raw.get("text") or ""),
                      _metric(against, f"{where}.against_metric", evaluations) if against is not None else None,
                      _requirement(raw.get("requires"), f"{where}.requires", raw["metric"], evaluations))
        if claim.within and claim.against_metric is None:
            raise UserError(f"{where}.setting {{{settings_text(claim.setting)}}} is its baseline "
                            f"{{{settings_text(base)}}}; allowed: a setting that differs from the baseline, or an "
                            "against_metric to compare with on the same jobs")
        if claim.against_metric == claim.metric:
            raise UserError(f"{where}.against_metric={claim.metric} is the claim's metric; allowed: another metric")
        out.append(claim)
    return baseline, out
