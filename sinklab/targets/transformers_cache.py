"""StreamingLLM's evicting cache for transformers models with RoPE (rotate-half convention: LLaMA, Mistral, Qwen2/3,
Gemma2/3, OLMo2, Phi-3, GPT-NeoX, gpt-oss, ...), with transformers' own `DynamicCache`.

A sinklab cache that evicts stores keys before RoPE and rotates them at their place in the cache (model/cache.py).
transformers caches keys after RoPE, so this does what the StreamingLLM code does for Llama: feed one token with
`position_ids` = its place in the cache; after the forward, drop the middle of every layer's cached keys and values
(`cache.layers[i].keys / .values`, (B, Hkv, L, hd)) and rotate the kept recent keys back by the number of dropped
positions. RoPE composes: R(p - d) k = R(-d) R(p) k, with R(t) x = x cos(t f) + rotate_half(x) sin(t f) and
f = cat(inv_freq, inv_freq) from the model's rotary embedding. The keys are rotated once per evicted position (one
rotation by -1 per step once the cache is full), so the rounding of y rotations adds up over a key's stay, ~1e-6 in
fp32.

- Partial rotary (GPT-NeoX, Phi-3 with partial_rotary_factor): only the first 2 * len(inv_freq) dims of each key
  are rotated, the rest pass, as in the model.
- Per-layer RoPE (Gemma3: a local and a global base, `<layer_type>_inv_freq`): each layer's keys with its own.
- A constant attention scaling (YaRN's mscale, gpt-oss) multiplies cos and sin alike; rotating a scaled key keeps
  the scale, so it composes. Frequencies that change with the length (dynamic NTK, LongRoPE) do not: refused.
- Per-layer sliding windows (Mistral, Gemma2/3, gpt-oss): the cache keeps every layer's x + y keys; a sliding layer's
  mask, built by the model from the positions in the cache, lets it see its window of them, as in the full model.
- Learned absolute positions (GPT-2, OPT) are refused in one line: the positions live in the embeddings, not the
  keys, so a kept token cannot be moved to its place in the cache.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sinklab.errors import UserError

COMPOSABLE_ROPE = ("default", "linear", "llama3", "yarn")  # fixed inv_freq; cos / sin at most scaled by a constant


def rotary_embedding(model: nn.Module, where: str) -> list[torch.Tensor]:
    """Each decoder layer's RoPE frequencies inv_freq (hd_rot / 2,), checked to compose (module docstring)."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")
                   and any(b.endswith("inv_freq") for b, _ in m.named_buffers())), None)
    if rotary is None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise UserError(f"--hf-model {where}: {kind} has no rotary embedding (learned absolute positions, as GPT-2 "
                        "and OPT): a kept token's position lives in its embedding, so the cache cannot re-index it; "
                        "allowed: RoPE models (LLaMA, Mistral, Qwen, Gemma, OLMo, Phi-3, GPT-NeoX, gpt-oss, ...)")
    kinds = getattr(rotary, "rope_type", "default")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = int(cfg.num_hidden_layers)
    layer_types = getattr(cfg, "layer_types", None) or [None] * n
    out = []
    for layer_type in layer_types:
        kind = kinds.get(layer_type, "default") if isinstance(kinds, dict) else kinds
        if kind not in COMPOSABLE_ROPE:
            raise UserError(f"--hf-model {where}: RoPE type {kind!r} changes its frequencies with the length, so "
                            f"rotations do not compose; allowed: {', '.join(COMPOSABLE_ROPE)}")
        own = getattr(rotary, f"{layer_type}_inv_freq", None) if layer_type else None
        out.append(own if own is not None else rotary.inv_freq)
    return out


def rotate_back(keys: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Post-RoPE keys (B, H, L, hd) at positions p -> the same keys at positions p - shift (rotate-half RoPE on the
    first 2 * len(inv_freq) dims; the others, not rotated by partial rotary, pass)."""
    rot = 2 * inv_freq.numel()
    angle = -shift * torch.cat([inv_freq, inv_freq]).to(torch.float32)  # (rot,)
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    k_rot, k_pass = keys[..., :rot], keys[..., rot:]
    k1, k2 = k_rot.chunk(2, dim=-1)
    return torch.cat([k_rot * cos + torch.cat([-k2, k1], dim=-1) * sin, k_pass], dim=-1)


class HFStream:
    """Feed a transformers causal LM one token at a time through a DynamicCache that keeps the first `first` tokens
    and the `recent` most recent ones (the token being fed among them), positions re-indexed inside the cache; both
    None: dense, no eviction. Callable as a `sinklab.targets.interface.Step`."""

    def __init__(self, model: nn.Module, first: Optional[int] = None, recent: Optional[int] = None,
                 where: str = "DIR"):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache()  # no config: one plain DynamicLayer per layer
        self.first, self.keep = first, None if recent is None else recent - 1  # kept besides the next token
        self.inv_freq = rotary_embedding(model, where) if recent is not None else None  # one per layer
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
        for layer, inv_freq in zip(self.cache.layers, self.inv_freq):
            n = layer.keys.shape[-2]
            if n <= x + r:
                continue
            recent_k = rotate_back(layer.keys[:, :, n - r:], inv_freq, n - r - x)  # (B, Hkv, r, hd)
            layer.keys = torch.cat([layer.keys[:, :, :x], recent_k], dim=-2)  # (B, Hkv, x + r, hd)
            layer.values = torch.cat([layer.values[:, :, :x], layer.values[:, :, n - r:]], dim=-2)
