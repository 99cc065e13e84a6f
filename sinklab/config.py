"""Where the Hydra configs live, composing them from Python, and validation before any compute is spent."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from sinklab.errors import UserError
from sinklab.model.config import ModelConfig

CONF_DIR = Path(os.environ.get("SINKLAB_CONF", Path(__file__).resolve().parents[1] / "conf"))

__all__ = ["CONF_DIR", "UserError", "compose", "validate_config"]


def compose(overrides: Sequence[str] = (), config_name: str = "train", return_hydra_config: bool = False) -> DictConfig:
    """Compose the training config from Python (tests, notebooks), as `sinklab-train OVERRIDES` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if not (CONF_DIR / f"{config_name}.yaml").exists():
        raise UserError(f"config dir {CONF_DIR} has no {config_name}.yaml; install sinklab from a clone "
                        "(pip install -e .) or set SINKLAB_CONF")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


def _number(cfg: DictConfig, key: str, low: Optional[float] = None, integer: bool = False,
            strict_low: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise UserError(f"{key}={value!r} must be {kind}")
    if low is not None and (value <= low if strict_low else value < low):
        raise UserError(f"{key}={value!r} must be {'>' if strict_low else '>='} {low}")


def validate_config(cfg: DictConfig) -> ModelConfig:
    """Refuse bad training configs with one line naming the key, the value and what is allowed."""
    try:
        model = OmegaConf.to_container(cfg.model, resolve=True)
    except Exception as err:  # an interpolation that does not resolve
        raise UserError(f"model config does not resolve: {err}") from None
    mcfg = ModelConfig.from_dict(model)
    _number(cfg, "optim.lr", 0, strict_low=True)
    _number(cfg, "optim.weight_decay", 0)
    _number(cfg, "trainer.max_steps", 1, integer=True)
    _number(cfg, "seed", 0, integer=True)
    schedule = OmegaConf.select(cfg, "optim.schedule")
    if schedule not in ("cosine", "constant"):
        raise UserError(f"optim.schedule={schedule!r} is not supported; allowed: cosine, constant")
    block = OmegaConf.select(cfg, "data.block_size")
    if isinstance(block, int) and block > mcfg.block_size:
        raise UserError(f"data.block_size={block} exceeds the model context model.block_size={mcfg.block_size}")
    return mcfg
