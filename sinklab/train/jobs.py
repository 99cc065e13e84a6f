"""One training job's outcome: its exit code, its status.json on failure, and the errors of training processes.

    user error (config, data, checkpoint)  one line "error: ...", exit 2; multirun: status failed, next job
    NaN / inf loss or weights             one line "error: ...", status failed, exit 1; multirun: next job
    pre-emption signal                     last.ckpt saved, status preempted, then sinklab.train.fault.exit_preempted:
                                           the signal to submitit's requeue, exit 128 + signal number
    anything else (a bug)                  status failed and the full traceback; multirun: logged, next job
"""
from __future__ import annotations

import logging
import re
import sys
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from sinklab.errors import UserError, describe, one_line
from sinklab.keys import RUN_FAILED, VAL_LOSS
from sinklab.runs.status import Status, write_status
from sinklab.train.record import RunRecord
from sinklab.train.runtime import is_multirun, output_dir_of
from sinklab.train.wandb_setup import finish_wandb

log = logging.getLogger("sinklab")


def run_job(cfg: DictConfig, train: Callable[[DictConfig, RunRecord], dict[str, float]]) -> Optional[float]:
    """Run `train(cfg, record)` as one job (see the module docstring); returns its final val/loss for Hydra. `train`
    writes the run's record (`RunRecord.accept`) when training is about to start; a job refused before then leaves a
    dir that held a run as it was."""
    from sinklab.train.fault import Preempted, exit_preempted, ignore_late_time_limit_signal
    from sinklab.train.module import TrainingDiverged

    record = RunRecord(cfg)
    exit_code = 1  # for wandb: failed unless training completes (or is pre-empted)
    try:
        try:
            final = train(cfg, record)
        except Exception as err:
            converted = worker_error(err)
            if converted is err:
                raise
            raise converted from err
        exit_code = 0
        ignore_late_time_limit_signal()  # in a SLURM job: a warning now would turn the finished job into FAILED
        return final.get(VAL_LOSS)
    except UserError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        if is_multirun():
            if record.written or record.refused():
                mark_status(cfg, Status.FAILED, err)
            return None
        sys.exit(2)
    except TrainingDiverged as err:
        mark_status(cfg, Status.FAILED, err)
        print(f"error: {one_line(err)}", file=sys.stderr)
        if is_multirun():
            return None
        sys.exit(1)
    except Preempted as err:
        mark_status(cfg, Status.PREEMPTED, err, step=err.step)
        exit_code = 0
        finish_wandb()  # before the requeue handler, which may end the process
        exit_preempted(err)
    except Exception as err:
        if record.written or record.refused():  # a bug before training started: a run that was there stays as it was
            mark_status(cfg, Status.FAILED, err)
        if is_multirun():  # the other jobs of the sweep go on; the report shows this one as failed
            log.exception("job failed: %s", err)
            return None
        err._sinklab_in_job = True  # a bug: main() lets the traceback through
        raise
    finally:
        finish_wandb(exit_code)


def mark_status(cfg: DictConfig, status: Status, err: BaseException, step: Optional[int] = None) -> None:
    """status.json = failed / preempted, even when the failure came before the Trainer existed."""
    try:
        write_status(output_dir_of(cfg) / "status.json", status, error=describe(err), step=step)
    except (OSError, ValueError):
        pass


def log_failure(trainer: Any) -> None:
    """A failed run is marked failed in its metrics too: one row `run/failed=1` at the step it stopped (metrics.csv;
    wandb: a run/failed chart and summary). Written to the loggers this process has written to; with ddp_spawn the
    training processes held them, and the failure is in status.json only."""
    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if getattr(lg, "_experiment", None) is None:
            continue
        try:
            lg.log_metrics({RUN_FAILED: 1.0}, step=trainer.global_step)
            lg.save()
        except Exception as log_err:  # the failure being reported matters more than its metric row
            log.warning("could not log %s to %s: %s", RUN_FAILED, type(lg).__name__, one_line(log_err))


def worker_error(err: Exception) -> Exception:
    """With ddp_spawn, an error in a training process reaches this one as ProcessRaisedException holding the
    worker's traceback as text: rebuild a user error or a divergence from its last line, so that it is reported like
    in a single process. Anything else is returned as it is."""
    if type(err).__name__ != "ProcessRaisedException":
        return err
    from hydra.utils import get_class

    from sinklab.train.module import TrainingDiverged

    last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    match = re.match(r"^([A-Za-z_][\w.]*): (.*)$", last)
    if not match:
        return err
    try:
        kind = get_class(match.group(1))
    except Exception:
        return err
    if issubclass(kind, (UserError, TrainingDiverged)):
        return (TrainingDiverged if issubclass(kind, TrainingDiverged) else UserError)(match.group(2))
    return err

