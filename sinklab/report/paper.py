"""The paper's numbers beside ours: reading paper_tables.yaml and finding the row of each job.

An experiment preset names its table (``experiment.paper_table``) and how to match its rows
(``experiment.paper_match``: {table field: config key}).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

import yaml
from omegaconf import OmegaConf

from sinklab.errors import UserError
from sinklab.keys import NON_NEGATIVE, PERCENT
from sinklab.report.jobs import as_number, select

PAPER_TABLES = Path(__file__).resolve().parents[1] / "reference" / "paper_tables.yaml"
PAPER_CITE = "Gu et al., ICLR 2025 (60M LLaMA-style model, 20k steps of ~1M tokens)"
# numeric fields of a row and their physical range; ``sink`` is a list of Sink_1, Sink_2, ...
PAPER_FIELDS = {"sink1": PERCENT, "sink2": PERCENT, "sink3": PERCENT, "sink4": PERCENT, "sink1_star": PERCENT,
                "loss": NON_NEGATIVE}
PAPER_COLUMNS = [f"paper_{f}" for f in PAPER_FIELDS] + ["paper_note"]  # in report.csv, in this order
PAPER_LABELS = {"paper_sink1": "paper Sink_1 (%)", "paper_sink2": "paper Sink_2 (%)",
                "paper_sink3": "paper Sink_3 (%)", "paper_sink4": "paper Sink_4 (%)",
                "paper_sink1_star": "paper Sink*_1 (%)", "paper_loss": "paper loss", "paper_note": "paper note"}


def load_paper_tables(path: Optional[Path] = None) -> dict:
    """paper_tables.yaml (default: the packaged one): {table: a row, a list of rows, or {figure_only: text}}.
    A file that is missing, not YAML, or has a number outside its physical range is a UserError."""
    path = Path(path or PAPER_TABLES)
    try:
        tables = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise UserError(f"--paper-tables {path} cannot be read ({e.strerror}); expected a paper_tables.yaml") from e
    except yaml.YAMLError as e:
        raise UserError(f"--paper-tables {path} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(tables, dict):
        raise UserError(f"--paper-tables {path} holds a {type(tables).__name__}; expected a mapping of table names "
                        "to rows")
    for name, table in tables.items():
        for row in table if isinstance(table, list) else [table]:
            _check_row(row, f"--paper-tables {path}: table {name}")
    return tables


def _check_row(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row is a {type(row).__name__}; expected a mapping of fields to values")
    sinks = row.get("sink", [])
    numbers = [(f"sink[{k}]", v, PERCENT) for k, v in enumerate(sinks if isinstance(sinks, list) else [sinks])]
    numbers += [(f, row[f], PAPER_FIELDS[f]) for f in PAPER_FIELDS if f in row]
    for name, v, (lo, hi) in numbers:
        x = as_number(v)
        if x is None or not lo <= x <= hi or math.isinf(x):
            raise UserError(f"{where}: {name}={v!r} is not allowed; allowed: a number in [{lo:g}, {hi:g}]")


def values_match(paper: Any, ours: Any, rel_tol: float = 1e-3) -> bool:
    """Equality of a paper-table field and a config value: numbers within a relative tolerance (0.25M == 250000,
    4e-4 == 0.0004), booleans as booleans, lists element-wise, strings case-insensitively."""
    paper, ours = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (paper, ours))
    if paper is None or ours is None:
        return False
    if isinstance(paper, (list, tuple)) or isinstance(ours, (list, tuple)):
        if not (isinstance(paper, (list, tuple)) and isinstance(ours, (list, tuple))) or len(paper) != len(ours):
            return False
        return all(values_match(a, b, rel_tol) for a, b in zip(paper, ours))
    if isinstance(paper, bool) or isinstance(ours, bool):
        norm = {"true": True, "false": False}
        a = paper if isinstance(paper, bool) else norm.get(str(paper).strip().lower())
        b = ours if isinstance(ours, bool) else norm.get(str(ours).strip().lower())
        return a is not None and a == b
    a, b = as_number(paper), as_number(ours)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)
    return str(paper).strip().lower() == str(ours).strip().lower()


def match_paper_row(table: Any, match: dict[str, str], value_of: Callable[[str], Any]) -> Optional[dict]:
    """The paper row for one job. ``table`` is a paper_tables.yaml entry: a single row (dict) applies to every
    job; a list is matched on ``match`` ({table field: config key}), ``value_of(key)`` giving the job's value. A
    row field the row lacks is a wildcard; among matching rows the one that matched most fields wins."""
    if isinstance(table, dict):
        return None if "figure_only" in table else table
    if not isinstance(table, list) or not match:
        return None
    best, best_n = None, 0
    for row in table:
        if not isinstance(row, dict):
            continue
        fields = [f for f in match if f in row]
        if fields and all(values_match(row[f], value_of(match[f])) for f in fields) and len(fields) > best_n:
            best, best_n = row, len(fields)
    return best


def paper_values(row: Optional[dict]) -> dict[str, Any]:
    """paper_sink1.., paper_sink1_star, paper_loss, paper_note from a table row."""
    if row is None:
        return {}
    sinks = row.get("sink") if isinstance(row.get("sink"), list) else []
    out: dict[str, Any] = {f"paper_sink{k}": as_number(v) for k, v in enumerate(sinks, start=1)}
    out.update({f"paper_{f}": as_number(row[f]) for f in PAPER_FIELDS if as_number(row.get(f)) is not None})
    if row.get("failed"):
        out["paper_note"] = "training failed in the paper"
    return out


def experiment_info(cfg: Any) -> dict[str, Any]:
    """The experiment's name, its paper table, how its rows are matched, the published source a preset without
    a table follows (``experiment.reference``) and the logged metrics it reports besides the sink and the losses
    (``experiment.report_metrics``), from a (job or sweep) config."""
    match = select(cfg, "experiment.paper_match")
    extra = select(cfg, "experiment.report_metrics")
    return {"name": select(cfg, "experiment.name"), "paper_table": select(cfg, "experiment.paper_table"),
            "paper_match": match if isinstance(match, dict) else {}, "reference": select(cfg, "experiment.reference"),
            "report_metrics": [str(x) for x in extra] if isinstance(extra, (list, tuple)) else []}
