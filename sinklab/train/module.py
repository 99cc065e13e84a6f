"""LightningModule: next-token loss, AdamW, warmup + cosine/constant schedule, throughput logging."""
from __future__ import annotations

import logging
import random
import time
import warnings
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import Throughput

from sinklab import plugins
from sinklab.keys import AUX_PREFIX, RETRIEVAL_ACCURACY, RETRIEVAL_ANSWER_LOSS, TRAIN_LOSS, VAL_BPB, VAL_LOSS
from sinklab.runs.checkpoints import PLUGINS, TOKENS_SEEN
from sinklab.model.lm_loss import IGNORE, bits_per_byte, next_token_targets
from sinklab.model import ModelConfig, Transformer
from sinklab.model.compile import (CompileFallbackWarning, backward_compiled_with_forward, compile_errors,
                                   compile_model, first_lines)
from sinklab.train.kept import tokens_seen

log = logging.getLogger("sinklab")


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


class LitLM(L.LightningModule):
    """The language model in training. `model`: the architecture (a built ModelConfig, or its dict as a checkpoint
    saves it); `optim`: the optimizer node (conf/optim/, a `_target_` with `_partial_: true`; keys it leaves out take
    sinklab.train.optim.AdamWConfig's defaults), instantiated in configure_optimizers. `new_params`: in a retrofit
    (init_from= a model without a component this config adds), the parameters the checkpoint did not have, which take
    their own lr and may be the only ones trained (the optim keys new_lr_scale, freeze_pretrained); kept with the
    hyper-parameters, so that a resume gives them the same groups."""

    def __init__(self, model: Union[ModelConfig, dict[str, Any]], optim: dict[str, Any], max_steps: int,
                 peak_flops: Union[float, str, None] = None, compile_backend: str = "inductor",
                 new_params: Optional[list[str]] = None):
        super().__init__()
        self.cfg = model if isinstance(model, ModelConfig) else ModelConfig.from_dict(dict(model))
        self.optim = optimizer_config(optim)
        self.new_params = list(new_params or [])
        # plain types only, so that checkpoints load with weights_only=True
        self.save_hyperparameters({"model": self.cfg.to_dict(), "optim": self.optim, "max_steps": max_steps,
                                   "peak_flops": peak_flops, "compile_backend": compile_backend,
                                   **({"new_params": self.new_params} if self.new_params else {})})
        self.model = self.cfg.build()
        if self.optim.get("freeze_pretrained") and self.optim.get("freeze_pretrained_steps") is None:
            new = set(self.new_params)  # frozen for the whole run: before any strategy wraps the model (DDP)
            for name, p in self.model.named_parameters():
                p.requires_grad_(name in new)
        self.example_input_array = torch.zeros(1, self.cfg.block_size, dtype=torch.long)  # FLOPs in the summary
        if self.cfg.compile:
            self.model = compile_model(self.model, self.cfg, compile_backend)
        self.max_steps = max_steps
        # peak dense FLOP/s of one device for perf/mfu: a number, None (no perf/mfu), or "auto" (resolved when
        # training starts, peak_flops_per_device: the datasheet's, else measured, at the training precision)
        self.peak_flops = peak_flops
        # perf/tokens_per_sec and perf/mfu: Lightning's Throughput over a window of two steps (one step's time), made
        # again when training starts, with the peak and the world size
        self.throughput = Throughput(window_size=2)
        self._seen = (0, 0, 0)  # this device's steps, sequences and tokens so far: the running counts Throughput takes
        self.val_bytes_per_token: Optional[float] = None  # of the targets this validation scores (val/bpb)

    @property
    def net(self) -> Transformer:
        """The uncompiled model (for measurement and export)."""
        return getattr(self.model, "_orig_mod", self.model)

    def run_model(self, idx: torch.Tensor) -> torch.Tensor:
        """The model's logits; compiled when model.compile=true. torch.compile is lazy: it compiles at the first
        call (and recompiles for new shapes or modes), so a compilation failure surfaces here, not where
        torch.compile was called. Then one warning names the reason and the rest of the run is eager, from this
        same call on, with the same results (the compiled and the eager model share their parameters)."""
        if self.model is self.net:
            return self.model(idx)
        try:
            with backward_compiled_with_forward():
                return self.model(idx)
        except compile_errors() as err:
            warnings.warn(f"model.compile=true: torch.compile failed ({first_lines(err)}); running eager from now on "
                          "(same results, eager speed)", CompileFallbackWarning, stacklevel=2)
            self.model = self.net
            return self.model(idx)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of the eager model: what Lightning's model summary runs on example_input_array to count FLOPs
        (a compiled model would compile there, under the summary's hooks). Training steps call `run_model`."""
        return self.net(idx)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """batch (B, T + 1) -> mean next-token cross-entropy; a prefix-LM skips its first p - 1 targets."""
        x, y = batch[:, :-1], next_token_targets(batch, self.cfg.prefix_len)
        logits = self.run_model(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)

    def on_fit_start(self) -> None:
        world = self.trainer.world_size if self._trainer is not None else 1
        self.throughput = Throughput(available_flops=self.peak_flops_per_device(), world_size=world, window_size=2)

    def peak_flops_per_device(self) -> Optional[float]:
        """peak_flops as a number (None: no perf/mfu). "auto": the datasheet's FLOP/s of a GPU Lightning knows at the
        training precision's matmul dtype (sinklab.train.throughput.datasheet_peak), else this machine's, measured
        (sinklab.train.throughput.peak_matmul_flops)."""
        if self.peak_flops != "auto":
            return self.peak_flops
        from sinklab.train.throughput import datasheet_peak, matmul_dtype, peak_matmul_flops

        dtype = matmul_dtype(self.trainer.precision if self._trainer is not None else None)
        peak = datasheet_peak(self.device, dtype)
        if peak is not None:
            log.info("peak_flops=auto: %.4g FLOP/s (the datasheet's, %s) for perf/mfu", peak,
                     torch.cuda.get_device_name(self.device))
            return peak
        t0 = time.perf_counter()
        peak = peak_matmul_flops(self.device, dtype)
        log.info("peak_flops=auto: %.4g FLOP/s (%s matmuls on %s, measured in %.2f s) for perf/mfu", peak,
                 str(dtype).replace("torch.", ""), self.device, time.perf_counter() - t0)
        return peak

    def log_throughput(self, batch: torch.Tensor) -> None:
        """perf/tokens_per_sec (every device's) and perf/mfu (one device's FLOP/s / its peak) of the step since the
        previous call: Lightning's Throughput over a window of two calls, so nothing at the first step of training or
        after a validation (on_validation_start empties the window)."""
        B, T = batch.shape[0], batch.shape[1] - 1
        steps, seqs, tokens = self._seen
        self._seen = (steps + 1, seqs + B, tokens + B * T)
        meter = self.throughput
        meter.update(time=time.perf_counter(), batches=steps + 1, samples=seqs + B, lengths=tokens + B * T,
                     flops=self.net.flops_per_token(T) * B * T if meter.available_flops else None)
        rates = meter.compute()
        if "device/items_per_sec" in rates:
            self.log("perf/tokens_per_sec", rates["device/items_per_sec"] * meter.world_size, prog_bar=True)
        if "device/mfu" in rates:
            self.log_mfu(rates["device/mfu"])

    def log_mfu(self, mfu: float) -> None:
        """perf/mfu = achieved / peak FLOP/s, never above 1: a step faster than the peak means the peak was measured
        while the machine was busy, and perf/mfu is dropped for the rest of the run, with one warning."""
        if mfu <= 1.0:
            self.log("perf/mfu", mfu)
            return
        peak = self.throughput.available_flops
        warnings.warn(f"perf/mfu dropped: a step ran at {mfu * peak:.3g} FLOP/s, above the peak {peak:.3g} "
                      f"(peak_flops={self.peak_flops}; measured on a busy machine?); set peak_flops to the device's "
                      "datasheet FLOP/s to log it", PeakFlopsWarning, stacklevel=2)
        self.throughput.available_flops = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The next-token loss plus the auxiliary losses the forward's components added (`Transformer.aux_losses`,
        e.g. DSA's indexer KL), each logged as train/aux/<name> and their sum as train/aux/total; train/loss stays the
        next-token loss, comparable across models. The model is told the step first (a warm-up's clock)."""
        self.net.set_step(self.global_step)
        loss = lm_loss = self.loss(batch)
        aux = self.net.aux_losses  # the forward's, just run
        for name, value in aux.items():
            self.log(f"{AUX_PREFIX}{name}", value)
        if aux:
            total = torch.stack(list(aux.values())).sum()
            self.log(f"{AUX_PREFIX}total", total)
            loss = lm_loss + total
        bad = not bool(torch.isfinite(loss))
        if self._trainer is not None and self.trainer.world_size > 1:  # every rank stops at the same step
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            raise TrainingDiverged(
                f"non-finite training loss ({loss.item()}) at step {self.global_step}; training stopped, "
                f"the last good checkpoint is kept{self._last_checkpoint_note()}")
        self.log(TRAIN_LOSS, lm_loss, prog_bar=True)
        self.log_throughput(batch)
        return loss

    def _last_checkpoint_note(self) -> str:
        cb = self._trainer.checkpoint_callback if self._trainer is not None else None
        path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
        return f" ({path})" if path else " (none was saved yet)"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write a diverged state over the last good checkpoint; save the RNG states for exact resumes."""
        bad = next((n for n, p in self.named_parameters() if not torch.isfinite(p).all()), None)
        if bad is not None:
            raise TrainingDiverged(
                f"the weights after step {self.global_step} are not finite ({bad}); training stopped without "
                f"saving them, the last good checkpoint is kept{self._last_checkpoint_note()}")
        checkpoint["sinklab_rng"] = rng_states()
        if self._trainer is not None:  # what `sinklab trajectory` puts the checkpoint at
            checkpoint[TOKENS_SEEN] = tokens_seen(self.trainer)
        if plugins.LOADED:  # the modules of the user's components: loading the checkpoint needs them loaded
            checkpoint[PLUGINS] = list(plugins.LOADED)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "sinklab_rng" in checkpoint:
            set_rng_states(checkpoint["sinklab_rng"])
        # a compiled model's keys are model._orig_mod.*, an eager one's model.*: a run may resume the other kind
        # (model.compile changed, or compilation fell back to eager in one of the two runs)
        compiled = self.model is not self.net
        state = checkpoint.get("state_dict", {})
        checkpoint["state_dict"] = {model_key(k, compiled): v for k, v in state.items()}

    def on_validation_start(self) -> None:
        self.throughput.reset()  # a validation's time is no training step's
        self.val_bytes_per_token = self.validated_bytes_per_token()

    def validated_bytes_per_token(self) -> Optional[float]:
        """The bytes of text per target of the batches this validation scores (the data module's
        `val_bytes_per_token`, decoded once per run), None for a data module without text (synthetic data)."""
        dm = self.trainer.datamodule
        count = getattr(dm, "val_bytes_per_token", None)
        if count is None:
            return None
        n = self.trainer.num_val_batches[0]
        if self.trainer.sanity_checking:
            n = min(n, self.trainer.num_sanity_val_steps)
        return count(int(n), self.cfg.prefix_len)

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        """val/loss, the mean NLL in nats per target, and beside it val/bpb, bits per byte of the validation text:
        val/loss / (ln 2 x the bytes per target of the validated blocks), over the same targets
        (`sinklab.model.lm_loss`, which says what a BOS token and a document separator count). With several
        ranks each is the mean of the ranks' values. A second loader (data.retrieval) holds retrieval samples:
        `retrieval_step`."""
        if dataloader_idx == 1:
            self.retrieval_step(*batch)
            return
        loss = self.loss(batch)
        self.log(VAL_LOSS, loss, prog_bar=True, sync_dist=True, add_dataloader_idx=False)
        if self.val_bytes_per_token is not None:
            self.log(VAL_BPB, bits_per_byte(loss, self.val_bytes_per_token), sync_dist=True, add_dataloader_idx=False)

    def retrieval_step(self, tokens: torch.Tensor, answer: torch.Tensor) -> None:
        """val/retrieval/answer_loss, the NLL in nats per answer token, and val/retrieval/accuracy, the share of
        answer spans predicted exactly, of held-out retrieval samples tokens and answer (B, T + 1)
        (`sinklab.data.retrieval.answer_scores`; a prefix-LM's prefix is not scored). Every sample of a task has
        as many answer tokens and spans, so the mean over batches (and ranks) is the mean over samples."""
        from sinklab.data.retrieval import answer_scores

        scored = next_token_targets(tokens, self.cfg.prefix_len) != IGNORE  # (B, T)
        loss, accuracy = answer_scores(self.run_model(tokens[:, :-1]), tokens, answer, scored)
        for key, value in ((RETRIEVAL_ANSWER_LOSS, loss), (RETRIEVAL_ACCURACY, accuracy)):
            self.log(key, value, sync_dist=True, add_dataloader_idx=False, batch_size=len(tokens))

    def configure_optimizers(self):
        from hydra.utils import instantiate

        make = instantiate(self.optim)
        return make(self.model, self.max_steps, new_params=self.new_params) if self.new_params else \
            make(self.model, self.max_steps)


def optimizer_config(optim: dict[str, Any]) -> dict[str, Any]:
    """The optimizer node with the schema's defaults filled in, checked, as plain types."""
    from omegaconf import OmegaConf

    from sinklab.train.muon import MuonConfig
    from sinklab.train.optim import AdamWConfig

    node = OmegaConf.create(dict(optim))
    schema = {s._target_: s for s in (AdamWConfig, MuonConfig)}.get(node.get("_target_", AdamWConfig._target_))
    if schema is not None:
        node = OmegaConf.merge(OmegaConf.structured(schema), node)  # defaults and types
        OmegaConf.to_object(node)  # the schema's __post_init__ checks the values
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


def model_key(key: str, compiled: bool) -> str:
    """A LitLM state-dict key in the layout of a compiled (model._orig_mod.*) or an eager (model.*) model."""
    if not key.startswith("model."):
        return key
    plain = "model." + key[len("model."):].removeprefix("_orig_mod.")
    return "model._orig_mod." + plain[len("model."):] if compiled else plain


class PeakFlopsWarning(UserWarning):
    """perf/mfu cannot be logged within its bounds (the peak FLOP/s is not reliable)."""
