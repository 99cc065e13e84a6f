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
from sinklab.model.cache_policies import CACHE_POLICIES, CachePolicy, Dense, Streaming, gather_state

from .interface import Decoder

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


def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its cache by: `cache` (transformers 5.24, where `past_key_values` is
    deprecated, to be removed in 5.40), else `past_key_values` (earlier releases)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def rotate_back(keys: torch.Tensor, inv_freq: torch.Tensor, shift) -> torch.Tensor:
    """Post-RoPE keys (B, H, L, hd) at positions p -> the same keys at positions p - shift (rotate-half RoPE on the
    first 2 * len(inv_freq) dims; the others, not rotated by partial rotary, pass); shift an int, or a tensor
    (B, H, L, 1) of each key's own."""
    rot = 2 * inv_freq.numel()
    angle = -torch.as_tensor(shift, device=keys.device) * torch.cat([inv_freq, inv_freq]).to(torch.float32)  # (..., rot)
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    k_rot, k_pass = keys[..., :rot], keys[..., rot:]
    k1, k2 = k_rot.chunk(2, dim=-1)
    return torch.cat([k_rot * cos + torch.cat([-k2, k1], dim=-1) * sin, k_pass], dim=-1)


class HFDecoder(Decoder):
    """Feed a transformers causal LM through a DynamicCache that evicts by a policy (`sinklab.model.cache_policies`)
    after every forward (evict="decoding") or when compressed ("prefill"), positions re-indexed inside the cache:
    each layer's kept keys are gathered per kv head and rotated back by how far they moved (module docstring).
    Attention-based policies read the eager kernel's maps (`output_attentions`). Policies that need a mask per layer
    or head (not `CachePolicy.uniform`: per-layer budgets, per-head masks) are sinklab models' only: a transformers
    model takes one attention mask for every layer and head."""

    def __init__(self, model: nn.Module, policy: CachePolicy, evict: str = "decoding", where: str = "DIR"):
        from transformers import DynamicCache

        if not policy.uniform():
            raise UserError(f"cache policy {policy.name}: needs a mask per layer or head, which a transformers model "
                            f"does not take; allowed here: {CACHE_POLICIES.allowed(lambda c: c.uniform())}")
        self.model, self.cache, self.policy = model, DynamicCache(), policy  # one plain DynamicLayer per layer
        self.cache_arg = cache_argument(model)
        self.evict_on_forward = evict == "decoding"
        self.inv_freq = rotary_embedding(model, where) if policy.budget is not None else None  # one per layer
        self.states: list[dict] = []
        self.origin: list[torch.Tensor] = []  # per layer (B, Hkv, L): the text token each held key came from
        self.seen = 0

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        place = self.cache.get_seq_length()  # the tokens' positions: their places in the cache
        N = idx.shape[1]
        position_ids = torch.arange(place, place + N, device=idx.device)[None]
        out = self.model(input_ids=idx, position_ids=position_ids, use_cache=True,
                         output_attentions=self.policy.needs_maps, **{self.cache_arg: self.cache})
        layers = self.cache.layers
        if not self.states:
            self.states = [{} for _ in layers]
        new = torch.arange(self.seen, self.seen + N, device=idx.device)
        for i, layer in enumerate(layers):
            B, Hkv = layer.keys.shape[:2]
            old = self.origin[i] if i < len(self.origin) else new[:0].expand(B, Hkv, 0)
            if i < len(self.origin):
                self.origin[i] = torch.cat([old, new.expand(B, Hkv, N)], dim=2)
            else:
                self.origin.append(new.expand(B, Hkv, N))
            if self.policy.needs_maps:
                probs = out.attentions[i].detach().float()  # (B, H, N, L)
                H = probs.shape[1]
                self.policy.observe(self.states[i], probs.view(B, Hkv, H // Hkv, N, -1).sum(2))
        self.seen += N
        if self.evict_on_forward:
            self.compress()
        return out.logits  # (1, N, V)

    def compress(self) -> None:
        """Keep the policy's keys of every layer; a kept key moves from its place p to its new place j < p and is
        rotated back by p - j."""
        if self.policy.budget is None:
            return
        for i, (layer, inv_freq) in enumerate(zip(self.cache.layers, self.inv_freq)):
            B, Hkv, L, hd = layer.keys.shape
            n = self.policy.capacity(i, len(self.cache.layers), L)
            if L <= n:
                continue
            idx = self.policy.keep(self.states[i], layer.keys, i, n)  # (B, Hkv, n) ascending
            at = idx[..., None].expand(B, Hkv, n, hd)
            shift = (idx - torch.arange(n, device=idx.device))[..., None]  # (B, Hkv, n, 1): how far each moves
            layer.keys = rotate_back(layer.keys.gather(2, at), inv_freq, shift)
            layer.values = layer.values.gather(2, at)
            self.origin[i] = self.origin[i].gather(2, idx)
            gather_state(self.states[i], idx, L)

    def kept(self) -> list[torch.Tensor]:
        return list(self.origin)


class HFStream(HFDecoder):
    """Feed a transformers causal LM one token at a time through a DynamicCache that keeps the first `first` tokens
    and the `recent` most recent ones (the token being fed among them), positions re-indexed inside the cache; both
    None: dense, no eviction. Callable as a `sinklab.targets.interface.Step`."""

    def __init__(self, model: nn.Module, first: Optional[int] = None, recent: Optional[int] = None,
                 where: str = "DIR"):
        policy = Dense() if recent is None else Streaming(first + recent - 1, first=first)
        super().__init__(model, policy, "decoding", where)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        return super().__call__(tok)[:, -1]  # (1, V)
