"""Which checkpoint a run resumes from: `ckpt_path` (null, last, auto or a path) and Lightning's SLURM requeue
checkpoints."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from sinklab.errors import UserError

log = logging.getLogger("sinklab")


def resolve_ckpt_path(ckpt_path: Optional[str], output_dir: Path) -> Optional[str]:
    """null | last (must exist) | auto (the latest checkpoint if there is one, for requeued jobs) | a path.

    auto picks, among <output_dir>/checkpoints/last.ckpt and the hpc_ckpt_N.ckpt that Lightning's SLURM
    auto-requeue (SIGUSR1) writes into <output_dir>, the one with the most steps. Under SLURM, Lightning itself
    resumes from an hpc_ckpt_N.ckpt even when ckpt_path is null; it is named explicitly here, so that it is checked
    and metrics.csv is kept like for any other resume."""
    if ckpt_path in (None, "", "null"):
        hpc = hpc_checkpoints(output_dir)
        if hpc and slurm_detected():
            log.info("SLURM: resuming from %s (Lightning's auto-requeue checkpoint)", hpc[-1])
            return str(hpc[-1])
        return None
    last = output_dir / "checkpoints" / "last.ckpt"
    if ckpt_path == "auto":
        candidates = [p for p in (last, *hpc_checkpoints(output_dir)) if p.is_file()]
        if not candidates:
            return None
        steps = {p: checkpoint_step(p) for p in candidates}
        best = max(candidates, key=lambda p: steps[p])  # an unreadable file (-1) only if nothing else exists
        if len(candidates) > 1:
            log.info("ckpt_path=auto: %s (step %d) of %s", best, steps[best],
                     ", ".join(f"{p.name} (step {steps[p]})" for p in candidates))
        return str(best)
    if ckpt_path == "last":
        if not last.exists():
            raise UserError(f"ckpt_path=last: no checkpoint at {last}; run once without ckpt_path or set "
                            "paths.output_dir to the run to resume")
        return str(last)
    if not Path(ckpt_path).is_file():
        raise UserError(f"ckpt_path={ckpt_path}: no such file; allowed: null, last, auto or a .ckpt path")
    return ckpt_path


def hpc_checkpoints(output_dir: Path) -> list[Path]:
    """Lightning's SLURM requeue checkpoints hpc_ckpt_N.ckpt, by N."""
    found = [(int(p.stem.rsplit("_", 1)[1]), p) for p in output_dir.glob("hpc_ckpt_*.ckpt")
             if p.stem.rsplit("_", 1)[1].isdigit()]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The global step of a checkpoint, -1 when it cannot be read (it is reported when it is used)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:
        return -1


def slurm_detected() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()
