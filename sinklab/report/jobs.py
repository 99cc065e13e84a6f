"""Reading a sweep: its job dirs, each job's status, overrides, config and logged metrics.

A sweep dir holds ``multirun.yaml`` and one dir per job (``0/``, ``1/``, ...) with ``.hydra/config.yaml``,
``.hydra/overrides.yaml``, ``metrics.csv`` (Lightning CSVLogger format, sparse rows) and ``status.json``. Any of these
may be missing: a sweep may still be running, or jobs may have failed. Jobs that ``multirun.yaml`` promises but that
have no dir yet are ``pending``.
"""
from __future__ import annotations

import io
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from sinklab.errors import UserError
from sinklab.evals import EVALUATIONS
from sinklab.metrics import METRICS
from sinklab.report.columns import ANY, bounds
from sinklab.runs.status import Status, read_status
from sinklab.runs.run_data import is_run_dir, job_sort_key, load_run_config, parse_overrides

log = logging.getLogger(__name__)
STALE_MINUTES = 10.0
JOB_FILES = (".hydra", "metrics.csv", "status.json")
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def as_number(v: Any) -> Optional[float]:
    """A number from a config, table or file value: 4e-4, "300", "0.25M" (k, M, B suffixes); None for booleans,
    None and other text."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    s = str(v).strip().lower()
    scale = _SUFFIX.get(s[-1:], 1.0) if len(s) > 1 else 1.0
    try:
        return float(s[:-1] if scale != 1.0 else s) * scale
    except ValueError:
        return None


def numbers(raw: pd.DataFrame, source: Path) -> pd.DataFrame:
    """``raw`` cells (numbers, or text where a column is not all numbers; one column per logged name) as floats. A
    cell that is not a number within its column's physical range (see ``columns.bounds``) is blank, with one warning
    per column that had any."""
    text = [c for c, dtype in raw.dtypes.items() if not pd.api.types.is_numeric_dtype(dtype)]
    values = raw.assign(**{c: pd.to_numeric(raw[c], errors="coerce") for c in text}).to_numpy(float)
    ranges = [bounds(c) for c in raw.columns]
    lo, hi = np.array(ranges, dtype=float).reshape(-1, 2).T
    ok = (values >= lo) & (values <= hi) & np.isfinite(values)
    for col, (low, high), n in zip(raw.columns, ranges, (raw.notna().to_numpy(bool) & ~ok).sum(axis=0)):
        if n:
            allowed = "a finite number" + (f" in [{low:g}, {high:g}]" if (low, high) != ANY else "")
            log.warning("%s: %d value(s) of %s ignored; allowed: %s", source, n, col, allowed)
    return pd.DataFrame(np.where(ok, values, np.nan), index=raw.index, columns=raw.columns)


# ----------------------------------------------------------------------------------------------- reading a job
@dataclass
class Metrics:
    """What a job logged: the last value of each metric, each metric per step, and the last step."""

    final: dict[str, float] = field(default_factory=dict)  # metrics.csv column -> last value
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # column -> [(step, value)], by step
    max_step: Optional[int] = None


def read_metrics(path: Path) -> Metrics:
    """Parse a CSVLogger metrics.csv. "Final" is the last non-empty cell of a column in file order; a step logged
    twice (a resumed run) keeps its later value. A last line without its newline (the file was being written, or the
    job was killed mid-write), cells that are not numbers and values outside their physical range are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return Metrics()
    try:
        raw = pd.read_csv(io.StringIO(text[: text.rfind("\n") + 1]), keep_default_na=False, na_values=[""],
                          index_col=False, on_bad_lines="skip")
    except pd.errors.EmptyDataError:
        return Metrics()
    values = numbers(raw, path)
    step = values.pop("step") if "step" in values else pd.Series(math.nan, index=values.index)
    stepped = step.notna() & step.eq(step.round())
    by_step = values[stepped].groupby(step[stepped].astype(int)).last()  # a step's last value of each column
    steps, table = by_step.index.to_numpy(), by_step.to_numpy()
    logged = ~np.isnan(table)
    return Metrics(final=values.ffill().iloc[-1].dropna().to_dict() if len(values) else {},
                   series={c: list(zip(steps[logged[:, j]].tolist(), table[logged[:, j], j].tolist()))
                           for j, c in enumerate(by_step.columns) if logged[:, j].any()},
                   max_step=int(step.max()) if step.notna().any() else None)


def job_status(job_dir: Path, now: float, stale_s: float) -> tuple[Status, str, Optional[int], dict[str, float]]:
    """(status, error, step, final values) from status.json; without a readable one (not started, killed hard, or
    caught mid-write) the status is inferred from how recently metrics.csv was written: running, else killed. A
    status.json that says running while nothing in the dir changed for ``stale_s`` seconds is stalled (killed
    without a chance to write "failed")."""
    status_path, metrics_path = job_dir / "status.json", job_dir / "metrics.csv"
    mtimes = [p.stat().st_mtime for p in (status_path, metrics_path) if p.is_file()]
    fresh = bool(mtimes) and now - max(mtimes) < stale_s
    data = read_status(status_path)
    if data is None or data["status"] is Status.UNKNOWN:
        inferred = (Status.RUNNING if fresh else Status.KILLED) if metrics_path.is_file() else Status.UNKNOWN
        return inferred, "", None, {}
    status = Status.STALLED if data["status"] is Status.RUNNING and not fresh else data["status"]
    step = as_number(data.get("step"))
    final = pd.DataFrame([data.get("final") if isinstance(data.get("final"), dict) else {}], dtype=object)
    return (status, " ".join(str(data.get("error") or "").split()),
            int(step) if step is not None and 0 <= step < math.inf else None,
            numbers(final, status_path).iloc[0].dropna().to_dict())


def _load_yaml(path: Path) -> Any:
    """A YAML file as an OmegaConf object; None when it is missing or unreadable."""
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except Exception:
        return None


def _load_run_config(path: Path) -> Any:
    """A job's composed config (`sinklab.runs.run_data.load_run_config`: resolvable outside Hydra, its
    paths.output_dir the job dir); None when it is missing or unreadable."""
    try:
        return load_run_config(path) if is_run_dir(path) else None
    except UserError:
        return None


def select(cfg: Any, key: str) -> Any:
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
    """One job of a sweep: where it is, what it overrides, its config, status and logged metrics."""

    name: str
    path: Optional[Path]
    overrides: dict[str, Any]  # key -> typed value (from overrides.yaml, or multirun.yaml for pending jobs)
    override_text: dict[str, str]
    cfg: Any = None  # OmegaConf config of the job, None when .hydra/config.yaml is missing
    status: Status = Status.PENDING
    error: str = ""
    steps: Optional[int] = None
    metrics: Metrics = field(default_factory=Metrics)
    final: dict[str, float] = field(default_factory=dict)  # metrics.csv's final values, else status.json's

    def value(self, key: str) -> Any:
        """The job's setting for a key: the composed config's value, else the override as written."""
        v = select(self.cfg, key)
        if v is None or isinstance(v, (dict, list)) and key in self.overrides:
            v = self.overrides.get(key, v)
        return v


def _is_job_dir(p: Path) -> bool:
    return p.is_dir() and any((p / n).exists() for n in JOB_FILES)


def _new_job(name: str, path: Optional[Path], override_lines: Sequence[str], cfg: Any = None) -> Job:
    parsed = parse_overrides(override_lines)
    return Job(name, path, {k: v for k, v, _, _ in parsed}, {k: t for k, _, t, _ in parsed}, cfg)


def load_job(path: Path, now: float, stale_s: float) -> Job:
    """Read one job dir; see ``job_status`` for how its status is decided."""
    lines = _load_yaml(path / ".hydra" / "overrides.yaml")
    job = _new_job(path.name, path, OmegaConf.to_container(lines) if OmegaConf.is_list(lines) else [],
                   _load_run_config(path))
    job.status, job.error, status_step, status_final = job_status(path, now, stale_s)
    job.metrics = read_metrics(path / "metrics.csv")
    steps = [s for s in (job.metrics.max_step, status_step) if s is not None]
    job.steps = max(steps) if steps else None
    job.final = {**status_final, **job.metrics.final}  # status.json's final values fill columns metrics.csv lacks
    return job


# ---------------------------------------------------------------------------------------------- the sweep
@dataclass
class Sweep:
    """The jobs of a sweep dir, the keys it sweeps and its config."""

    dir: Path
    jobs: list[Job]
    swept: list[str]  # swept keys, in Hydra's sweep order
    cfg: Any  # sweep-level config (multirun.yaml, else the first job's)
    dirs: list[Path] = field(default_factory=list)  # the sweep dirs read (several: `load_sweeps`); [dir] by default
    dir_cfgs: list[Any] = field(default_factory=list)  # each dir's sweep-level config; [cfg] by default

    def __post_init__(self):
        self.dirs = self.dirs or [self.dir]
        self.dir_cfgs = self.dir_cfgs or [self.cfg]

    @property
    def where(self) -> str:
        """The sweep dir, or the dirs of a combined sweep, as a command names them."""
        return " ".join(str(d) for d in self.dirs)


def _multirun_overrides(mr: Any) -> list[str]:
    """The override list BasicSweeper expanded: hydra.sweeper.params first, then the command line."""
    params = select(mr, "hydra.sweeper.params") or {}
    task = select(mr, "hydra.overrides.task") or []
    return [f"{k}={v}" for k, v in params.items()] + [str(t) for t in task]


def _expected_jobs(mr: Any, lines: list[str]) -> Optional[list[list[str]]]:
    """Override lists of all jobs of a BasicSweeper sweep, in job-number order; None for other sweepers. The
    BasicSweeper's order: one list of `key=value` per key (a later override of a key takes the earlier one's place),
    every combination, the last key varying fastest (itertools.product)."""
    target = str(select(mr, "hydra.sweeper._target_") or "")
    if not lines or not target.endswith("BasicSweeper"):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, list[str]] = {}
    try:
        for override in OverridesParser.create().parse_overrides(lines):
            key = override.get_key_element()
            if override.is_sweep_override() and not override.is_discrete_sweep():
                return None  # an interval: the BasicSweeper refuses it, no job ran
            values = override.sweep_string_iterator() if override.is_sweep_override() else \
                [override.get_value_element_as_str()]
            choices[key] = [f"{key}={value}" for value in values]
    except Exception:
        return None
    return [list(job) for job in itertools.product(*choices.values())]


def load_sweep(sweep_dir: Path, now: Optional[float] = None, stale_minutes: float = STALE_MINUTES) -> Sweep:
    """Every job of a multirun dir (or a single run dir), the pending ones included, in job-number order. A job
    whose files have not changed for ``stale_minutes`` is not running any more."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UserError(f"SWEEP_DIR {sweep_dir} is not a directory; expected a Hydra multirun dir (multirun.yaml, "
                        "0/, 1/, ...) or a run dir")
    if not (isinstance(stale_minutes, (int, float)) and 0 < stale_minutes < math.inf):
        raise UserError(f"--stale-minutes {stale_minutes} is not allowed; allowed: a number of minutes > 0")
    now = time.time() if now is None else now
    mr = _load_yaml(sweep_dir / "multirun.yaml")
    dirs = [p for p in sweep_dir.iterdir() if not p.name.startswith(".") and _is_job_dir(p)]
    if not dirs and mr is None and (sweep_dir / ".hydra").is_dir():
        dirs = [sweep_dir]  # a single (non-multirun) run dir
    jobs = [load_job(p, now, 60.0 * stale_minutes) for p in dirs]

    mr_lines = _multirun_overrides(mr) if mr is not None else []
    swept = list(dict.fromkeys(key for key, _, _, is_sweep in parse_overrides(mr_lines) if is_sweep))
    have = {j.name for j in jobs}
    jobs += [_new_job(str(i), None, lines) for i, lines in enumerate(_expected_jobs(mr, mr_lines) or [])
             if str(i) not in have]
    jobs.sort(key=lambda j: job_sort_key(j.name))
    # keys whose override differs between jobs are swept too (other sweepers, or no multirun.yaml)
    for job in jobs:
        swept += [k for k in job.override_text
                  if k not in swept and len({j.override_text.get(k) for j in jobs}) > 1]
    if not jobs:
        raise UserError(f"SWEEP_DIR {sweep_dir} has no job dirs (with {', '.join(JOB_FILES)}) and no multirun.yaml "
                        "promising any")
    cfg = mr if mr is not None else next((j.cfg for j in jobs if j.cfg is not None), None)
    read_evaluations(sweep_dir, jobs)
    fill_derived(jobs)
    return Sweep(sweep_dir, jobs, swept, cfg)


def load_sweeps(sweep_dirs: Sequence[Path], now: Optional[float] = None,
                stale_minutes: float = STALE_MINUTES) -> Sweep:
    """Several sweep dirs of one preset read as one sweep: seeds or settings added by a later sweep (`sinklab-train -m
    experiment=X seed=0,1` today, `seed=2,3,4` tomorrow). Each dir is read as by `load_sweep`, its evaluations
    included; a job is named ``<dir name>/<job>`` (the dir's path where two names repeat); a key is swept when the
    jobs' values of it differ (a seed each sweep fixed on its command line is swept here). The sweep-level config is
    the first dir's. Dirs of different presets (experiment.name), or one dir named twice, are one line."""
    dirs = [Path(d) for d in sweep_dirs]
    if len(dirs) == 1:
        return load_sweep(dirs[0], now=now, stale_minutes=stale_minutes)
    now = time.time() if now is None else now
    seen: dict[Path, Path] = {}
    for d in dirs:
        if d.resolve() in seen:
            raise UserError(f"SWEEP_DIR {d} is named twice (as {seen[d.resolve()]} and {d}); allowed: each sweep "
                            "dir once")
        seen[d.resolve()] = d
    sweeps = [load_sweep(d, now=now, stale_minutes=stale_minutes) for d in dirs]
    presets = {str(d): select(s.cfg, "experiment.name") for d, s in zip(dirs, sweeps)}
    if len(set(presets.values())) > 1:
        raise UserError("SWEEP_DIRs of different presets cannot be reported as one: "
                        + ", ".join(f"{d} ({name or 'no experiment.name'})" for d, name in presets.items())
                        + "; allowed: sweeps of one preset")
    names = [d.name for d in dirs]
    prefixes = names if len(set(names)) == len(names) else [str(d) for d in dirs]
    jobs: list[Job] = []
    for prefix, sweep in zip(prefixes, sweeps):
        for job in sweep.jobs:
            job.name = f"{prefix}/{job.name}"
            jobs.append(job)
    swept = list(dict.fromkeys(k for s in sweeps for k in s.swept))
    # a key set on one sweep's command line and not on another's is swept only where the composed values differ; where
    # a job starts from or writes to (each sweep's own init_from=SWEEP_DIR, say) is not a setting
    for job in jobs:
        swept += [k for k in job.override_text if k not in swept and not is_location_key(k)
                  and len({repr(j.value(k)) for j in jobs}) > 1]
    fill_derived(jobs)
    return Sweep(dirs[0], jobs, swept, sweeps[0].cfg, dirs, [s.cfg for s in sweeps])


def fixed_overrides(sweep: Sweep) -> list[str]:
    """The overrides every job of the sweep shares: the multirun's command line (multirun.yaml), else the first job's
    overrides.yaml, without the sweep's own (swept keys, sweeps) and without Hydra's (hydra.*, hydra/...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if select(sweep.cfg, "hydra.overrides") is not None:
        lines = _multirun_overrides(sweep.cfg)
    else:
        job = next((j for j in sweep.jobs if j.path is not None), None)
        found = _load_yaml(job.path / ".hydra" / "overrides.yaml") if job is not None else None
        lines = [str(v) for v in OmegaConf.to_container(found)] if OmegaConf.is_list(found) else []
    parser, out = OverridesParser.create(), []
    for line in lines:
        try:
            o = parser.parse_override(line)
        except Exception:  # what Hydra cannot parse it could not have run
            continue
        key = o.key_or_group
        if o.is_sweep_override() or key in sweep.swept or key.split("/")[0].split(".")[0] == "hydra":
            continue
        out.append(line)
    return out


def fill_derived(jobs: list[Job]) -> None:
    """The values every registered metric derives from the jobs' final values (`Metric.fill_final`), e.g. the sink
    metric's Sink*_k of a job whose rows sum to one, in a sweep where others log it."""
    finals = [job.final for job in jobs]
    for metric in METRICS:
        metric.fill_final(finals)


def read_evaluations(sweep_dir: Path, jobs: list[Job]) -> None:
    """Add the evaluations of a sweep's jobs to their final values: each ``SWEEP_DIR/<name>.csv`` of a registered
    evaluation (`sinklab.evals.registry`: one row per job, keyed by ``job``, as `sinklab eval NAME --sweep` writes
    them) gives every numeric column that is not one of the jobs' overrides as ``<name>/<column>`` (quant/w4a4_gap,
    streaming/x0_y60_ppl, intervene/mask_first_dppl). Values outside the physical range its evaluation declares are
    left out, as in metrics.csv."""
    by_name = {j.name: j for j in jobs}
    overrides = {k for j in jobs for k in j.override_text}
    for kind in EVALUATIONS.names():
        path = sweep_dir / f"{kind}.csv"
        try:
            raw = pd.read_csv(path, dtype={"job": str}) if path.is_file() else None
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not a CSV of `sinklab eval {kind} --sweep` ({' '.join(str(e).split())}); "
                            "expected a header with job and one row per job") from e
        if raw is None:
            continue
        if "job" not in raw:
            raise UserError(f"{path} has no job column; expected the CSV of `sinklab eval {kind} --sweep`: job, "
                            "overrides, values")
        cols = [c for c, t in raw.dtypes.items() if c != "job" and c not in overrides
                and pd.api.types.is_numeric_dtype(t) and not pd.api.types.is_bool_dtype(t)]
        values = numbers(raw[cols].rename(columns=lambda c: f"{kind}/{c}"), path)
        for name, row in zip(raw["job"], values.to_dict("records")):
            if name in by_name:
                by_name[name].final.update({k: v for k, v in row.items() if not math.isnan(v)})


def is_location_key(key: str) -> bool:
    """Keys that say where a job reads or writes (its first stage's sweep, a checkpoint, its paths), not what it ran:
    sweeps combined by `load_sweeps` may differ in them without differing in a setting."""
    return key in ("init_from", "ckpt_path") or key.split(".")[0].split("/")[0] in ("paths", "hydra")


def is_seed_key(key: str) -> bool:
    """Seeds are averaged over, not compared."""
    return key == "seed" or key.endswith(".seed")
