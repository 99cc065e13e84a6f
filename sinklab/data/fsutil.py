"""Filesystem helpers shared by the data package (atomic writes are sinklab.io.atomic_write).

Everything the data package leaves on disk (cleaned corpora, tokenizers, token shards, manifests,
probe sets) is written with `atomic_write_*`: write a temporary file in the same directory, fsync it,
then `os.replace` it onto the final name. A process killed at any moment therefore leaves either the
old file or the new one, never half of one. Builders that several processes may run at once (DDP
ranks, two runs sharing a cache) take `locked(path)`, an OS-level lock released when the process dies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from sinklab.io import atomic_write, atomic_write_json  # noqa: F401  (the data package's JSON writer)

from .errors import UserError

DEFAULT_CACHE_DIR = "~/.cache/sinklab"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: `cache_dir` if given, else $SINKLAB_CACHE, else ~/.cache/sinklab."""
    chosen = cache_dir or os.environ.get("SINKLAB_CACHE") or DEFAULT_CACHE_DIR
    path = Path(chosen).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one."""
    atomic_write(path, data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file, naming the file if it is not valid JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); delete it to rebuild") from e


@contextmanager
def locked(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (blocks while another process holds it)."""
    lock_path = Path(str(path) + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):
        yield


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def hash_strings(*parts: str) -> str:
    """A stable hex digest of a sequence of strings (used to build cache keys)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def safe_name(text: str, limit: int) -> str:
    """`text` as a file-name part: runs of characters other than letters, digits and `_.-` become `_`, at most
    `limit` characters."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:limit]
