"""Evaluations as plug-ins: the `Evaluation` interface and the registry `EVALUATIONS` (name -> class), and the sweep
table every evaluation writes for `sinklab report`.

An evaluation scores a trained model beyond its training logs (e.g. `streaming`). It is one class
registered here with `@EVALUATIONS.register("name")`, declared beside its code (`sinklab/evals/<module>.py`), and
declares
- `command`: the module (`sinklab.cli.<name>`, or a plugin's own) whose `run(args)` returns its JSON result and whose
  `main(argv)` is `sinklab eval NAME` (named, not imported: the library never imports a command);
- `summary`: its line in `sinklab eval --help`;
- `row(result)`: its result flattened into one row of the sweep CSV, {column: value};
- `bounds`: the physical range of each numeric column of that row, regexes over the column name (`x4_y60_ppl`, not
  `streaming/x4_y60_ppl`). They cover every numeric column it writes (a difference that may have either sign: ANY),
  so that a claim naming a column that does not exist is refused (`column_bounds`).
`sinklab eval NAME --sweep SWEEP_DIR` runs it on every finished job of a sweep into JOB/NAME.json (a rerun merges
into an earlier result of the same checkpoint and data, `settings` / `same` / `merge`, or keeps the earlier one as
JOB/NAME.K.json) and writes SWEEP_DIR/NAME.csv (`write_table`): `job`, the job's overrides, then `row(result)`.
`sinklab report` reads that CSV of every registered evaluation as the columns ``NAME/<column>`` (quant/w4a4_gap),
values outside their bounds left out. Importing `sinklab.evals` registers sinklab's; an evaluation in a researcher's
own package registers when its module is imported (a plugin, `sinklab.plugins`).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

from sinklab.errors import UserError
from sinklab.keys import ANY, NON_NEGATIVE, PERCENT, UNIT  # noqa: F401  (the bounds evaluations declare)
from sinklab.registries import NameRegistry

PERPLEXITY = (1.0, math.inf)
Bounds = tuple[tuple[str, tuple[float, float]], ...]


class Evaluation:
    """The interface every registered evaluation implements (see the module docstring)."""

    name: ClassVar[str] = ""
    command: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    bounds: ClassVar[Bounds] = ()
    #: the result's parts with one entry per setting, each with the key that names an entry (a list of dicts); a
    #: rerun on a job merges into the job's earlier result by these (`merge`); none: an earlier result is kept apart
    settings: ClassVar[dict[str, str]] = {}
    #: the result's keys that say what was measured (the model's text, samples, sizes): two results merge only when
    #: they agree on every one of them (and on the checkpoint: `run_sweep`'s "checkpoint" key)
    same: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def row(result: dict) -> dict[str, Any]:
        """The result (the JSON of `command`'s run) as one row of the sweep CSV, {column: value}."""
        raise NotImplementedError

    @classmethod
    def merge(cls, old: dict, new: dict) -> Optional[dict]:
        """One result with the settings of both (an earlier `old` and a rerun `new` of one job): `new`, its settings
        replacing `old`'s of the same name, `old`'s others kept (in old's order, new's added after), the notes of
        both. None where they cannot be merged: the evaluation declares no `settings`, or the two differ in a key of
        `same` or in "checkpoint" (another model, other samples or text)."""
        if not cls.settings or any(old.get(k) != new.get(k) for k in (*cls.same, "checkpoint")):
            return None
        out = dict(new)
        for part, key in cls.settings.items():
            before, now = old.get(part), new.get(part)
            if not isinstance(before, list) or not isinstance(now, list):
                return None
            fresh = {s[key]: s for s in now}
            out[part] = [fresh.pop(s[key], s) for s in before] + list(fresh.values())
        if isinstance(old.get("notes"), list) and isinstance(new.get("notes"), list):
            out["notes"] = list(dict.fromkeys([*old["notes"], *new["notes"]]))
        return out

    @classmethod
    def column_bounds(cls, column: str) -> Optional[tuple[float, float]]:
        """The physical range of one of its columns (the first pattern that matches), None for a column it does not
        write."""
        return next((b for pattern, b in cls.bounds if re.search(pattern, column)), None)


class EvaluationRegistry(NameRegistry[type[Evaluation]]):
    """name -> Evaluation class, in registration order (the order of `sinklab eval --help`)."""

    what = "evaluation"

    def check(self, name: str, cls: type[Evaluation]) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
            raise ValueError(f"evaluation name {name!r}: allowed: lower-case letters, digits, _ and - (it names "
                             "a command, a file and a column prefix)")
        if not cls.command or not cls.bounds:
            raise ValueError(f"evaluation {name!r} declares no command or no bounds (sinklab.evals.registry)")

    def owner(self, column: str) -> Optional[tuple[type[Evaluation], str]]:
        """(the evaluation, its own column name) of a report column ``NAME/<column>``; None for a column of no
        registered evaluation (a logged metric's, sink/sink1)."""
        prefix, slash, rest = column.partition("/")
        return (self._classes[prefix], rest) if slash and prefix in self._classes else None

    def bounds(self, column: str) -> Optional[tuple[float, float]]:
        """The physical range of a report column ``NAME/<column>`` from its evaluation; None for a column of no
        registered evaluation, or one its evaluation does not write."""
        owner = self.owner(column)
        return owner[0].column_bounds(owner[1]) if owner else None


EVALUATIONS = EvaluationRegistry()


# ---------------------------------------------------------------------------------------------- sweeps
def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job dirs of a sweep (0, 1, ..., the names Hydra's sweeper gives), in job order."""
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def finished_jobs(sweep_dir: Path, only: Optional[Sequence[str]] = None) -> tuple[list[Path], list[Path]]:
    """(the job dirs with checkpoints/last.ckpt, the others), of all jobs or of the job names `only`. One-line
    errors for a sweep dir that is not a dir, a name in `only` that is no job of it, and no finished job."""
    if not sweep_dir.is_dir():
        raise UserError(f"SWEEP_DIR {sweep_dir} is not a directory")
    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise UserError(f"SWEEP_DIR {sweep_dir} has no job dirs (0, 1, ...: a sweep of `sinklab-train -m`)")
    if only is not None:
        names = [p.name for p in jobs]
        bad = [n for n in only if n not in names]
        if bad:
            raise UserError(f"job {bad[0]} is not a job dir of {sweep_dir}; allowed: {', '.join(names)}")
        jobs = [p for p in jobs if p.name in only]
    done = [p for p in jobs if (p / "checkpoints" / "last.ckpt").is_file()]
    if not done:
        raise UserError(f"SWEEP_DIR {sweep_dir}: no job dir{' of ' + ' '.join(only) if only else ''} has "
                        "checkpoints/last.ckpt (no job finished?)")
    return done, [p for p in jobs if p not in done]


def write_table(evaluation: type[Evaluation], sweep_dir: Path) -> tuple[Path, int]:
    """SWEEP_DIR/NAME.csv from every job's JOB/NAME.json, one row per job in job order: `job` (the key of the job
    column of `sinklab report`'s report.csv), the job's overrides, then `evaluation.row(result)`. Returns (the CSV,
    its rows)."""
    import pandas as pd

    from sinklab.io import atomic_write
    from sinklab.runs.run_data import override_texts

    name, rows = evaluation.name, []
    for job in job_dirs(sweep_dir):
        path = job / f"{name}.json"
        if not path.is_file():
            continue
        try:
            row = evaluation.row(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as err:  # not JSON, or not this evaluation's result
            raise UserError(f"{path} is not a result of `sinklab eval {name}` ({type(err).__name__}: {err}); "
                            f"delete it or rerun `sinklab eval {name} --sweep {sweep_dir} --jobs {job.name}`") from None
        rows.append({"job": job.name, **override_texts(job), **row})
    if not rows:
        raise UserError(f"no job of {sweep_dir} has a {name}.json (no finished job with a checkpoint)")
    out = sweep_dir / f"{name}.csv"
    atomic_write(out, pd.DataFrame(rows).to_csv(index=False))
    return out, len(rows)
