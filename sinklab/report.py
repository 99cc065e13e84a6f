"""Sweep report: one table row per job of a Hydra multirun, plots, and the paper's numbers beside ours.

    sinklab report SWEEP_DIR [--out DIR]          # or: python -m sinklab.report SWEEP_DIR [--out DIR]

A sweep dir holds ``multirun.yaml`` and one dir per job (``0/``, ``1/``, ...) with ``.hydra/config.yaml``,
``.hydra/overrides.yaml``, ``metrics.csv`` (Lightning CSVLogger format, sparse rows) and ``status.json``.
Any of these may be missing: the report works on a sweep that is still running or where jobs failed.
Jobs that ``multirun.yaml`` promises but that have no dir yet are listed as ``pending``.

Outputs in DIR (default SWEEP_DIR/report): ``report.md``, ``report.csv``, ``report_aggregate.csv`` (when some
swept setting has several seeds), ``sink1_vs_<key>.png``, ``val_loss_vs_<key>.png``, ``sink1_over_steps.png``.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf

PAPER_TABLES = Path(__file__).resolve().parent / "reference" / "paper_tables.yaml"
PAPER_CITE = "Gu et al., ICLR 2025 (60M LLaMA-style model, 20k steps of ~1M tokens)"
STALE_MINUTES = 10.0
STATUS_ORDER = ("completed", "running", "failed", "stalled", "killed", "unknown", "pending")
# Final metrics reported per job: (column in report.csv, column in metrics.csv, label). sink1 and val_loss are
# always reported; the others only when some job logged them. Slot scores (sink/slot, sink/slot_<name>) go
# between the two groups.
SINK_METRICS = (
    ("sink1", "sink/sink1", "Sink_1 (%)"),
    ("sink2", "sink/sink2", "Sink_2 (%)"),
    ("sink3", "sink/sink3", "Sink_3 (%)"),
    ("sink4", "sink/sink4", "Sink_4 (%)"),
    ("sink1_star", "sink/sink1_star", "Sink*_1 (%)"),
)
LOSS_METRICS = (
    ("val_loss", "val/loss", "val loss (nats)"),
    ("train_loss", "train/loss", "train loss (nats)"),
)
ALWAYS = ("sink1", "val_loss")
SLOT_RE = re.compile(r"^sink/(slot(?:_[A-Za-z0-9_]+)?)$")
PAPER_FIELDS = ("sink1", "sink2", "sink3", "sink4", "sink1_star", "loss")


# ----------------------------------------------------------------------------------------------- reading a job
@dataclass
class Metrics:
    final: dict[str, float] = field(default_factory=dict)  # metrics.csv column -> last non-empty value
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # column -> [(step, value)], by step
    max_step: Optional[int] = None


def _to_float(s: Any) -> Optional[float]:
    if s is None:
        return None
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    s = str(s).strip()
    if not s:
        return None
    try:
        return float(s)
    except ValueError:
        return None


def read_metrics(path: Path) -> Metrics:
    """Parse a CSVLogger metrics.csv. "Final" is the last non-empty cell of a column in file order; a last line
    without its newline (the file was being written or the job was killed mid-write) is ignored."""
    m = Metrics()
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return m
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    per_step: dict[str, dict[int, float]] = {}
    for row in csv.DictReader(text.splitlines()):
        step_f = _to_float(row.get("step"))
        step = int(step_f) if step_f is not None and math.isfinite(step_f) else None
        if step is not None:
            m.max_step = step if m.max_step is None else max(m.max_step, step)
        for col, cell in row.items():
            if col is None or col == "step":  # None: extra cells of a malformed row
                continue
            v = _to_float(cell)
            if v is None:
                continue
            m.final[col] = v
            if step is not None:
                per_step.setdefault(col, {})[step] = v  # a resumed run may log a step twice: keep the later one
    m.series = {c: sorted(d.items()) for c, d in per_step.items()}
    return m


def read_status(job_dir: Path, now: float, stale_s: float) -> tuple[str, str, Optional[int], dict]:
    """(status, error, step, final) from status.json; without it (not started, or killed hard) the status is
    inferred from how recently metrics.csv was written. A status.json that says "running" while nothing in the
    dir changed for ``stale_s`` seconds is reported as "stalled" (killed without a chance to write "failed")."""
    status_path, metrics_path = job_dir / "status.json", job_dir / "metrics.csv"
    data = None
    if status_path.is_file():
        try:
            data = json.loads(status_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None  # half-written: fall through to the inference below
    mtimes = [p.stat().st_mtime for p in (status_path, metrics_path) if p.is_file()]
    fresh = bool(mtimes) and now - max(mtimes) < stale_s
    if isinstance(data, dict) and data.get("status"):
        status = str(data["status"]).strip().lower()
        if status == "running" and not fresh:
            status = "stalled"
        error = " ".join(str(data.get("error") or "").split())
        step = _to_float(data.get("step"))
        final = data.get("final") if isinstance(data.get("final"), dict) else {}
        return status, error, int(step) if step is not None and math.isfinite(step) else None, final
    if metrics_path.is_file():
        return ("running" if fresh else "killed"), "", None, {}
    return "unknown", "", None, {}


def _parse_overrides(lines: Sequence[str]) -> list[tuple[str, Any, str, bool]]:
    """[(key, typed value, value as written, is_sweep)] with Hydra's own override grammar. Deletions (~key) are
    dropped. Falls back to splitting at '=' for a line Hydra cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for line in lines:
        line = str(line)
        try:
            o = parser.parse_override(line)
        except Exception:
            key, _, val = line.partition("=")
            out.append((key.lstrip("+~"), _coerce(val), val, "," in val))
            continue
        if o.is_delete():
            continue
        if o.is_sweep_override():
            out.append((o.key_or_group, None, line.partition("=")[2], True))
        else:
            out.append((o.key_or_group, o.value(), o.get_value_element_as_str(), False))
    return out


def _coerce(s: str) -> Any:
    try:
        return yaml.safe_load(s)
    except yaml.YAMLError:
        return s


def _load_yaml(path: Path) -> Any:
    try:
        return OmegaConf.load(path)
    except Exception:
        return None


def _select(cfg: Any, key: str) -> Any:
    """Value at a dotted key of a config, interpolations resolved where possible; None when absent."""
    if cfg is None:
        return None
    try:
        v = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    except Exception:
        return None
    if isinstance(v, DictConfig) or OmegaConf.is_list(v):
        return OmegaConf.to_container(v, resolve=False)
    return v


@dataclass
class Job:
    name: str
    path: Optional[Path]
    overrides: dict[str, Any]  # key -> typed value (from overrides.yaml, or multirun.yaml for pending jobs)
    override_text: dict[str, str]
    cfg: Any = None  # OmegaConf config of the job, None when .hydra/config.yaml is missing
    status: str = "pending"
    error: str = ""
    steps: Optional[int] = None
    metrics: Metrics = field(default_factory=Metrics)
    final: dict[str, float] = field(default_factory=dict)

    def value(self, key: str) -> Any:
        """The job's setting for a key: the composed config's value, else the override as written."""
        v = _select(self.cfg, key)
        if v is None or isinstance(v, (dict, list)) and key in self.overrides:
            v = self.overrides.get(key, v)
        return v


def _is_job_dir(p: Path) -> bool:
    return p.is_dir() and any((p / n).exists() for n in (".hydra", "metrics.csv", "status.json"))


def _job_sort_key(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _new_job(name: str, path: Optional[Path], override_lines: Sequence[str], cfg: Any = None) -> Job:
    parsed = _parse_overrides(override_lines)
    return Job(name, path, {k: v for k, v, _, _ in parsed}, {k: t for k, _, t, _ in parsed}, cfg)


def load_job(path: Path, now: float, stale_s: float) -> Job:
    hydra_dir = path / ".hydra"
    lines = _load_yaml(hydra_dir / "overrides.yaml") if (hydra_dir / "overrides.yaml").is_file() else None
    cfg = _load_yaml(hydra_dir / "config.yaml") if (hydra_dir / "config.yaml").is_file() else None
    job = _new_job(path.name, path, OmegaConf.to_container(lines) if OmegaConf.is_list(lines) else [], cfg)
    job.status, job.error, status_step, status_final = read_status(path, now, stale_s)
    job.metrics = read_metrics(path / "metrics.csv")
    steps = [s for s in (job.metrics.max_step, status_step) if s is not None]
    job.steps = max(steps) if steps else None
    job.final = dict(job.metrics.final)
    for k, v in status_final.items():  # status.json's final values fill columns metrics.csv lacks
        fv = _to_float(v)
        if fv is not None:
            job.final.setdefault(k, fv)
    return job


# ---------------------------------------------------------------------------------------------- the sweep
@dataclass
class Sweep:
    dir: Path
    jobs: list[Job]
    swept: list[str]  # swept keys, in Hydra's sweep order
    cfg: Any  # sweep-level config (multirun.yaml, else the first job's)


def _multirun_overrides(mr: Any) -> list[str]:
    """The override list BasicSweeper expanded: hydra.sweeper.params first, then the command line."""
    params = _select(mr, "hydra.sweeper.params") or {}
    task = _select(mr, "hydra.overrides.task") or []
    return [f"{k}={v}" for k, v in params.items()] + [str(t) for t in task]


def _expected_jobs(mr: Any, lines: list[str]) -> Optional[list[list[str]]]:
    """Override lists of all jobs of a BasicSweeper sweep, in job-number order; None for other sweepers."""
    target = str(_select(mr, "hydra.sweeper._target_") or "")
    if not lines or not target.endswith("BasicSweeper"):
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = OverridesParser.create().parse_overrides(lines)
        return [list(b) for b in BasicSweeper.split_arguments(overrides, None)[0]]
    except Exception:
        return None


def load_sweep(sweep_dir: Path, now: Optional[float] = None, stale_minutes: float = STALE_MINUTES) -> Sweep:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no such sweep dir: {sweep_dir}")
    now = time.time() if now is None else now
    stale_s = 60.0 * stale_minutes
    mr = _load_yaml(sweep_dir / "multirun.yaml") if (sweep_dir / "multirun.yaml").is_file() else None
    dirs = [p for p in sweep_dir.iterdir() if not p.name.startswith(".") and _is_job_dir(p)]
    if not dirs and mr is None and (sweep_dir / ".hydra").is_dir():
        dirs = [sweep_dir]  # a single (non-multirun) run dir
    jobs = [load_job(p, now, stale_s) for p in sorted(dirs, key=lambda p: _job_sort_key(p.name))]

    swept: list[str] = []
    mr_lines = _multirun_overrides(mr) if mr is not None else []
    for key, _, _, is_sweep in _parse_overrides(mr_lines):
        if is_sweep and key not in swept:
            swept.append(key)
    expected = _expected_jobs(mr, mr_lines)
    if expected:
        have = {j.name for j in jobs}
        for i, lines in enumerate(expected):
            if str(i) not in have:
                jobs.append(_new_job(str(i), None, lines))
        jobs.sort(key=lambda j: _job_sort_key(j.name))
    # keys whose override differs between jobs are swept too (other sweepers, or no multirun.yaml)
    for job in jobs:
        for key in job.override_text:
            if key not in swept and len({j.override_text.get(key) for j in jobs}) > 1:
                swept.append(key)
    if not jobs:
        raise FileNotFoundError(f"no job dirs (with .hydra/, metrics.csv or status.json) in {sweep_dir}")
    cfg = mr if mr is not None else next((j.cfg for j in jobs if j.cfg is not None), None)
    return Sweep(sweep_dir, jobs, swept, cfg)


def is_seed_key(key: str) -> bool:
    return key == "seed" or key.endswith(".seed")


# ------------------------------------------------------------------------------------------- paper numbers
def load_paper_tables(path: Optional[Path] = None) -> dict:
    with open(path or PAPER_TABLES, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def _as_number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    s = str(v).strip().lower()
    try:
        return float(s)
    except ValueError:
        pass
    if len(s) > 1 and s[-1] in _SUFFIX:
        try:
            return float(s[:-1]) * _SUFFIX[s[-1]]
        except ValueError:
            return None
    return None


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
    a, b = _as_number(paper), _as_number(ours)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)
    return str(paper).strip().lower() == str(ours).strip().lower()


def match_paper_row(table: Any, match: dict[str, str], value_of) -> Optional[dict]:
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
    out: dict[str, Any] = {}
    sinks = row.get("sink") if isinstance(row.get("sink"), list) else []
    for k, v in enumerate(sinks, start=1):
        out[f"paper_sink{k}"] = _to_float(v)
    for f in PAPER_FIELDS:
        if f in row and _to_float(row[f]) is not None:
            out[f"paper_{f}"] = float(row[f])
    if row.get("failed"):
        out["paper_note"] = "training failed in the paper"
    return out


def experiment_info(cfg: Any) -> dict[str, Any]:
    match = _select(cfg, "experiment.paper_match")
    return {"name": _select(cfg, "experiment.name"), "paper_table": _select(cfg, "experiment.paper_table"),
            "paper_match": match if isinstance(match, dict) else {}}


# ---------------------------------------------------------------------------------------------- the tables
def _metric_columns(jobs: list[Job]) -> list[tuple[str, str, str]]:
    present = set().union(*(j.final for j in jobs)) if jobs else set()
    slots = [SLOT_RE.match(c) for c in sorted(present)]
    slot_cols = [(m.group(1), m.group(0), f"{m.group(1).replace('_', ' ')} score (%)") for m in slots if m]
    return [m for m in SINK_METRICS if m[0] in ALWAYS or m[1] in present] + slot_cols + \
        [m for m in LOSS_METRICS if m[0] in ALWAYS or m[1] in present]


def build_rows(sweep: Sweep, tables: dict) -> tuple[list[dict], list[str], list[tuple[str, str, str]]]:
    """One dict per job: job, swept keys, status, steps, final metrics, paper values, error, dir."""
    mcols = _metric_columns(sweep.jobs)
    sweep_exp = experiment_info(sweep.cfg)
    rows = []
    for job in sweep.jobs:
        exp = experiment_info(job.cfg) if job.cfg is not None else sweep_exp
        row: dict[str, Any] = {"job": job.name}
        for key in sweep.swept:
            row[key] = job.value(key)
        row.update(status=job.status, steps=job.steps)
        for col, src, _ in mcols:
            row[col] = job.final.get(src)
        table = tables.get(exp["paper_table"]) if exp["paper_table"] else None
        row.update(paper_values(match_paper_row(table, exp["paper_match"], job.value)))
        row["error"] = job.error
        row["dir"] = str(job.path) if job.path else ""
        rows.append(row)
    wanted = {c for r in rows for c in r if c.startswith("paper_")}
    if sweep_exp["paper_table"] and isinstance(tables.get(sweep_exp["paper_table"]), list):
        wanted |= {"paper_sink1", "paper_loss"}  # shown even where no row matched
    paper_cols = [c for c in [f"paper_{f}" for f in PAPER_FIELDS] + ["paper_note"] if c in wanted]
    columns = ["job", *sweep.swept, "status", "steps", *[c for c, _, _ in mcols], *paper_cols, "error", "dir"]
    return [{c: r.get(c) for c in columns} for r in rows], columns, mcols


def aggregate_rows(rows: list[dict], swept: list[str], value_cols: list[str]) -> Optional[list[dict]]:
    """Mean and sample std over seeds (over completed jobs) per setting of the non-seed swept keys; None when no
    setting has more than one job."""
    group_keys = [k for k in swept if not is_seed_key(k)]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(_hashable(r.get(k)) for k in group_keys), []).append(r)
    if all(len(g) < 2 for g in groups.values()):
        return None
    out = []
    for members in groups.values():
        done = [r for r in members if r["status"] == "completed"]
        agg: dict[str, Any] = {k: members[0].get(k) for k in group_keys}
        agg["jobs"] = len(members)
        agg["completed"] = len(done)
        for c in value_cols:
            vals = np.array([r[c] for r in done if r.get(c) is not None and math.isfinite(r[c])], dtype=float)
            agg[f"{c}_mean"] = float(vals.mean()) if len(vals) else None
            agg[f"{c}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else None
        for c in members[0]:
            if c.startswith("paper_"):
                agg[c] = members[0][c]
        out.append(agg)
    return out


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict)) else v


# ------------------------------------------------------------------------------------------------- writing
def _fmt(v: Any, col: str = "") -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if col.startswith("paper_"):
            return f"{v:.2f}"  # the paper's precision
        if col.endswith(("loss", "loss_mean", "loss_std")):
            return f"{v:.3f}"
        if col.startswith(("sink", "slot")):
            return f"{v:.2f}"
        return f"{v:g}"
    return str(v)


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_csv_cell(r.get(c)) for c in columns])


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else v


def _md_cell(s: str, limit: int = 0) -> str:
    s = " ".join(str(s).split())
    if limit and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s.replace("|", "\\|")


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(body_row) + " |" for body_row in body]
    return lines


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Last component of each dotted key where that is unambiguous (optim.weight_decay -> weight_decay)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def status_counts(rows: list[dict]) -> str:
    """'completed 2, running 1, failed 1' in STATUS_ORDER, other statuses after."""
    found = [r["status"] for r in rows]
    order = [s for s in STATUS_ORDER if s in found] + sorted(set(found) - set(STATUS_ORDER))
    return ", ".join(f"{s} {found.count(s)}" for s in order)


def safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") or "value"


def write_markdown(path: Path, sweep: Sweep, rows: list[dict], columns: list[str], mcols, agg: Optional[list[dict]],
                   agg_cols: list[str], plots: list[Path], out_dir: Path, tables: dict) -> None:
    exp = experiment_info(sweep.cfg)
    title = exp["name"] or sweep.dir.name
    lines = [f"# Sweep report: {title}", ""]
    lines.append(f"- Sweep dir: `{sweep.dir}`")
    lines.append(f"- Experiment: `{exp['name'] or '-'}`")
    if exp["paper_table"]:
        table = tables.get(exp["paper_table"])
        how = ", ".join(f"`{f}` = `{k}`" for f, k in exp["paper_match"].items())
        if table is None:
            lines.append(f"- Paper table: `{exp['paper_table']}` (not in paper_tables.yaml)")
        elif isinstance(table, dict) and "figure_only" in table:
            lines.append(f"- Paper table: `{exp['paper_table']}`: figure only in the paper: {table['figure_only']}")
        else:
            lines.append(f"- Paper table: `{exp['paper_table']}`" + (f", matched on {how}" if how else "")
                         + f"; {PAPER_CITE}. Reference points, not targets at this scale.")
    lines.append(f"- Swept: {', '.join(f'`{k}`' for k in sweep.swept) or 'nothing (single setting)'}")
    lines.append(f"- Jobs: {len(rows)} ({status_counts(rows)})")
    lines.append(f"- Generated: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}")
    regen = f"sinklab report {sweep.dir} --out {out_dir}"
    lines.append(f"- Regenerate: `{regen}` (or `python -m sinklab.report {sweep.dir} --out {out_dir}`)")
    lines += ["", "Final values are the last logged ones; Sink_k in %, losses in nats.", "", "## Jobs", ""]

    labels = {c: lab for c, _, lab in mcols}
    labels.update({"paper_sink1": "paper Sink_1 (%)", "paper_sink2": "paper Sink_2 (%)",
                   "paper_sink3": "paper Sink_3 (%)", "paper_sink4": "paper Sink_4 (%)",
                   "paper_sink1_star": "paper Sink*_1 (%)", "paper_loss": "paper loss", "paper_note": "paper note"})
    shown = [c for c in columns if c != "dir"]
    body = [[_md_cell(_fmt(r[c], c), 80 if c == "error" else 0) for c in shown] for r in rows]
    lines += _md_table([labels.get(c, c) for c in shown], body)
    if agg:
        lines += ["", "## Mean ± std over seeds (completed jobs)", ""]
        keys = [k for k in sweep.swept if not is_seed_key(k)]
        value_cols = [c for c, _, _ in mcols]
        header = keys + ["jobs", "completed"] + [labels.get(c, c) for c in value_cols] + \
            [labels.get(c, c) for c in agg_cols if c.startswith("paper_")]
        body = []
        for a in agg:
            cells = [_md_cell(_fmt(a[k])) for k in keys] + [str(a["jobs"]), str(a["completed"])]
            for c in value_cols:
                m, s = a[f"{c}_mean"], a[f"{c}_std"]
                cells.append("" if m is None else _fmt(m, c) + ("" if s is None else f" ± {_fmt(s, c)}"))
            cells += [_md_cell(_fmt(a.get(c), c)) for c in agg_cols if c.startswith("paper_")]
            body.append(cells)
        lines += _md_table(header, body)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    else:
        lines += ["", "No plots: no job has logged sink/sink1 or val/loss yet."]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------- plots
FAIL_STATUSES = ("failed", "killed", "stalled")
RC = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 9,
      "xtick.labelsize": 10, "ytick.labelsize": 10, "axes.grid": True, "grid.alpha": 0.3}


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


def _numeric(values: Sequence[Any]) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _new_figure(size=(7.0, 4.6)):
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=150, layout="constrained")


def plot_vs_key(path: Path, rows: list[dict], key: str, swept: list[str], col: str, ylabel: str, paper_col: str,
                title: str) -> bool:
    """Final metric ``col`` against the swept ``key``: one point per job (hollow while running, red x for failed,
    killed or stalled jobs), the mean over completed seeds as a line, one series per setting of the other swept
    keys, and the paper's values as stars. False (nothing written) when no job has a value."""
    import matplotlib
    import matplotlib.ticker

    have = [r for r in rows if r.get(col) is not None and r.get(key) is not None and math.isfinite(r[col])]
    if not have:
        return False
    others = [k for k in swept if k != key and not is_seed_key(k)]
    short = _short_keys(swept)
    xs_all = [r[key] for r in rows if r.get(key) is not None]
    numeric = _numeric(xs_all)
    if numeric:
        to_x = float
    else:
        cats = list(dict.fromkeys(_fmt(v) for v in xs_all))
        to_x = lambda v: cats.index(_fmt(v))  # noqa: E731
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get(key) is not None:
            series.setdefault(tuple(_hashable(r.get(k)) for k in others), []).append(r)
    with matplotlib.rc_context(RC):
        fig = _new_figure()
        ax = fig.add_subplot()
        colors = matplotlib.colormaps["tab10"]
        handles_status = set()
        paper_drawn = False
        n_series = len(series)
        for si, (skey, members) in enumerate(series.items()):
            color = colors(si % 10)
            label = ", ".join(f"{short[k]}={_fmt(v)}" for k, v in zip(others, skey)) or None
            jitter = 0.0 if numeric or n_series == 1 else (si - (n_series - 1) / 2) * 0.08
            done: dict[Any, list[float]] = {}
            for r in members:
                if r.get(col) is None or not math.isfinite(r[col]):
                    continue
                x = to_x(r[key]) + jitter
                if r["status"] in FAIL_STATUSES:
                    ax.plot([x], [r[col]], "x", color="tab:red", ms=9, mew=2, zorder=4)
                    handles_status.add("failed")
                elif r["status"] == "completed":
                    ax.plot([x], [r[col]], "o", color=color, ms=6, alpha=0.55, zorder=3)
                    done.setdefault(x, []).append(r[col])
                else:
                    ax.plot([x], [r[col]], "o", mfc="white", mec=color, mew=1.5, ms=7, zorder=3)
                    handles_status.add("running")
            if done:
                xs = sorted(done)
                means = [float(np.mean(done[x])) for x in xs]
                stds = [float(np.std(done[x], ddof=1)) if len(done[x]) > 1 else 0.0 for x in xs]
                seeds = any(len(v) > 1 for v in done.values())
                ax.errorbar(xs, means, yerr=stds if seeds else None, color=color, marker="o", ms=7,
                            lw=1.6 if numeric else 0,  # no line between categories
                            capsize=3, label=label or ("ours, mean ± std over seeds" if seeds else "ours"), zorder=3)
            pts = sorted({(to_x(r[key]) + jitter, r[paper_col]) for r in members if r.get(paper_col) is not None})
            if pts:  # the paper's value for each setting of this series
                ax.plot(*zip(*pts), "*", ms=13, mfc="gold", mec="black" if n_series == 1 else color, mew=1.2,
                        ls="none", zorder=5)
                paper_drawn = True
        from matplotlib.lines import Line2D

        extra = []
        if paper_drawn:
            extra.append(Line2D([], [], marker="*", ls="none", ms=13, mfc="gold", mec="black",
                                label="paper (Gu et al.)"))
        if "running" in handles_status:
            extra.append(Line2D([], [], marker="o", ls="none", mfc="white", mec="gray", mew=1.5, label="running"))
        if "failed" in handles_status:
            extra.append(Line2D([], [], marker="x", ls="none", color="tab:red", mew=2, label="failed / killed"))
        h, lab = ax.get_legend_handles_labels()
        if h or extra:
            ax.legend(handles=h + extra, loc="best", framealpha=0.85)
        scale, kw = x_scale(xs_all) if numeric else ("linear", {})
        if numeric:
            ax.set_xscale(scale, **kw)
            ticks = sorted({float(v) for v in xs_all})
            if len(ticks) <= 12:  # label the swept values themselves
                ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.margins(x=0.06)
        else:
            ax.set_xticks(range(len(cats)), cats, rotation=30 if max(len(c) for c in cats) > 6 else 0,
                          ha="right" if max(len(c) for c in cats) > 6 else "center")
            ax.set_xlim(-0.5, len(cats) - 0.5)
        ax.set_xlabel(key + {"log": " (log scale)", "symlog": " (log scale, linear around 0)"}.get(scale, ""))
        ax.set_ylabel(ylabel)
        if col.startswith("sink") and ax.get_ylim()[0] > 0:
            ax.set_ylim(bottom=0)  # a rate in %: show it from 0
        ax.set_title(title)
        fig.savefig(path)
    return True


def plot_over_steps(path: Path, jobs: list[Job], rows: list[dict], swept: list[str], title: str,
                    src: str = "sink/sink1", ylabel: str = "Sink$_1$ (%)") -> bool:
    """One line per job of ``src`` against the training step; legend = swept values; failed, killed and stalled
    jobs dashed with a red x at their last point. False (nothing written) when no job logged ``src``."""
    import matplotlib

    lines = [(j, r) for j, r in zip(jobs, rows) if j.metrics.series.get(src)]
    if not lines:
        return False
    short = _short_keys(swept)
    with matplotlib.rc_context(RC):
        fig = _new_figure((8.0, 4.8))
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps["viridis" if len(lines) > 10 else "tab10"]
        for i, (job, row) in enumerate(lines):
            steps, vals = zip(*job.metrics.series[src])
            color = cmap(i / max(len(lines) - 1, 1)) if len(lines) > 10 else cmap(i % 10)
            label = ", ".join(f"{short[k]}={_fmt(row.get(k))}" for k in swept) or f"job {job.name}"
            failed = row["status"] in FAIL_STATUSES
            if row["status"] != "completed":
                label += f" ({row['status']})"
            ax.plot(steps, vals, ls="--" if failed else "-", color=color, lw=1.6,
                    marker="." if len(steps) < 30 else None, label=label)
            if failed:
                ax.plot([steps[-1]], [vals[-1]], "x", color="tab:red", ms=10, mew=2.2, zorder=4)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 if len(lines) <= 16 else 2, framealpha=0.85)
        fig.savefig(path)
    return True


def make_plots(out_dir: Path, sweep: Sweep, rows: list[dict]) -> list[Path]:
    exp = experiment_info(sweep.cfg)
    name = exp["name"] or sweep.dir.name
    written = []
    for key in sweep.swept:
        if is_seed_key(key):
            continue
        for col, ylabel, paper_col, what in (("sink1", "Sink$_1$ (%)", "paper_sink1", "Sink$_1$"),
                                              ("val_loss", "validation loss (nats)", "paper_loss", "validation loss")):
            p = out_dir / f"{col}_vs_{safe_name(key)}.png"
            if plot_vs_key(p, rows, key, sweep.swept, col, ylabel, paper_col, f"{name}: final {what} vs {key}"):
                written.append(p)
    p = out_dir / "sink1_over_steps.png"
    if plot_over_steps(p, sweep.jobs, rows, sweep.swept, f"{name}: Sink$_1$ during training"):
        written.append(p)
    return written


# ------------------------------------------------------------------------------------------------------ API
def build_report(sweep_dir, out_dir=None, *, paper_tables: Optional[Path] = None, now: Optional[float] = None,
                 stale_minutes: float = STALE_MINUTES) -> dict:
    """Read every job of a sweep and write report.md, report.csv (and report_aggregate.csv when a setting has
    several seeds) and the PNG plots into ``out_dir`` (default SWEEP_DIR/report).

    Returns {"out_dir", "md", "csv", "aggregate_csv" (or None), "plots": [paths], "rows": [one dict per job],
    "columns", "aggregate" (or None), "swept": [keys]}.
    """
    sweep_dir = Path(sweep_dir)
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir / "report"
    sweep = load_sweep(sweep_dir, now=now, stale_minutes=stale_minutes)
    tables = load_paper_tables(paper_tables)
    rows, columns, mcols = build_rows(sweep, tables)
    value_cols = [c for c, _, _ in mcols]
    agg = aggregate_rows(rows, sweep.swept, value_cols)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "report.csv", out_dir / "report.md"
    write_csv(csv_path, rows, columns)
    agg_path, agg_cols = None, []
    if agg:
        agg_cols = list(agg[0])
        agg_path = out_dir / "report_aggregate.csv"
        write_csv(agg_path, agg, agg_cols)
    plots = make_plots(out_dir, sweep, rows)
    write_markdown(md_path, sweep, rows, columns, mcols, agg, agg_cols, plots, out_dir, tables)
    return {"out_dir": out_dir, "md": md_path, "csv": csv_path, "aggregate_csv": agg_path, "plots": plots,
            "rows": rows, "columns": columns, "aggregate": agg, "swept": sweep.swept}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sinklab report", description="Tables and plots for a Hydra multirun sweep.")
    ap.add_argument("sweep_dir", type=Path, help="the multirun dir (holds multirun.yaml and 0/, 1/, ...)")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: SWEEP_DIR/report)")
    ap.add_argument("--paper-tables", type=Path, default=None, help="paper_tables.yaml (default: the packaged one)")
    ap.add_argument("--stale-minutes", type=float, default=STALE_MINUTES,
                    help="a job whose files have not changed for this long is not running any more (default 10)")
    args = ap.parse_args(argv)
    try:
        res = build_report(args.sweep_dir, args.out, paper_tables=args.paper_tables,
                           stale_minutes=args.stale_minutes)
    except FileNotFoundError as e:
        print(f"sinklab report: {e}", file=sys.stderr)
        return 1
    print(f"{len(res['rows'])} jobs ({status_counts(res['rows'])})")
    for p in [res["md"], res["csv"], res["aggregate_csv"], *res["plots"]]:
        if p is not None:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
