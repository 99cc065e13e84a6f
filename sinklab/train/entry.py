"""sinklab-train: the Hydra entry point. Compose config -> validate -> data -> model -> Trainer.fit."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from sinklab.config import CONF_DIR, UserError, validate_config

log = logging.getLogger("sinklab")


def resolve_ckpt_path(ckpt_path: Optional[str], output_dir: Path) -> Optional[str]:
    """null | last (must exist) | auto (last if it exists, for requeued jobs) | a path."""
    if ckpt_path in (None, "", "null"):
        return None
    last = output_dir / "checkpoints" / "last.ckpt"
    if ckpt_path == "auto":
        return str(last) if last.exists() else None
    if ckpt_path == "last":
        if not last.exists():
            raise UserError(f"ckpt_path=last: no checkpoint at {last}; run once without ckpt_path or set "
                            "paths.output_dir to the run to resume")
        return str(last)
    if not Path(ckpt_path).is_file():
        raise UserError(f"ckpt_path={ckpt_path}: no such file; allowed: null, last, auto or a .ckpt path")
    return ckpt_path


def output_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.output_dir)


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def setup_wandb_mode(cfg: DictConfig) -> None:
    """wandb goes offline when no API key is available, instead of failing at init."""
    if "wandb" not in (cfg.get("logger") or {}) or os.environ.get("WANDB_MODE"):
        return
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    if not has_key:
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key found, logging offline (sync later with `wandb sync`)")


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train one model from a composed config; returns the final metrics."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from sinklab.train.callbacks import StatusFile
    from sinklab.train.module import LitLM

    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning prints to the console itself
        logging.getLogger(name).propagate = False
    out = output_dir_of(cfg)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.update(cfg, "paths.output_dir", str(out), force_add=True)
    validate_config(cfg)  # before any data is loaded
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), out)
    L.seed_everything(cfg.seed, workers=True)
    setup_wandb_mode(cfg)

    dm = instantiate(cfg.data, _recursive_=False)
    dm.prepare()
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if model_cfg["vocab_size"] != dm.vocab_size:
        model_cfg["vocab_size"] = dm.vocab_size
    module = LitLM(model=model_cfg, optim=OmegaConf.to_container(cfg.optim, resolve=True),
                   max_steps=cfg.trainer.max_steps, peak_flops=cfg.get("peak_flops"))
    log.info("model: %.2fM non-embedding parameters; data: %s", module.net.num_params() / 1e6, dm.describe())

    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    run_config = OmegaConf.to_container(cfg, resolve=True)  # swept keys, data, seed: all visible in wandb
    for lg in loggers:
        lg.log_hyperparams({k: v for k, v in run_config.items() if k not in ("logger", "callbacks", "hydra")})
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    if tcfg.get("precision") == "auto":
        tcfg["precision"] = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    trainer: L.Trainer = instantiate(tcfg, callbacks=callbacks, logger=loggers)
    status = next((c for c in callbacks if isinstance(c, StatusFile)), None)

    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    sink = next((c for c in callbacks if hasattr(c, "last") and hasattr(c, "measure")), None)
    if sink is not None:
        final.update({k: v for k, v in sink.last.items() if "/layer" not in k})
    if trainer.is_global_zero:
        if status is not None:
            status.write(trainer, "completed", final=final)
        msg = f"done: {trainer.global_step} steps"
        if "val/loss" in final:
            msg += f", val/loss {final['val/loss']:.4f}"
        if "sink/sink1" in final:
            msg += f", Sink_1 {final['sink/sink1']:.2f}% (alpha_1 {final.get('sink/alpha1', float('nan')):.3f})"
        print(msg + f"\nrun dir: {out}", flush=True)
    return final


def finish_wandb() -> None:
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> Optional[float]:
    try:
        final = train(cfg)
        return final.get("val/loss")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        if is_multirun():
            mark_failed(cfg, err)
            return None
        sys.exit(2)
    except Exception as err:
        mark_failed(cfg, err)
        if is_multirun():  # the other jobs of the sweep go on; the report shows this one as failed
            log.exception("job failed: %s", err)
            return None
        raise
    finally:
        finish_wandb()


def mark_failed(cfg: DictConfig, err: BaseException) -> None:
    """status.json = failed, even when the failure came before the Trainer existed."""
    import json
    import time

    try:
        path = output_dir_of(cfg) / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({"status": "failed", "error": f"{type(err).__name__}: {err}".splitlines()[0],
                                    "step": old.get("step", 0), "final": old.get("final", {}), "time": time.time()},
                                   indent=1))
    except OSError:
        pass


if __name__ == "__main__":
    main()
