"""Loading sinklab checkpoints safely: no code from the file is run (weights_only), clear errors otherwise."""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from sinklab.errors import UserError
from sinklab.model import ModelConfig, Transformer


def find_checkpoint(path: Union[str, Path]) -> Path:
    """A .ckpt file, or a run dir -> its checkpoints/last.ckpt."""
    p = Path(path)
    if p.is_dir():
        last = p / "checkpoints" / "last.ckpt"
        if not last.exists():
            raise UserError(f"{p} is a directory without checkpoints/last.ckpt; pass a run dir or a .ckpt file")
        return last
    if not p.is_file():
        raise UserError(f"checkpoint {p} does not exist")
    return p


def read_checkpoint(path: Union[str, Path]) -> dict:
    """torch.load with weights_only=True; truncated or foreign files are refused with the file's name."""
    p = find_checkpoint(path)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"{p} is not a readable sinklab checkpoint ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200]})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model" not in ckpt.get("hyper_parameters", {}):
        raise UserError(f"{p} is not a sinklab checkpoint (no state_dict / model hyper-parameters)")
    return ckpt


def load_model(path: Union[str, Path]) -> Transformer:
    ckpt = read_checkpoint(path)
    cfg = ModelConfig.from_dict(dict(ckpt["hyper_parameters"]["model"]))
    model = Transformer(cfg)
    prefix = "model."
    state = {}
    for k, v in ckpt["state_dict"].items():
        if k.startswith(prefix):
            k = k[len(prefix):]
            state[k.replace("_orig_mod.", "")] = v
    model.load_state_dict(state)
    return model.eval()
