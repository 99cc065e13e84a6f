"""LightningModule: next-token loss, AdamW, warmup + cosine/constant schedule, throughput logging."""
from __future__ import annotations

import math
import random
import time
from typing import Any, Optional

import lightning as L
import torch
import numpy as np
import torch.nn.functional as F

from sinklab.model import ModelConfig, Transformer


class TrainingDiverged(FloatingPointError):
    """The loss or the weights became NaN / inf: training stops; the last good checkpoint is kept."""


def rng_states() -> dict[str, Any]:
    """torch / CUDA / numpy / python RNG states as tensors and plain types (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def lr_lambda(step: int, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup, then cosine decay to min_lr_ratio, or constant."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitLM(L.LightningModule):
    def __init__(self, model: dict[str, Any], optim: dict[str, Any], max_steps: int,
                 peak_flops: Optional[float] = None, debug: Optional[dict[str, Any]] = None):
        super().__init__()
        self.save_hyperparameters(ignore=["debug"])
        self.cfg = ModelConfig.from_dict(dict(model))
        self.model = Transformer(self.cfg)
        if self.cfg.compile:
            self.model = compile_model(self.model, self.cfg)
        self.optim = dict(optim)
        self.max_steps = max_steps
        self.peak_flops = peak_flops
        self._t_last: Optional[float] = None
        # +debug.nan_at_step=N: the gradients of step N become NaN, as in a diverging update (tests the NaN path)
        self.nan_at_step = (debug or {}).get("nan_at_step")

    @property
    def net(self) -> Transformer:
        """The uncompiled model (for measurement and export)."""
        return getattr(self.model, "_orig_mod", self.model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """batch (B, T + 1) -> mean next-token cross-entropy; a prefix-LM skips its first p - 1 targets."""
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.model(x)  # (B, T, V)
        p = self.cfg.prefix_len
        if p > 1:
            y = y.clone()
            y[:, : p - 1] = -100
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        bad = not bool(torch.isfinite(loss))
        if self._trainer is not None and self.trainer.world_size > 1:  # every rank stops at the same step
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            raise TrainingDiverged(
                f"non-finite training loss ({loss.item()}) at step {self.global_step}; training stopped, "
                f"the last good checkpoint is kept{self._last_checkpoint_note()}")
        self.log("train/loss", loss, prog_bar=True)
        now = time.perf_counter()
        if self._t_last is not None:
            world = self.trainer.world_size if self._trainer is not None else 1
            tps = batch.shape[0] * (batch.shape[1] - 1) * world / (now - self._t_last)
            self.log("perf/tokens_per_sec", tps, prog_bar=True)
            if self.peak_flops:
                flops = self.net.flops_per_token(batch.shape[1] - 1) * tps
                self.log("perf/mfu", flops / (self.peak_flops * world))
        self._t_last = now
        return loss

    def _last_checkpoint_note(self) -> str:
        cb = self._trainer.checkpoint_callback if self._trainer is not None else None
        path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
        return f" ({path})" if path else " (none was saved yet)"

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.nan_at_step is not None and self.global_step == self.nan_at_step:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write a diverged state over the last good checkpoint; save the RNG states for exact resumes."""
        bad = next((n for n, p in self.named_parameters() if not torch.isfinite(p).all()), None)
        if bad is not None:
            raise TrainingDiverged(
                f"the weights after step {self.global_step} are not finite ({bad}); training stopped without "
                f"saving them, the last good checkpoint is kept{self._last_checkpoint_note()}")
        checkpoint["sinklab_rng"] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "sinklab_rng" in checkpoint:
            set_rng_states(checkpoint["sinklab_rng"])

    def on_validation_start(self) -> None:
        self._t_last = None

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        o = self.optim
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            exempt = o.get("exclude_norm_and_embedding", False) and (
                p.dim() < 2 or "emb" in name or "sink_tokens" in name or "pos" in name)
            (no_decay if exempt else decay).append(p)
        groups = [{"params": decay, "weight_decay": o["weight_decay"]}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        opt = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o.get("betas", (0.9, 0.95))),
                                eps=o.get("eps", 1e-8), fused=None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(
            s, o.get("warmup_steps", 0), self.max_steps, o.get("schedule", "cosine"), o.get("min_lr_ratio", 0.1)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def compile_model(model: Transformer, cfg: ModelConfig):
    """torch.compile where it works; fall back to eager with one warning."""
    import warnings

    try:
        return torch.compile(model, dynamic=False)
    except Exception as err:  # pragma: no cover - depends on the platform's compiler
        warnings.warn(f"model.compile=true: torch.compile is unavailable here ({err}); running eager")
        return model
