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


def check_output_file(flag: str, path: Union[str, os.PathLike], suffixes: tuple[str, ...] = ()) -> Path:
    """An output file a command will write (`--out`, `--plot`, `--csv`, ...), checked before any compute: a file name
    with one of `suffixes` (when given), not a directory, under a directory that exists or can be made (no file in
    the way) and where a file can be written (tried: a file made there and removed). One UserError line naming the
    flag and the path that is in the way."""
    from sinklab.errors import UserError

    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {path}: allowed: a {' or '.join(suffixes)} file name")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; pass a file name")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: cannot write it: {parent} is a file, not a directory")
    try:  # a file made and removed where the output (or the first dir it needs) will go: the real test, root or not
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".sinklab-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write it: {parent} is not writable ({err.strerror or err})") from None
    return path


def stale_temporaries(path: Union[str, os.PathLike]) -> list[Path]:
    """Temporary files that an interrupted `atomic_write(path, ...)` left beside `path`."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))
