"""Fault injectors for the reliability tests: Lightning callbacks a test adds through the config
(`+callbacks.x._target_=tests.helpers.faults.X`), as a user could add their own, and a data build killed at a chosen
point (`python -m tests.helpers.faults FAULT PREPARE_ARGS...`). Test-only: production code has no debug knobs."""
import os
import signal
import sys
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


# ---------------------------------------------------------------------------------------------- a killed data build
PREPARE_FAULTS = ("mid_write", "before_manifest")


def kill_prepare_at(fault: str) -> None:
    """From now on, this process's token-store builds die by SIGKILL at `fault`, "<point>:<chunk>": `mid_write` with
    half of chunk `chunk`'s first shard in its temporary file; `before_manifest` once both of the chunk's shards are
    on disk, before the manifest records them. Replaces sinklab.data.token_store._write_shard, which build_store calls for
    each shard of each chunk (train, then val)."""
    from sinklab.data import token_store as cache
    from sinklab.io import atomic_write

    point, chunk = fault.split(":")
    assert point in PREPARE_FAULTS, fault
    chunk, write_shard = int(chunk), cache._write_shard

    def faulty_write_shard(path: Path, tokens) -> str:
        at_chunk = int(path.name[len("shard_"):-len(".bin")]) == chunk  # shard_00002.bin: chunk 2
        if at_chunk and point == "mid_write":
            data = tokens.tobytes()

            def half_then_die(f) -> None:
                f.write(data[: len(data) // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            atomic_write(path, half_then_die)
        sha = write_shard(path, tokens)
        if at_chunk and point == "before_manifest" and path.parent.name == cache.SPLITS[-1]:
            os.kill(os.getpid(), signal.SIGKILL)
        return sha

    cache._write_shard = faulty_write_shard


if __name__ == "__main__":  # python -m tests.helpers.faults FAULT ARGS...: `sinklab prepare ARGS...` killed at FAULT
    from sinklab.cli.prepare import main

    kill_prepare_at(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
