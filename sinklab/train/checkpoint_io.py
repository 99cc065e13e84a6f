"""Checkpoint files that are never half-written and never run code when read.

`AtomicCheckpointIO` (a Lightning CheckpointIO plugin, set by the training entry point):
- save: serialise into a temporary file in the checkpoint's own directory, fsync it, then `os.replace` it over the
  target and fsync the directory. A process killed during a save leaves the previous `last.ckpt` intact (and at
  most a stale `.last.ckpt.*.tmp`, removed by the next save).
- load: always `torch.load(weights_only=True)`: a checkpoint holds tensors and plain containers only, so a foreign
  file cannot execute code; Lightning's own resume (`Trainer.fit(ckpt_path=...)`) loads through this plugin.
"""
from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_current_umask()  # what open() would give: mkstemp's files are private (0600)


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
    """torch.save to `path` through a same-directory temporary file and os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    for stale in glob.glob(os.path.join(glob.escape(str(path.parent)), f".{glob.escape(path.name)}.*.tmp")):
        try:  # left by a process killed during an earlier save
            os.unlink(stale)
        except OSError:
            pass


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
