"""ResumableCSVLogger: Lightning's CSVLogger, but a resumed run keeps the rows it has not re-run.

Lightning's CSVLogger deletes an existing metrics.csv as soon as it writes to a non-empty log dir, so a run resumed
from a checkpoint would lose every row before the resume. Here the training entry point tells the logger the step
of the checkpoint it resumes from (`resume_from_step(G)`, before training starts); the first time the file is
opened, the rows with step < G are kept and the rows with step >= G, logged after that checkpoint by the run that
was killed and trained again now, are dropped. A killed and resumed run thus ends with the metrics.csv of an
uninterrupted one. Without a resume step (a fresh run) an old metrics.csv is replaced, as Lightning does.

Rows are attributed by their `step` column: Lightning logs a training step's metrics (train/loss) at the number of
optimizer steps before it, so the rows of steps 0..G-1 come from the G steps inside the checkpoint.
"""
from __future__ import annotations

import csv
import io
import logging
from typing import Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from sinklab.io import atomic_write

log = logging.getLogger("sinklab")


class ResumableExperimentWriter(ExperimentWriter):
    def __init__(self, log_dir: str, keep_before: Optional[int] = None) -> None:
        self.keep_before = keep_before
        self.kept_rows = 0
        self.dropped_rows = 0
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        if self.keep_before is None:  # a fresh run in a used dir: the old metrics.csv goes (as in Lightning)
            log.info("%s: replacing the metrics of an earlier run (a fresh start, no checkpoint to resume)",
                     self.metrics_file_path)
            self._fs.rm_file(self.metrics_file_path)
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = list(reader)
        keep = [r for r in rows if _step(r) is not None and _step(r) < self.keep_before]
        self.kept_rows, self.dropped_rows = len(keep), len(rows) - len(keep)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=header)
        writer.writeheader()
        writer.writerows(keep)
        atomic_write(self.metrics_file_path, text.getvalue())
        log.info("%s: kept %d rows before step %d, dropped %d logged after that checkpoint", self.metrics_file_path,
                 self.kept_rows, self.keep_before, self.dropped_rows)
        self.metrics_keys = header  # later rows are appended under this header (widened when new keys come)


def _step(row: dict) -> Optional[int]:
    try:
        return int(float(row.get("step", "")))
    except (TypeError, ValueError):
        return None


class ResumableCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv survives a resume: see the module docstring. Same arguments as CSVLogger."""

    def __init__(self, save_dir: str, name: Optional[str] = "lightning_logs", version: Optional[int | str] = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100, resume_step: Optional[int] = None) -> None:
        super().__init__(save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self.resume_step = resume_step

    def resume_from_step(self, step: Optional[int]) -> None:
        """Call before training starts: keep the rows before `step`, drop the others (None: start a new file)."""
        if self._experiment is not None:
            raise RuntimeError("resume_from_step must be called before the logger writes anything")
        self.resume_step = step

    @property
    @rank_zero_experiment
    def experiment(self) -> ResumableExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = ResumableExperimentWriter(log_dir=self.log_dir, keep_before=self.resume_step)
        return self._experiment

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self.save()  # rows logged so far reach the disk with the checkpoint that follows them
