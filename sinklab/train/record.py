"""A run's record (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`), written by sinklab-train once the run is
accepted, not when the command starts.

Hydra writes these three files before the task function runs (`hydra.output_subdir`). A command refused after that (a
bad value, a missing file, another architecture to resume) would have replaced an existing run's record with a config
that never trained, and every later reader of the run (`measure`, the evaluations, `report`, `init_from`) would read
it. So conf/hydra/default.yaml sets `hydra.output_subdir: null`, and `RunRecord` writes the same files, with what
Hydra would have written, when training is about to start (`accept`). A refused job of a sweep in a new job dir still
gets its record (`refused`: the report lists it as failed, with its settings); a dir that already held a run keeps
every file as it was.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from sinklab.io import atomic_write
from sinklab.runs.run_data import RUN_CONFIG, is_run_dir
from sinklab.train.runtime import is_multirun, output_dir_of


class RunRecord:
    """What Hydra would have saved for this job, captured when the job starts (before training changes `cfg`)."""

    def __init__(self, cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        self.hydra: Optional[DictConfig] = copy.deepcopy(HydraConfig.instance().cfg) if HydraConfig.initialized() \
            else None
        self.cfg = copy.deepcopy(cfg)
        self.run_dir = output_dir_of(cfg)
        self.existed = is_run_dir(self.run_dir)  # the dir holds a run's record already (a resume, or a rerun there)
        self.written = False

    def accept(self) -> None:
        """The run is accepted: write its record (outside Hydra, a config composed in Python: nothing to write)."""
        if self.hydra is None or self.written:
            return
        hydra: Any = OmegaConf.create(OmegaConf.to_container(self.hydra, resolve=False))  # plain, writable
        hydra.hydra.output_subdir = str(RUN_CONFIG.parent)  # where the record is, as Hydra would say
        where = self.run_dir / RUN_CONFIG.parent
        for name, node in (("config.yaml", self.cfg), ("hydra.yaml", hydra),
                           ("overrides.yaml", hydra.hydra.overrides.task)):
            atomic_write(where / name, OmegaConf.to_yaml(node))
        self.written = True

    def refused(self) -> bool:
        """The job was refused or failed before training started: a new job dir of a sweep gets its record (so the
        report shows the job); a dir that held a run is left as it was. Returns whether the dir may be written
        (status.json)."""
        if self.existed:
            return False
        if is_multirun():
            self.accept()
        return True
