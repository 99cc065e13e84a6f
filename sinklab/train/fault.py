"""Fault tolerance of a training run, all in this module: which checkpoint a run resumes from, what a pre-emption
signal does, who requeues the job, and how metrics.csv goes on across a resume.

One mechanism: submitit's requeue
---------------------------------
A sweep on SLURM (`hydra/launcher=slurm`) is submitted by submitit. Its sbatch script asks SLURM for SIGUSR2
`hydra.launcher.signal_delay_s` seconds before the time limit, and its handler for that signal pickles the job again
and requeues it (`scontrol requeue`, up to `max_num_timeout` time-outs); on pre-emption or `scontrol requeue` SLURM
sends SIGTERM and requeues the job itself. The requeued job is the same Hydra job in the same job dir, and
`ckpt_path=auto` resumes it from the newest checkpoint there.

sinklab adds only the timing, `PreemptionCallback`: on SIGTERM or SIGUSR2 (callbacks.preemption.signals) the current
optimizer step finishes, checkpoints/last.ckpt is saved at that step boundary and training stops (`Preempted`); then
`exit_preempted` hands the signal to the handler that was installed before training (submitit's requeue; outside
submitit there is none) and exits with 128 + the signal's number.
Once training has completed, a SLURM job ignores the time-limit warning (`ignore_late_time_limit_signal`): coming
as the process exits, it would end the finished job by the signal and SLURM would mark it FAILED.

Lightning's own SLURM auto-requeue (SIGUSR1: hpc_ckpt_N.ckpt saved from the signal handler, then `scontrol requeue`)
is turned off (`slurm_plugins`): it would be a second requeue next to submitit's, and it saves in the middle of a step,
so a run resumed from it would not repeat an uninterrupted run. Checkpoints it wrote before are still resumed
(`resolve_ckpt_path`).

    event                              signal    checkpoint resumed                   requeued by
    time limit (submitit's sbatch)     SIGUSR2   last.ckpt, at the step it stopped    submitit's handler
    pre-emption, scontrol requeue      SIGTERM   last.ckpt, at the step it stopped    SLURM
    SIGKILL, a dead node               none      the periodic last.ckpt (callbacks.   SLURM, or by hand with
                                                 checkpoint.every_n_train_steps)      ckpt_path=auto / last

metrics.csv across a resume
---------------------------
Lightning's CSVLogger starts a new metrics.csv in a run dir that has one. `continue_metrics` (before anything is
logged) carries the rows of the steps inside the checkpoint over into it, through the logger's own `log_metrics`, and
leaves out the rows that the stopped run logged after the checkpoint: the resumed run logs those steps again, so a
killed and resumed run ends with the metrics.csv of an uninterrupted one, one row per step and metric.
`PreemptionCallback` writes the loggers' pending rows to disk before every checkpoint, so that no row of a step inside
a checkpoint is lost by a kill. (`sinklab report` would also read a file with a step logged twice: it keeps the later
value.)
"""
from __future__ import annotations

import csv
import io
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

import lightning as L

from sinklab.errors import UserError, one_line

log = logging.getLogger("sinklab")


# ---------------------------------------------------------------------------------------------- which checkpoint
def resolve_ckpt_path(ckpt_path: Optional[str], output_dir: Path) -> Optional[str]:
    """null | last (must exist) | auto (the latest checkpoint if there is one, for requeued jobs) | a path.

    auto picks, among <output_dir>/checkpoints/last.ckpt and any hpc_ckpt_N.ckpt that Lightning's SLURM auto-requeue
    wrote into <output_dir> before it was turned off, the one with the most steps. Under SLURM, Lightning itself
    resumes from an hpc_ckpt_N.ckpt even when ckpt_path is null; it is named explicitly here, so that it is checked
    and metrics.csv is carried over like for any other resume."""
    if ckpt_path in (None, "", "null"):
        hpc = hpc_checkpoints(output_dir)
        if hpc and slurm_detected():
            log.info("SLURM: resuming from %s (a checkpoint of Lightning's auto-requeue)", hpc[-1])
            return str(hpc[-1])
        return None
    last = output_dir / "checkpoints" / "last.ckpt"
    if ckpt_path == "auto":
        candidates = [p for p in (last, *hpc_checkpoints(output_dir)) if p.is_file()]
        if not candidates:
            return None
        steps = {p: checkpoint_step(p) for p in candidates}
        best = max(candidates, key=lambda p: steps[p])  # an unreadable file (-1) only if nothing else exists
        if len(candidates) > 1:
            log.info("ckpt_path=auto: %s (step %d) of %s", best, steps[best],
                     ", ".join(f"{p.name} (step {steps[p]})" for p in candidates))
        return str(best)
    if ckpt_path == "last":
        if not last.exists():
            raise UserError(f"ckpt_path=last: no checkpoint at {last}; run once without ckpt_path or set "
                            "paths.output_dir to the run to resume")
        return str(last)
    if not Path(ckpt_path).is_file():
        raise UserError(f"ckpt_path={ckpt_path}: no such file; allowed: null, last, auto or a .ckpt path")
    return ckpt_path


def hpc_checkpoints(output_dir: Path) -> list[Path]:
    """Lightning's SLURM requeue checkpoints hpc_ckpt_N.ckpt, by N."""
    found = [(int(p.stem.rsplit("_", 1)[1]), p) for p in output_dir.glob("hpc_ckpt_*.ckpt")
             if p.stem.rsplit("_", 1)[1].isdigit()]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The global step of a checkpoint, -1 when it cannot be read (it is reported when it is used)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:
        return -1


def slurm_detected() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def slurm_plugins(plugins: Sequence[Any]) -> list[Any]:
    """The trainer's plugins, plus under SLURM Lightning's SLURM environment with its auto-requeue off (the module
    docstring says why); a cluster environment already among the plugins is left as it is."""
    from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

    if slurm_detected() and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        return [*plugins, SLURMEnvironment(auto_requeue=False)]
    return list(plugins)


# ---------------------------------------------------------------------------------------------- pre-emption
class Preempted(Exception):
    """Raised at a step boundary after a pre-emption signal, once last.ckpt holds that step."""

    def __init__(self, message: str, signum: int, step: int, path: str):
        super().__init__(message)
        self.signum, self.step, self.path = signum, step, path


class PreemptionCallback(L.Callback):
    """SIGTERM (pre-emption, `scancel`, `scontrol requeue`) and SIGUSR2 (what submitit asks SLURM to send before the
    time limit): finish the current optimizer step, save `checkpoints/last.ckpt`, and stop with `Preempted`; the
    entry point marks the run "preempted" and calls `exit_preempted`. A job requeued with `ckpt_path=auto` resumes
    from that checkpoint. Before every checkpoint (this one or a periodic one) the loggers' pending rows are written.

    The handlers are installed when training starts, after Lightning's own, and removed when it ends. With
    several ranks the decision is all-reduced every step, so all ranks stop at the same step. The allowed signals:
    sinklab.train.config.PreemptionConfig."""

    def __init__(self, signals: Sequence[str] = ("SIGTERM", "SIGUSR2")):
        self.signals = [getattr(signal, str(name)) for name in signals]
        self.received: Optional[int] = None
        self._pending: Optional[Preempted] = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame) -> None:
        if self.received is None:
            log.warning("received %s: saving last.ckpt after the current step, then stopping",
                        signal.Signals(signum).name)
        self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}

    # before Lightning's teardown, which then puts back the handlers from before training
    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:  # on disk before the checkpoint that records their steps as done
            logger.save()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop or self._pending is not None:
            return
        signum = self.received or signal.SIGTERM
        cb = trainer.checkpoint_callback
        dirpath = getattr(cb, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath, "last.ckpt")
        trainer.save_checkpoint(path)
        # stop before the next step, once this step's metrics are logged (a resume does not log them again)
        self._pending = Preempted(f"{signal.Signals(signum).name} received: stopped after step {trainer.global_step}, "
                                  f"saved {path}; resume with ckpt_path=auto (or ckpt_path=last)",
                                  signum, trainer.global_step, path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending is not None:
            raise self._pending


def ignore_late_time_limit_signal() -> Optional[int]:
    """After a training that completed, in a submitit SLURM job: the time-limit warning (submitit's signal, SIGUSR2
    unless SUBMITIT_PREEMPT_SIGNAL says otherwise) is ignored for the rest of the process. It has nothing left to
    save, and if it came while the interpreter exits (Python puts every handler back to the default then, and the
    default action of SIGUSR2 is to end the process) SLURM would mark the finished job FAILED. An ignored signal
    stays ignored through that exit. Returns the signal ignored (None outside such a job: nothing changes)."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or threading.current_thread() is not threading.main_thread():
        return None
    from submitit.slurm.slurm import SlurmJobEnvironment

    signum = SlurmJobEnvironment._usr_sig()
    signal.signal(signum, signal.SIG_IGN)
    log.info("training completed: %s (the time-limit warning) is ignored from here on",
             signal.Signals(signum).name)
    return signum


def exit_preempted(err: Preempted) -> NoReturn:
    """The end of a pre-empted job (its status is written and wandb closed): one line, then the signal goes to the
    handler installed before training, i.e. submitit's (SIGUSR2: checkpoint the job's arguments and requeue it;
    SIGTERM: SLURM requeues), and the process exits with 128 + the signal's number."""
    print(f"preempted: {one_line(err)}", file=sys.stderr, flush=True)
    handler = signal.getsignal(err.signum)
    if callable(handler):
        handler(err.signum, None)
    sys.exit(128 + err.signum)


# ---------------------------------------------------------------------------------------------- metrics.csv
CARRIED_SUFFIX = ".resume"  # metrics.csv.resume: the old file while its rows are carried over


def continue_metrics(loggers: Sequence[Any], resume_step: Optional[int]) -> None:
    """Call before anything is logged. For each CSVLogger (on rank 0): on a resume at step G, metrics.csv goes on
    with the old file's rows of steps < G; without a resume step (a fresh run in a used dir) it starts anew, as
    Lightning does.

    The old file is first moved aside to metrics.csv.resume, its rows are logged again through the logger's own
    `log_metrics` (the cells as written, so every number stays byte-identical) and saved, and only then is the old
    file removed: a process killed in between finds metrics.csv.resume on its next start and carries it over then.
    Rows are attributed by their `step` column: Lightning logs a training step's metrics (train/loss) at the number
    of optimizer steps before it, so the rows of steps 0..G-1 come from the G steps inside the checkpoint."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            _continue_csv(logger, resume_step)


def _continue_csv(logger: Any, resume_step: Optional[int]) -> None:
    path = Path(logger.log_dir) / "metrics.csv"
    carried = path.with_name(path.name + CARRIED_SUFFIX)
    if resume_step is None:
        if path.is_file():
            log.info("%s: replacing the metrics of an earlier run (a fresh start, no checkpoint to resume)", path)
        _open(logger)
        carried.unlink(missing_ok=True)
        return
    if path.is_file() and not carried.is_file():
        os.replace(path, carried)
    rows = _complete_rows(carried) if carried.is_file() else []
    _open(logger)  # Lightning removes a metrics.csv that a carry-over killed midway had begun
    kept = [(step, row) for row in rows if (step := _step(row)) is not None and step < resume_step]
    for step, row in kept:
        logger.log_metrics({k: v for k, v in row.items() if k not in (None, "step") and v not in (None, "")},
                           step=step)
    logger.save()
    carried.unlink(missing_ok=True)
    if rows:
        log.info("%s: kept %d rows before step %d, dropped %d logged after that checkpoint", path, len(kept),
                 resume_step, len(rows) - len(kept))


def _open(logger: Any) -> None:
    """Create the logger's writer, which removes an old metrics.csv; Lightning's warning that the run dir is not
    empty is left out (it holds Hydra's files and the checkpoints, and the old rows were carried over above)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
        _ = logger.experiment


def _complete_rows(path: Path) -> list[dict]:
    """The rows of a metrics.csv, without a last line cut off by a kill during a write."""
    text = path.read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1], newline="")))


def _step(row: dict) -> Optional[int]:
    try:
        return int(float(row.get("step", "")))
    except (TypeError, ValueError):
        return None
