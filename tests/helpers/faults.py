"""Fault injectors for the reliability tests: Lightning callbacks a test adds through the config
(`+callbacks.x._target_=tests.helpers.faults.X`), as a user could add their own. Test-only: production code has no
debug knobs."""
import os
import signal
import time
from pathlib import Path

import lightning as L


class StallAt(L.Callback):
    """At the start of step `step`: write `marker`, then sleep (in short naps, so that signal handlers run) for
    `seconds` or until the pre-emption callback has received a signal: the test kills or signals the process at a
    known point of training."""

    def __init__(self, step: int, marker: str, seconds: float = 600.0):
        self.step, self.marker, self.seconds = step, marker, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            Path(self.marker).write_text(str(self.step))
            end = time.monotonic() + self.seconds
            while time.monotonic() < end and not any(getattr(c, "received", None) for c in trainer.callbacks):
                time.sleep(0.05)


class SignalAt(L.Callback):
    """Sends `signum` to this process at the start of step `step` (what SLURM or submitit would send)."""

    def __init__(self, step: int, signum: str):
        self.step, self.signum = step, getattr(signal, signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class Boom(L.Callback):
    """A bug: a callback whose constructor fails."""

    def __init__(self):
        raise RuntimeError("boom: a bug, not a user error")


class BugAt(L.Callback):
    """A bug that shows during training: the callback raises at the start of step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise ZeroDivisionError(f"bug in a callback at step {self.step}")


class NanGradientsAt(L.Callback):
    """The gradients of optimizer step `step` become NaN, as in a diverging update: the weights after that step are
    NaN (what the training's divergence checks must catch)."""

    def __init__(self, step: int):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


class Pace(L.Callback):
    """Sleeps `seconds` after every training step (the model and its numbers are unchanged)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)
