"""What a run dir says about its data, read through the data config it was trained with (`.hydra/config.yaml`): the
run dir of a checkpoint, the probe set, the validation blocks. Read by the sinklab target (`sinklab.targets.native`)
and the evaluations."""
from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Callable, Optional

import torch

from sinklab.errors import UserError


def run_dir_of(ckpt: Path) -> Optional[Path]:
    """The training run dir (holding .hydra/config.yaml) of a checkpoint, if there is one: RUN/checkpoints/last.ckpt
    and RUN/checkpoints/kept/*.ckpt belong to RUN."""
    for d in (ckpt.parent, ckpt.parent.parent, ckpt.parent.parent.parent):
        if (d / ".hydra" / "config.yaml").is_file():
            return d
    return None


def checkpoint_and_run_dir(target: str) -> tuple[Path, Optional[Path]]:
    """TARGET (a .ckpt or a run dir) -> its checkpoint and the training run dir it belongs to (None for a bare
    checkpoint)."""
    from sinklab.runs.checkpoints import find_checkpoint

    path = Path(target)
    if not path.exists():
        raise UserError(f"TARGET {target}: no such checkpoint or run dir")
    ckpt = find_checkpoint(path)
    config = path / ".hydra" / "config.yaml"
    return ckpt, path if path.is_dir() and config.is_file() else run_dir_of(ckpt)


def read_run_data(run_dir: Path, overrides: dict, read: Callable, flag: str, what: str, hint: str):
    """read(dm) of the run's data module, instantiate(cfg.data) with data.* `overrides`, prepared. Every failure is
    one UserError starting with `flag` and ending with `hint` (what to pass instead)."""
    from omegaconf import OmegaConf

    cfg_path = run_dir / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(cfg_path)
    if "data" not in cfg or cfg.data is None:
        raise UserError(f"{flag}: {cfg_path} has no data section; {hint}")
    try:
        from sinklab.data import LMDataModule  # noqa: F401
    except ImportError as err:
        raise UserError(f"{flag}: the data module is not available ({err}); {hint}") from None
    from hydra.utils import instantiate

    data = cfg.data
    for key, value in overrides.items():
        if value is not None:
            OmegaConf.update(data, key, value, force_add=True)
    try:
        dm = instantiate(data, _recursive_=False)
        dm.prepare()
        return read(dm)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{flag}: cannot read {what} of {run_dir} ({type(err).__name__}: {first}); {hint}") from None


def probe_tokens(run_dir: Path, num_seqs: Optional[int], seq_len: Optional[int]) -> torch.Tensor:
    """The run's probe set through its data config: instantiate(cfg.data).prepare().probe_tokens().

    --num-seqs / --seq-len set the data module's own probe size (data.probe_num_seqs / data.probe_seq_len), so a
    different size is still the data module's probe set (evenly spaced held-out windows), not a slice of it."""
    tokens = read_run_data(run_dir, {"probe_num_seqs": num_seqs, "probe_seq_len": seq_len},
                           lambda dm: torch.as_tensor(dm.probe_tokens()).long(), "--input natural", "the probe set",
                           "pass --tokens or --input random|repeat")
    if tokens.ndim != 2 or (num_seqs is not None and tokens.shape[0] != num_seqs) or \
            (seq_len is not None and tokens.shape[1] != seq_len):
        raise UserError(f"--input natural: the data module returned a probe set of shape {tuple(tokens.shape)}, "
                        f"asked for ({num_seqs}, {seq_len})")
    return tokens


def val_blocks(dm, n_batches: Optional[int]) -> list[torch.Tensor]:
    """The run's first `n_batches` validation batches (B, T + 1) (all with None), as the training validated on them:
    the data module's (LMDataModule.val_dataloader: the BOS token first when data.bos, as in every training block)."""
    return list(islice(dm.val_dataloader(), n_batches))
