"""StreamingLLM's evicting cache for transformers models of the LLaMA family (RoPE in the rotate-half convention), with
transformers' own `DynamicCache`.

A sinklab cache that evicts stores keys before RoPE and rotates them at their place in the cache (model/cache.py).
transformers caches keys after RoPE, so this does what the StreamingLLM code does for Llama: feed one token with
`position_ids` = its place in the cache; after the forward, drop the middle of every layer's cached keys and values
(`cache.layers[i].keys / .values`, (B, Hkv, L, hd)) and rotate the kept recent keys back by the number of dropped
positions. RoPE composes: R(p - d) k = R(-d) R(p) k, with R(t) x = x cos(t f) + rotate_half(x) sin(t f) and
f = cat(inv_freq, inv_freq) from the model's `rotary_emb`. The keys are rotated once per evicted position (one
rotation by -1 per step once the cache is full), so the rounding of y rotations adds up over a key's stay, ~1e-6 in
fp32.

Refused with one line: RoPE that is not a pure rotation (attention_scaling != 1: YaRN, LongRoPE; dynamic NTK, whose
frequencies change with the length) and partial rotary (fewer frequencies than head_dim / 2, e.g. GPT-NeoX, Phi).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sinklab.errors import UserError
from sinklab.evals.perplexity import LogitsOf

COMPOSABLE_ROPE = ("default", "linear", "llama3")  # a fixed inv_freq and cos / sin unscaled


def rotary_embedding(model: nn.Module, where: str) -> nn.Module:
    """The model's rotary embedding module (it holds `inv_freq`), checked to be a pure rotation."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb") and hasattr(m, "inv_freq")),
                  None)
    if rotary is None:
        raise UserError(f"--hf-model {where}: no rotary embedding (rotary_emb with inv_freq) found; an evicting cache "
                        "re-rotates RoPE keys: allowed: LLaMA-family models (LLaMA, Mistral, Qwen2, ...)")
    kind, scale = getattr(rotary, "rope_type", "default"), float(getattr(rotary, "attention_scaling", 1.0))
    if kind not in COMPOSABLE_ROPE or scale != 1.0:
        raise UserError(f"--hf-model {where}: RoPE type {kind!r} (attention scaling {scale:g}) is not a pure rotation "
                        f"that composes; allowed: {', '.join(COMPOSABLE_ROPE)}")
    return rotary


def rotate_back(keys: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Post-RoPE keys (B, H, L, hd) at positions p -> the same keys at positions p - shift (rotate-half RoPE)."""
    angle = -shift * torch.cat([inv_freq, inv_freq]).to(torch.float32)  # (hd,)
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    k1, k2 = keys.chunk(2, dim=-1)
    return keys * cos + torch.cat([-k2, k1], dim=-1) * sin


class HFStream:
    """Feed a transformers causal LM one token at a time through a DynamicCache that keeps the first `first` tokens
    and the `recent` most recent ones (the token being fed among them), positions re-indexed inside the cache; both
    None: dense, no eviction. Callable as a `Step`."""

    def __init__(self, model: nn.Module, first: Optional[int] = None, recent: Optional[int] = None,
                 where: str = "DIR"):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache()  # no config: one plain DynamicLayer per layer
        self.first, self.keep = first, None if recent is None else recent - 1  # kept besides the next token
        self.inv_freq = rotary_embedding(model, where).inv_freq if recent is not None else None
        self.where = where

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        place = self.cache.get_seq_length()  # the token's position: its place in the cache
        position_ids = torch.tensor([[place]], device=tok.device)
        out = self.model(input_ids=tok, past_key_values=self.cache, position_ids=position_ids, use_cache=True)
        if self.keep is not None:
            self.evict()
        return out.logits[:, -1]  # (1, V)

    def evict(self) -> None:
        """Keep the first x and the last `keep` positions of every layer; the kept recent keys move back."""
        x, r = self.first, self.keep
        for layer in self.cache.layers:
            n = layer.keys.shape[-2]
            if n <= x + r:
                continue
            if layer.keys.shape[-1] != 2 * self.inv_freq.numel():
                raise UserError(f"--hf-model {self.where}: RoPE covers {2 * self.inv_freq.numel()} of the "
                                f"{layer.keys.shape[-1]} key dims (partial rotary); allowed: RoPE over the whole head")
            recent_k = rotate_back(layer.keys[:, :, n - r:], self.inv_freq, n - r - x)  # (B, Hkv, r, hd)
            layer.keys = torch.cat([layer.keys[:, :, :x], recent_k], dim=-2)  # (B, Hkv, x + r, hd)
            layer.values = torch.cat([layer.values[:, :, :x], layer.values[:, :, n - r:]], dim=-2)


def hf_logits(model: nn.Module) -> LogitsOf:
    """A transformers causal LM's logits without a cache; only the last position's when that is all that is needed."""
    def logits_of(idx: torch.Tensor, last_only: bool) -> torch.Tensor:
        if not last_only:
            return model(input_ids=idx, use_cache=False).logits
        return model(input_ids=idx, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)
    return logits_of

