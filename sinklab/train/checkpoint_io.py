"""Checkpoint files that are never half-written and never run code when read.

`AtomicCheckpointIO` (a Lightning CheckpointIO plugin, set by the training entry point):
- save: `sinklab.io.atomic_write` (serialise into a temporary file in the checkpoint's own directory, fsync it, then
  `os.replace` it over the target), then fsync the directory. A process killed during a save leaves the previous
  `last.ckpt` intact (and at most a stale `.last.ckpt.*.tmp`, removed by the next save).
- load: always `torch.load(weights_only=True)`: a checkpoint holds tensors and plain containers only, so a foreign
  file cannot execute code; Lightning's own resume (`Trainer.fit(ckpt_path=...)`) loads through this plugin.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from sinklab.io import atomic_write, stale_temporaries


def _is_local(path: _PATH) -> bool:
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """torch.save to `path` through a same-directory temporary file and os.replace; clears the temporary files of
    saves that a killed process left behind."""
    path = atomic_write(path, lambda f: torch.save(obj, f))
    fsync_dir(path.parent)
    for stale in stale_temporaries(path):
        stale.unlink(missing_ok=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options}")
        if not _is_local(path):  # remote file systems: Lightning's writer
            return super().save_checkpoint(checkpoint, path)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location or (lambda storage, loc: storage),
                                       weights_only=True)
