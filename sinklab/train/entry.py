"""sinklab-train: the Hydra entry point. Compose config -> validate -> data -> model -> Trainer.fit."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from sinklab.config import CONF_DIR, UserError, built, check_devices, validate_config

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


def instantiate_user(node: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with the user errors of a target's constructor (ours: UserError; Lightning's:
    MisconfigurationException) reported as themselves instead of inside Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, MisconfigurationException):
            target = node.get("_target_") if hasattr(node, "get") else None
            raise UserError(f"{target}: {one_line(cause)}") from None
        raise


def one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train one model from a composed config; returns the final metrics."""
    import lightning as L
    import torch

    from sinklab.checkpoint import check_same_model, read_training_checkpoint
    from sinklab.train.callbacks import Preempted, StatusFile
    from sinklab.train.checkpoint_io import AtomicCheckpointIO
    from sinklab.train.module import LitLM

    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning prints to the console itself
        logging.getLogger(name).propagate = False
    out = output_dir_of(cfg)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.update(cfg, "paths.output_dir", str(out), force_add=True)
    validate_config(cfg)  # before any data is loaded
    check_devices(cfg)
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), out)
    resume = read_training_checkpoint(ckpt) if ckpt else None  # a truncated or foreign file: one clear line
    resume_step = int(resume["global_step"]) if resume else None
    L.seed_everything(cfg.seed, workers=True)
    setup_wandb_mode(cfg)

    dm = instantiate_user(cfg.data, _recursive_=False)
    dm.prepare()
    OmegaConf.update(cfg, "model.vocab_size", dm.vocab_size)  # the data's, padded: the saved config records it
    model_cfg = built(cfg, "model")
    if resume is not None:
        check_same_model(resume, model_cfg.to_dict(), ckpt)
        log.info("resuming from %s (step %d)", ckpt, resume_step)
    del resume
    debug = OmegaConf.to_container(cfg.debug, resolve=True) if cfg.get("debug") else None
    module = LitLM(model=model_cfg, optim=OmegaConf.to_container(cfg.optim, resolve=True, enum_to_str=True),
                   max_steps=cfg.trainer.max_steps, peak_flops=cfg.get("peak_flops"), debug=debug,
                   compile_backend=cfg.get("compile_backend") or "inductor")
    log.info("model: %.2fM non-embedding parameters; data: %s", module.net.num_params() / 1e6, dm.describe())

    callbacks = [instantiate_user(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    set_wandb_names(cfg)
    loggers = [instantiate_user(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    for lg in loggers:
        if hasattr(lg, "resume_from_step"):  # ResumableCSVLogger: keep the rows before the checkpoint's step
            lg.resume_from_step(resume_step)
    run_config = OmegaConf.to_container(cfg, resolve=True)  # swept keys, data, seed: all visible in wandb
    for lg in loggers:
        lg.log_hyperparams({k: v for k, v in run_config.items() if k not in ("logger", "callbacks", "hydra")})
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    if tcfg.get("precision") == "auto":
        tcfg["precision"] = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    plugins = list(tcfg.pop("plugins", None) or []) + [AtomicCheckpointIO()]
    trainer: L.Trainer = instantiate_user(tcfg, callbacks=callbacks, logger=loggers, plugins=plugins)
    status = next((c for c in callbacks if isinstance(c, StatusFile)), None)

    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)
    except Exception as err:
        if not isinstance(err, Preempted):
            log_failure(trainer)
        raise
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    sink = next((c for c in callbacks if hasattr(c, "last") and hasattr(c, "measure")), None)
    if sink is not None:
        final.update({k: v for k, v in sink.last.items() if "/layer" not in k})
    # with ddp_spawn this process's trainer did not run the loop (global_step 0); a completed fit ran max_steps
    steps = trainer.global_step or trainer.max_steps
    if trainer.is_global_zero:
        if status is not None:
            status.write(trainer, "completed", final=final, step=steps)
        msg = f"done: {steps} steps"
        if "val/loss" in final:
            msg += f", val/loss {final['val/loss']:.4f}"
        if "sink/sink1" in final:
            msg += f", Sink_1 {final['sink/sink1']:.2f}% (alpha_1 {final.get('sink/alpha1', float('nan')):.3f})"
        print(msg + f"\nrun dir: {out}", flush=True)
    return final


def log_failure(trainer: Any) -> None:
    """A failed run is marked failed in its metrics too: one row `run/failed=1` at the step it stopped (metrics.csv;
    wandb: a run/failed chart and summary). Written to the loggers this process has written to; with ddp_spawn the
    training processes held them, and the failure is in status.json only."""
    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if getattr(lg, "_experiment", None) is None:
            continue
        try:
            lg.log_metrics({"run/failed": 1.0}, step=trainer.global_step)
            lg.save()
        except Exception as log_err:  # the failure being reported matters more than its metric row
            log.warning("could not log run/failed to %s: %s", type(lg).__name__, one_line(log_err))


def wandb_group(cfg: DictConfig) -> str:
    """<experiment.name>-<sweep time> for the jobs of a multirun: the sweep dir's name, the same for every job and
    for requeued jobs (e.g. weight_decay-2026-11-22_10-00-00); <experiment.name>-<run time> for a single run (the
    time Hydra put in the default run dir's name)."""
    from hydra.core.hydra_config import HydraConfig

    name = OmegaConf.select(cfg, "experiment.name", default=None) or "default"
    if is_multirun():
        stamp = Path(HydraConfig.get().sweep.dir).name
    else:  # Hydra resolves ${now:...} once per run; a node under cfg shares that resolution
        stamp = OmegaConf.create({"t": "${now:%Y-%m-%d_%H-%M-%S}"}, parent=cfg).t
    return f"{name}-{stamp}"


def wandb_run_name() -> Optional[str]:
    """This job's command-line overrides as Hydra writes them in override_dirname (e.g.
    `experiment=weight_decay,optim.weight_decay=5.0`), so the runs of a group are told apart by what was set; None
    outside Hydra or with no overrides (wandb then picks a name)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().job.override_dirname or None


def set_wandb_names(cfg: DictConfig) -> None:
    """logger.wandb.group=null (the default): the group of wandb_group(cfg); logger.wandb.name=null: the run name of
    wandb_run_name()."""
    for key, node in (cfg.get("logger") or {}).items():
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith("WandbLogger"):
            if node.get("group") is None:
                OmegaConf.update(cfg, f"logger.{key}.group", wandb_group(cfg), force_add=True)
            if node.get("name") is None:
                OmegaConf.update(cfg, f"logger.{key}.name", wandb_run_name(), force_add=True)


def finish_wandb(exit_code: int = 0) -> None:
    """Close this job's wandb run (each multirun job is its own run); exit_code=1 marks it failed in wandb."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


def run_job(cfg: DictConfig) -> Optional[float]:
    """One job: train, and turn its failures into a status and an exit code.

    user error (config, data, checkpoint)  one line "error: ...", exit 2; multirun: status failed, next job
    NaN / inf loss or weights             one line "error: ...", status failed, exit 1; multirun: next job
    pre-emption signal                     last.ckpt saved, status preempted, the signal's previous handler
                                           (submitit's requeue) runs, exit 128 + signal number
    anything else (a bug)                  status failed and the full traceback; multirun: logged, next job
    """
    from sinklab.train.callbacks import Preempted
    from sinklab.train.module import TrainingDiverged

    exit_code = 1  # for wandb: failed unless training completes (or is pre-empted)
    try:
        try:
            final = train(cfg)
        except Exception as err:
            converted = worker_error(err)
            if converted is err:
                raise
            raise converted from err
        exit_code = 0
        return final.get("val/loss")
    except UserError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        if is_multirun():
            mark_status(cfg, "failed", err)
            return None
        sys.exit(2)
    except TrainingDiverged as err:
        mark_status(cfg, "failed", err)
        print(f"error: {one_line(err)}", file=sys.stderr)
        if is_multirun():
            return None
        sys.exit(1)
    except Preempted as err:
        mark_status(cfg, "preempted", err, step=err.step)
        print(f"preempted: {one_line(err)}", file=sys.stderr, flush=True)
        exit_code = 0
        finish_wandb()
        pass_signal_on(err.signum)
        sys.exit(128 + err.signum)
    except Exception as err:
        mark_status(cfg, "failed", err)
        if is_multirun():  # the other jobs of the sweep go on; the report shows this one as failed
            log.exception("job failed: %s", err)
            return None
        err._sinklab_in_job = True  # a bug: main() lets the traceback through
        raise
    finally:
        finish_wandb(exit_code)


def worker_error(err: Exception) -> Exception:
    """With ddp_spawn, an error in a training process reaches this one as ProcessRaisedException holding the
    worker's traceback as text: rebuild a user error or a divergence from its last line, so that it is reported like
    in a single process. Anything else is returned as it is."""
    import re

    if type(err).__name__ != "ProcessRaisedException":
        return err
    from hydra.utils import get_class

    from sinklab.train.module import TrainingDiverged

    last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    match = re.match(r"^([A-Za-z_][\w.]*): (.*)$", last)
    if not match:
        return err
    try:
        kind = get_class(match.group(1))
    except Exception:
        return err
    if issubclass(kind, (UserError, TrainingDiverged)):
        return (TrainingDiverged if issubclass(kind, TrainingDiverged) else UserError)(match.group(2))
    return err


def pass_signal_on(signum: int) -> None:
    """Run the handler that was installed before training (e.g. submitit's checkpoint-and-requeue on SIGUSR2)."""
    import signal

    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, None)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> Optional[float]:
    return run_job(cfg)


def main() -> None:
    """`sinklab-train`: Hydra's own errors before any job runs (an unknown key, an unknown config in a group, an
    override that does not parse) are one line and exit 2, like every other user error. HYDRA_FULL_ERROR=1 shows
    Hydra's full report instead."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from sinklab.config import register_configs

    register_configs()
    if os.environ.get("HYDRA_FULL_ERROR"):
        hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its multi-line report and exiting
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as err:
        if getattr(err, "_sinklab_in_job", False):
            raise
        from sinklab.config import hydra_error_message

        print(f"error: {hydra_error_message(err)}", file=sys.stderr)
        sys.exit(2)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def mark_status(cfg: DictConfig, status: str, err: BaseException, step: Optional[int] = None) -> None:
    """status.json = failed / preempted, even when the failure came before the Trainer existed."""
    import json
    import time

    try:
        path = output_dir_of(cfg) / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.exists() else {}
        data = {"status": status, "error": f"{type(err).__name__}: {one_line(err)}",
                "step": old.get("step", 0) if step is None else step, "final": old.get("final", {}),
                "time": time.time()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
