"""sinklab's own models as a `Target`: a checkpoint, a run dir (its checkpoints/last.ckpt) or a Transformer in memory.

Interventions are passed to the model, never set on it: a mask is forward's `extra_mask` (the fused kernels'
is_causal shortcut is off then, in the layers it names), replaced activations a forward hook on a block's `hook_resid`,
a zeroed value one on its attention's `hook_v`. The KV cache is the
model's own (`sinklab.model.kv_cache`): keys are cached before RoPE and rotated at their place in the cache, so an
evicting cache re-indexes positions by construction; learned sink tokens and K / KV bias slots stay in it.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch

from sinklab.errors import UserError
from sinklab.metrics.record import SinklabRecorder

from .interface import SOURCES, Decoder, MaskFn, Step, Target, TargetMeta, TargetSpec, no_natural_input


@SOURCES.register("sinklab")
class SinklabTarget(Target):
    """A sinklab Transformer (module docstring); `run_dir`, the training run it belongs to, gives its probe set."""

    def __init__(self, model, meta: TargetMeta, chunk: int = 128, bos_id: Optional[int] = None):
        super().__init__(model.eval(), meta)
        self.chunk = chunk  # query rows per chunk of a recorded map
        # (whether a measurement puts the BOS id first, the id): given, or read from the run's data once (`bos`)
        self.bos_first: Optional[tuple[bool, Optional[int]]] = (True, bos_id) if bos_id is not None else None
        self.n_prefix = model.cfg.n_sink_tokens
        self.mask: Optional[MaskFn] = None  # the open `masked` mask

    @classmethod
    def load(cls, spec: TargetSpec) -> "SinklabTarget":
        from sinklab.runs.checkpoints import load_model
        from sinklab.runs.run_data import checkpoint_and_run_dir

        for flag, value, allowed in (("--revision", spec.revision, (None,)),
                                     ("--dtype", spec.dtype, ("auto", "float32", torch.float32))):
            if value not in allowed:
                raise UserError(f"{flag} {value}: applies to --hf-model only (a sinklab checkpoint is measured in "
                                "float32 as it was saved)")
        ckpt, run_dir = checkpoint_and_run_dir(spec.name)
        return cls.of_model(load_model(ckpt).to(spec.device), str(ckpt), run_dir)

    @classmethod
    def of_model(cls, model, name: str = "(in memory)", run_dir: Optional[Path] = None,
                 bos_id: Optional[int] = None) -> "SinklabTarget":
        """A Transformer already built (training's callback, notebooks) as a Target; `bos_id`, the BOS token that
        `run_with_cache` prepends by default (else the run's, read from run_dir's data config, or none)."""
        cfg = model.cfg
        description = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "attn_op": cfg.attn_op, "pos": cfg.pos,
                       "attn_bias": cfg.attn_bias, "n_sink_tokens": cfg.n_sink_tokens, "gate": cfg.gate,
                       "gate_act": cfg.gate_act}
        return cls(model, TargetMeta(target=name, source=cls.source, vocab_size=cfg.vocab_size,
                                     context=cfg.block_size, prefix_len=cfg.prefix_len, run_dir=run_dir,
                                     model=description), bos_id=bos_id)

    # --------------------------------------------------------------------------------------------- logits
    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, extra_mask=self.mask)

    def last_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The LM head on the last position only."""
        return self.model.lm_head(self.model(idx, return_hidden=True, extra_mask=self.mask)[:, -1])  # (B, V)

    # --------------------------------------------------------------------------------------------- metrics
    def recorder(self) -> SinklabRecorder:
        return SinklabRecorder(self.model, self.chunk, self.mask)

    # --------------------------------------------------------------------------------------------- hook names
    def hook_sites(self) -> dict:
        from sinklab.model.hooked import hook_names

        return hook_names(self.model)

    def bos(self) -> tuple[bool, Optional[list[int]]]:
        """As the run's probe set starts (its data.probe_bos; a synthetic task's BOS always), with the run's BOS id
        (data.eos_token's), read once from its data config; the `bos_id` of `of_model`; (False, None) otherwise."""
        if self.bos_first is None:
            from sinklab.runs.run_data import read_run_data

            self.bos_first = (False, None) if self.meta.run_dir is None else read_run_data(
                self.meta.run_dir, {"num_workers": 0},
                lambda dm: (bool(getattr(dm.config, "probe_bos", True)), int(dm.eos_id)),
                "prepend_bos", "the BOS id", "pass prepend_bos=False")
        first, bos = self.bos_first
        return first, None if bos is None else [bos]

    # --------------------------------------------------------------------------------------------- interventions
    @contextlib.contextmanager
    def masked(self, mask: Optional[MaskFn]) -> Iterator[None]:
        before, self.mask = self.mask, mask
        try:
            yield
        finally:
            self.mask = before

    @contextlib.contextmanager
    def set_output(self, layer: int, position: int, channels: list[int], values: torch.Tensor) -> Iterator[None]:
        """The block's residual stream (`hook_resid`) set at a sequence position (learned sink tokens first)."""
        def hook(_module, _inputs, x):
            x = x.clone()
            x[:, position, channels] = values.to(x.dtype)
            return x

        handle = self.model.blocks[layer].hook_resid.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def zero_value(self, layers: Optional[Iterable[int]], position: int) -> Iterator[None]:
        """v as the operation attends with it (`hook_v`: (B, H, n_slots + positions, hd), the kv heads repeated, the
        bias slot first) set to 0 at the key of the sequence position."""
        key = self.model.cfg.n_slots + position

        def hook(_module, _inputs, v):
            v = v.clone()
            v[:, :, key] = 0
            return v

        chosen = range(len(self.model.blocks)) if layers is None else layers
        handles = [self.model.blocks[layer].attn.hook_v.register_forward_hook(hook) for layer in chosen]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # --------------------------------------------------------------------------------------------- KV cache
    def stream(self, first: Optional[int], recent: Optional[int]) -> Step:
        """The model's cache keeps `recent - 1` besides the token being fed (`recent` counts it)."""
        cache = self.model.new_cache() if first is None else self.model.new_cache(keep_first=first,
                                                                                 recent=recent - 1)
        return lambda tok: self.model(tok, cache=cache)[:, -1]  # (1, V)

    def decoder(self, policy, evict: str = "decoding") -> "SinklabDecoder":
        return SinklabDecoder(self.model, policy, evict)

    def stream_notes(self) -> list[str]:
        if self.model.pos.absolute(1) is None:
            return []
        return [f"model.pos={self.model.cfg.pos} adds absolute positions to the embeddings: a kept token keeps the "
                "position it came in at, only the token being fed takes its place in the cache (StreamingLLM "
                "re-indexes relative positions: RoPE, ALiBi)"]

    @contextlib.contextmanager
    def past_context(self, n: int) -> Iterator[None]:
        """Past model.block_size: RoPE's tables are computed for the positions asked, ALiBi / relative biases and NoPE
        need none; an absolute table ends at the context (refused in one line, as for a dense cache)."""
        why = self.dense_limit(n)
        if why is not None:
            raise UserError(f"--past-context --seq-len {n}: {why}")
        before, self.model.past_context = self.model.past_context, True
        try:
            yield
        finally:
            self.model.past_context = before

    def dense_limit(self, n: int) -> Optional[str]:
        try:
            self.model.pos.absolute(self.model.cfg.n_sink_tokens + n)
        except ValueError as err:
            return str(err)
        return None

    # --------------------------------------------------------------------------------------------- inputs
    def natural_tokens(self, num_seqs: Optional[int], seq_len: Optional[int],
                       texts: Optional[Sequence[str]] = None) -> tuple[torch.Tensor, Optional[str]]:
        """The run's probe set, through its data config."""
        from sinklab.runs.run_data import probe_tokens

        if texts:
            raise UserError("--text goes with --hf-model and --input natural (the text the model's tokenizer reads)")
        if self.meta.run_dir is None:
            raise no_natural_input("natural", no_run_config(self.meta.target))
        return probe_tokens(self.meta.run_dir, num_seqs, seq_len), None

    def no_probe_set(self) -> Optional[str]:
        if self.meta.run_dir is not None:
            return None
        return no_run_config(self.meta.target)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Through the run's tokenizer (`sinklab.runs.run_data.token_texts`); the ids for a checkpoint outside a run."""
        from sinklab.runs.run_data import token_texts

        return token_texts(self.meta.run_dir, ids) if self.meta.run_dir is not None else super().token_texts(ids)


class SinklabDecoder(Decoder):
    """The model's own cache under a policy (`sinklab.model.kv_cache`): keys gathered per kv head, positions
    re-indexed; attention-based policies read the maps each layer computes for them, on any backend."""

    def __init__(self, model, policy, evict: str):
        policy.check(None if model.past_context else model.cfg.block_size)
        self.model, self.cache = model, model.new_cache(policy=policy, evict=evict)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, cache=self.cache)

    def compress(self) -> None:
        self.cache.compress()

    def kept(self) -> list[torch.Tensor]:
        """The kept sets of the layers that hold keys; a recurrent layer (Gated DeltaNet) holds a memory that no
        policy evicts, so a model of recurrent layers only has every text token it read (B, 1, seen)."""
        layers = self.cache.key_layers()
        if not layers:
            B = next(t for t in self.cache.recurrent[0].values()).shape[0]
            return [torch.arange(self.cache.seen).expand(B, 1, -1)]
        return [self.cache.origins(layer) for layer in layers]


def no_run_config(name: str) -> str:
    """Why a checkpoint outside a run has no probe set (it is read through the run's data config)."""
    return f"{name} has no run config (.hydra/config.yaml) to read the probe set from"
