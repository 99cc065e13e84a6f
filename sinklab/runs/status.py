"""The state of a run, as written to `<run>/status.json` by training and read by `sinklab report`."""
from __future__ import annotations

import json
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

from sinklab.io import atomic_write_json


class Status(str, Enum):
    """What status.json says (the first four), and what `sinklab report` infers for a job without a live writer."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"  # saved last.ckpt on a signal; a requeued job resumes it
    STALLED = "stalled"  # status.json says running, but nothing in the run dir changed for a long time
    KILLED = "killed"  # metrics but no status.json, and nothing changed for a long time
    PENDING = "pending"  # a job dir with nothing written yet
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    @property
    def failed(self) -> bool:
        return self in (Status.FAILED, Status.KILLED, Status.STALLED)

    @property
    def active(self) -> bool:
        return self in (Status.RUNNING, Status.PENDING)


def write_status(path: Union[str, os.PathLike], status: Status, *, error: Optional[str] = None,
                 step: Optional[int] = None, final: Optional[dict[str, float]] = None) -> None:
    """Write status.json atomically; `step` and `final` default to what the file already holds."""
    path = Path(path)
    old = read_status(path) or {}
    atomic_write_json(path, {"status": Status(status).value, "error": error,
                             "step": old.get("step", 0) if step is None else int(step),
                             "final": old.get("final", {}) if final is None else final, "time": time.time()})


def read_status(path: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """status.json as a dict (its `status` a Status), None when absent or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
        data["status"] = Status(data.get("status", "unknown"))
        return data
    except (OSError, ValueError, AttributeError):
        return None
