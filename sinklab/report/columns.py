"""The report's metric columns: which logged metrics it shows, their labels, physical ranges and number formats."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from sinklab.evals import EVALUATIONS
from sinklab.keys import ANY, SINK1, SINK_PREFIX, TRAIN_LOSS, VAL_BPB, VAL_LOSS
from sinklab.metrics.base import bounds as metric_bounds
from sinklab.metrics.sink import SLOT_KEY


def bounds(name: str) -> tuple[float, float]:
    """Physical range of a logged value (the metric that logs it declares it: `sinklab.metrics.base.bounds`) or of an evaluation's column (quant/w4a4_gap: the
    bounds its evaluation declares, `sinklab.evals.registry`); any number for a name no family covers."""
    return EVALUATIONS.bounds(name) or metric_bounds(name) or ANY


@dataclass(frozen=True)
class Column:
    """A final value per job: ``col`` in report.csv, ``src`` in metrics.csv / status.json, ``label`` in report.md;
    ``always`` ones are shown even before any job logged them."""

    col: str
    src: str
    label: str
    always: bool = False

    @property
    def bounds(self) -> tuple[float, float]:
        return bounds(self.src)


def _sink(k: int, star: str = "") -> Column:
    return Column(f"sink{k}{star}", f"{SINK_PREFIX}sink{k}{star}", f"Sink{'*' if star else ''}_{k} (%)")


SINK1_METRIC = Column("sink1", SINK1, "Sink_1 (%)", always=True)
VAL_LOSS_METRIC = Column("val_loss", VAL_LOSS, "val loss (nats)", always=True)
SINK_METRICS = (SINK1_METRIC, *(_sink(k) for k in (2, 3, 4)), _sink(1, "_star"))
# val bits per byte: val/loss over ln 2 x the validation text's bytes per token (sinklab.model.lm_loss), comparable
# across tokenizers; shown where a job logged it (runs before it was logged have val/loss only)
LOSS_METRICS = (VAL_LOSS_METRIC, Column("val_bpb", VAL_BPB, "val bits per byte"),
                Column("train_loss", TRAIN_LOSS, "train loss (nats)"))


def metric_columns(logged: Iterable[str], extra: Iterable[str] = ()) -> list[Column]:
    """The metrics to report, given every metric name some job logged: the Sink_k, then slot scores
    (sink/slot, sink/slot_<name>), then the losses, then the `extra` logged names asked for (`sinklab report
    --metrics`, a preset's experiment.report_metrics), each under its own name."""
    logged = set(logged)
    slots = [m for m in map(SLOT_KEY.match, sorted(logged)) if m]
    chosen = [m for m in SINK_METRICS if m.always or m.src in logged] + \
        [Column(m.group(1), m.group(0), f"{m.group(1).replace('_', ' ')} score (%)") for m in slots] + \
        [m for m in LOSS_METRICS if m.always or m.src in logged]
    shown = {m.src for m in chosen}
    return chosen + [Column(name, name, name, always=True) for name in dict.fromkeys(extra) if name not in shown]


def fmt(v: Any, col: str = "") -> str:
    """A value as shown in report.md and on plots: rates with 2 decimals, losses and bits per byte with 3, the
    paper's numbers at the paper's precision, other numbers in %g; missing values (None, NaN) empty."""
    if v is None or isinstance(v, float) and math.isnan(v):
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if col.startswith("paper_"):
            return f"{v:.2f}"
        if col.endswith(("loss", "loss_mean", "loss_std", "bpb", "bpb_mean", "bpb_std")):
            return f"{v:.3f}"
        if col.startswith(("sink", "slot")):
            return f"{v:.2f}"
        return f"{v:g}"
    return str(v)


def short_keys(keys: list[str]) -> dict[str, str]:
    """Last component of each dotted key where that is unambiguous (optim.weight_decay -> weight_decay)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}
