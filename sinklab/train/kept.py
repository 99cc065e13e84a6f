"""Kept checkpoints: Lightning's ModelCheckpoint, which writes checkpoints/last.ckpt (what a resume starts from), with
a schedule of checkpoints that are kept (callbacks.checkpoint.keep, schema `sinklab.train.config.KeepConfig`): every
N steps and/or log-spaced in training tokens seen, each written once through the trainer (`Trainer.save_checkpoint`:
the strategy, the atomic checkpoint IO) as checkpoints/kept/step<step>-tokens<tokens>.ckpt.
`sinklab trajectory` measures them; `ckpt_path=auto` never resumes from them.

Tokens seen after step s are s x the tokens of one optimizer step, data.batch_size x data.block_size x the number
of processes x trainer.accumulate_grad_batches (the BOS token of a block counts as one of its block_size inputs).
Every checkpoint of a run records them (`sinklab.runs.checkpoints.TOKENS_SEEN`, written by `LitLM.on_save_checkpoint`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from sinklab.runs.checkpoints import KEPT_DIR, kept_name
from sinklab.errors import UserError
from sinklab.train.config import KeepConfig


def tokens_per_step(trainer: L.Trainer) -> Optional[int]:
    """Training tokens of one optimizer step over every process; None without a data module that says its batch and
    block size."""
    dm = trainer.datamodule
    batch, block = getattr(dm, "batch_size", None), getattr(dm, "block_size", None)
    if not isinstance(batch, int) or not isinstance(block, int):
        return None
    return batch * block * trainer.world_size * trainer.accumulate_grad_batches


def tokens_seen(trainer: L.Trainer) -> Optional[int]:
    """Training tokens seen up to the trainer's global step (None when the data module does not say)."""
    per_step = tokens_per_step(trainer)
    return None if per_step is None else trainer.global_step * per_step


def log_marks(tokens: int, start: float, per_decade: int) -> int:
    """How many of the marks start * 10^(j / per_decade), j = 0, 1, ..., lie at or below `tokens`."""
    if tokens < start:
        return 0
    return math.floor(per_decade * math.log10(tokens / start) + 1e-9) + 1


def is_kept(keep: KeepConfig, step: int, per_step: Optional[int]) -> bool:
    """Whether the schedule keeps the model after optimizer step `step` (>= 1): a multiple of every_n_steps, or the
    first step whose tokens seen reach a log-spaced mark."""
    if keep.every_n_steps and step % keep.every_n_steps == 0:
        return True
    start = keep.log_start
    if start is None or per_step is None or step < 1:
        return False
    per_decade = keep.log_tokens.per_decade
    return log_marks(step * per_step, start, per_decade) > log_marks((step - 1) * per_step, start, per_decade)


def keep_config(keep: Union[KeepConfig, Mapping, None]) -> Optional[KeepConfig]:
    """The schedule as its schema (checked), None when it keeps nothing."""
    if keep is not None and not isinstance(keep, KeepConfig):
        keep = KeepConfig(**{str(k): (dict(v) if isinstance(v, Mapping) else v) for k, v in keep.items()})
    if keep is None or (keep.every_n_steps is None and keep.log_start is None):
        return None
    return keep


class KeptCheckpoint(ModelCheckpoint):
    """ModelCheckpoint (last.ckpt, its own arguments) plus the checkpoints of the `keep` schedule (`KeepConfig`, or
    a mapping of its fields), saved after the optimizer steps the schedule names, in <dirpath>/kept/."""

    def __init__(self, *args: Any, keep: Union[KeepConfig, Mapping, None] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.keep = keep_config(keep)
        self._kept_step = -1  # the last step kept (micro-batches of one step under gradient accumulation)

    @property
    def state_key(self) -> str:
        """ModelCheckpoint's: a run checkpointed before this class existed resumes with its checkpoint state."""
        return ModelCheckpoint.__qualname__ + super().state_key[len(type(self).__qualname__):]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._kept_step = trainer.global_step  # a resumed run: the resumed step was kept (or not) by the first run
        if self.keep is not None and self.keep.log_start is not None and tokens_per_step(trainer) is None:
            raise UserError("callbacks.checkpoint.keep.log_tokens needs the tokens per step, which the data module "
                            f"({type(trainer.datamodule).__name__}) does not say (no batch_size / block_size); use "
                            "callbacks.checkpoint.keep.every_n_steps")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # last.ckpt
        step = trainer.global_step
        if self.keep is None or step == self._kept_step or trainer.sanity_checking or trainer.fast_dev_run:
            return
        per_step = tokens_per_step(trainer)
        if is_kept(self.keep, step, per_step):
            self._kept_step = step
            trainer.save_checkpoint(self.kept_path(trainer, step, per_step), weights_only=self.keep.weights_only)

    def kept_path(self, trainer: L.Trainer, step: int, per_step: Optional[int]) -> Path:
        """<dirpath>/kept/step<step>-tokens<tokens seen>.ckpt (tokens 0 when the data module does not say)."""
        dirpath = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"
        return Path(dirpath) / KEPT_DIR / kept_name(step, step * (per_step or 0))
