"""sinklab-train: the Hydra entry point. Compose the config -> instantiate data, model, callbacks, loggers and the
Trainer -> fit -> summary.

Around the recipe, each in its own module: the config's schemas and one-line errors (sinklab.config,
sinklab.train.config), fault tolerance: which checkpoint to resume, pre-emption, requeue and metrics.csv across a resume
(fault.py), a job's exit code and failure status (jobs.py), wandb names and offline mode (wandb_setup.py).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from sinklab.config import CONF_DIR, check_devices, validate_config
from sinklab.config.messages import instantiate_user
from sinklab.errors import UserError
from sinklab.evals import EVALUATIONS
from sinklab.train.jobs import log_failure, run_job
from sinklab.train.record import RunRecord
from sinklab.train.runtime import group_choices, output_dir_of
from sinklab.train.summary import summary
from sinklab.train.wandb_setup import check_wandb_installed, set_wandb_names, setup_wandb_mode

log = logging.getLogger("sinklab")


def train(cfg: DictConfig, record: Optional[RunRecord] = None) -> dict[str, Any]:
    """Train one model from a composed config; returns the final metrics. Every check that can refuse the command
    runs before `record.accept()` writes the run's record (.hydra/) and before anything else is written into the run
    dir, so a refused command leaves an existing run as it was."""
    import lightning as L
    import torch

    from sinklab.runs.checkpoints import (check_same_model, copy_weights, read_training_checkpoint,
                                          warm_start_checkpoint)
    from sinklab.data.config import build_data_module
    from sinklab.runs.run_data import is_sweep_dir, matching_job
    from sinklab.train.checkpoint_io import AtomicCheckpointIO
    from sinklab.train.fault import Preempted, continue_metrics, resolve_ckpt_path, slurm_plugins
    from sinklab.plugins import load_plugins
    from sinklab.train.module import LitLM

    load_plugins()  # a job started by a launcher: the plugins its SINKLAB_PLUGINS names
    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning prints to the console itself
        logging.getLogger(name).propagate = False
    out = output_dir_of(cfg)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.update(cfg, "paths.output_dir", str(out), force_add=True)
    # the whole config, and the model's, once, before any data is loaded (the preset's claims: against the
    # evaluations' columns)
    model_cfg = validate_config(cfg, EVALUATIONS)
    check_devices(cfg)
    check_wandb_installed(cfg)
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), out)
    resume = read_training_checkpoint(ckpt) if ckpt else None  # a truncated or foreign file: one clear line
    resume_step = int(resume["global_step"]) if resume else None
    init_from = cfg.get("init_from")  # a warm start: weights only, before a resume it does not apply
    warm = None
    if init_from and resume is None:
        if is_sweep_dir(init_from):  # the first stage's job with this job's settings
            init_from, settings = matching_job(init_from, cfg, group_choices())
            log.info("init_from: %s, the job with %s", init_from, ", ".join(f"{k}={v}" for k, v in settings.items()))
        data = OmegaConf.to_container(cfg.data, resolve=True)
        warm = warm_start_checkpoint(init_from, model_cfg.to_dict(), data)  # before any data is read
    # a retrofit's added parameters (their own lr; maybe the only ones trained): the warm start's, or a resume's
    new_params = warm.new_params if warm is not None else \
        (resume["hyper_parameters"].get("new_params") or [] if resume is not None else [])
    check_frozen(cfg, new_params)
    L.seed_everything(cfg.seed, workers=True)
    setup_wandb_mode(cfg)

    dm = build_data_module(cfg.data)
    dm.prepare()
    if hasattr(dm, "val_bytes_per_token"):  # val/bpb's bytes, decoded once: a tokenizer not decoding to UTF-8 is
        dm.val_bytes_per_token(None, model_cfg.prefix_len)  # refused here, before the model is built
    model_cfg.vocab_size = dm.vocab_size  # the data's (padded); the logged run config records it too
    OmegaConf.update(cfg, "model.vocab_size", dm.vocab_size)
    if resume is not None:
        check_same_model(resume, model_cfg.to_dict(), ckpt)
        log.info("resuming from %s (step %d)", ckpt, resume_step)
    del resume
    module = LitLM(model=model_cfg, optim=OmegaConf.to_container(cfg.optim, resolve=True, enum_to_str=True),
                   max_steps=cfg.trainer.max_steps, peak_flops=cfg.get("peak_flops"),
                   compile_backend=cfg.get("compile_backend") or "inductor", new_params=new_params)
    log.info("model: %.2fM non-embedding parameters; data: %s", module.net.num_params() / 1e6, dm.describe())
    if warm is not None:
        grown = copy_weights(module.net, warm, init_from)
        log.info("init_from=%s: weights of step %s copied%s; the optimizer and the schedule start fresh", init_from,
                 warm.ckpt.get("global_step"), f" ({', '.join(grown)}: the new ids' rows initialised)" if grown else "")
        if warm.additions:
            log.info("init_from=%s: a retrofit, this config adds %s; %d new parameter tensor(s), trained at %g x "
                     "optim.lr%s", init_from, ", ".join(map(str, warm.additions)), len(new_params),
                     module.optim.get("new_lr_scale", 1.0), frozen_note(module.optim))
        del warm
    elif init_from:
        log.info("init_from=%s ignored: the run resumes from %s", init_from, ckpt)

    callbacks = [instantiate_user(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar it was told not to show
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.ProgressBar)]
    set_wandb_names(cfg)
    loggers = [instantiate_user(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    if tcfg.get("precision") == "auto":
        tcfg["precision"] = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    plugins = slurm_plugins(tcfg.pop("plugins", None) or []) + [AtomicCheckpointIO()]  # no Lightning requeue
    trainer: L.Trainer = instantiate_user(tcfg, callbacks=callbacks, logger=loggers, plugins=plugins)

    if record is not None:
        record.accept()  # accepted: the run's record, then its metrics, checkpoints and status
    continue_metrics(loggers, resume_step)  # metrics.csv: the rows before the checkpoint's step go on
    run_config = OmegaConf.to_container(cfg, resolve=True)  # swept keys, data, seed: all visible in wandb
    for lg in loggers:
        lg.log_hyperparams({k: v for k, v in run_config.items() if k not in ("logger", "callbacks", "hydra")})

    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)
    except Exception as err:
        if not isinstance(err, Preempted):
            log_failure(trainer)
        raise
    return summary(trainer, callbacks, out)


def check_frozen(cfg: DictConfig, new_params: list[str]) -> None:
    """optim.freeze_pretrained trains a retrofit's added parameters only: refused in one line when there are none."""
    if OmegaConf.select(cfg, "optim.freeze_pretrained") and not new_params:
        raise UserError("optim.freeze_pretrained=true trains only the parameters a retrofit adds, and this run has "
                        "none (no init_from, or its model config adds no component with parameters to the "
                        "checkpoint's); allowed: optim.freeze_pretrained=false, or init_from=RUN with a model "
                        "config that adds a component such as model.gate")


def frozen_note(optim: dict[str, Any]) -> str:
    """'; the copied ones frozen (...)' for the log line of a retrofit."""
    if not optim.get("freeze_pretrained"):
        return ", the copied ones at optim.lr"
    steps = optim.get("freeze_pretrained_steps")
    return "; the copied ones frozen" + (f" for the first {steps} steps" if steps else " (the whole run)")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> Optional[float]:
    return run_job(cfg, train)


def main() -> None:
    """`sinklab-train`: Hydra's own errors before any job runs (an unknown key, an unknown config in a group, an
    override that does not parse) are one line and exit 2, like every other user error. HYDRA_FULL_ERROR=1 shows
    Hydra's full report instead."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from sinklab.config import hydra_error_message, register_configs
    from sinklab.plugins import PluginImportError, show_import_failure, use_from_command_line

    try:
        sys.argv[1:] = use_from_command_line(sys.argv[1:])  # plugins=..., before the schemas are stored
        register_configs()
    except UserError as err:  # a plugin that cannot be imported, or whose option or knob clashes with sinklab's
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except PluginImportError as err:  # a plugin that raised while imported: named, then its own traceback
        show_import_failure("sinklab-train", err)
        sys.exit(1)
    if os.environ.get("HYDRA_FULL_ERROR"):
        hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its multi-line report and exiting
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as err:
        if getattr(err, "_sinklab_in_job", False):
            raise
        print(f"error: {hydra_error_message(err)}", file=sys.stderr)
        sys.exit(2)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    main()
