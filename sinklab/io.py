"""Writing files so that a reader (or a process killed mid-write) sees the old file or the whole new one.

`atomic_write` is the one implementation: a temporary file in the target's own directory, fsync, `os.replace`.
Checkpoints, metrics.csv, status.json, caches and reports all go through it.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Union

_UMASK = os.umask(0)
os.umask(_UMASK)

Content = Union[bytes, str, Callable[[BinaryIO], None]]


def atomic_write(path: Union[str, os.PathLike], content: Content) -> Path:
    """Write `content` (bytes, text as UTF-8, or a callable that writes into a binary file) to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; caches and run dirs may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: Union[str, os.PathLike], obj: Any, indent: int = 2) -> Path:
    return atomic_write(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def stale_temporaries(path: Union[str, os.PathLike]) -> list[Path]:
    """Temporary files that an interrupted `atomic_write(path, ...)` left beside `path`."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))
