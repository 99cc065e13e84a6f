"""The LLaMA2-style decoder: embeddings, blocks (pre- or post-norm), final norm, LM head (untied unless
model.tie_embeddings); the residual stream optionally clamped to +-model.residual_clip after each block."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
from torch import nn

from .attention import Attention
from .cache_policies import CachePolicy
from .kv_cache import KVCache
from .hooks import HookPoint
from .layer_pattern import LayerPattern, is_local, layer_config
from .legacy import upgrade_state_dict
from .masks import LayerMask, Layout, MaskMod, and_masks, compose_mask, split_extra
from .registry import FFNS, NORM_POSITIONS, NORMS, POSITIONS


@NORM_POSITIONS.register("pre")
class Block(LayerPattern, nn.Module):
    """x = x + attn(norm(x)); x = x + ffn(norm(x)); the model ends with a final norm."""

    final_norm = True

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__()
        self.norm1 = NORMS.selected(cfg).build(cfg)
        # its layer's attention (model.layer_pattern: its op; a local layer the layout's window mask)
        self.attn = Attention(layer_config(cfg, layer), layer, local=is_local(cfg, layer))
        self.norm2 = NORMS.selected(cfg).build(cfg)
        self.ffn = FFNS.selected(cfg).build(cfg)
        self.clip = cfg.residual_clip
        self.hook_resid = HookPoint()  # the block's output: the residual stream after the clamp
        # its input, and the residual stream between the attention and the FFN sublayers (TransformerLens's names)
        self.hook_resid_pre, self.hook_resid_mid = HookPoint(), HookPoint()

    llama = True

    def out(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream leaving the block, clamped to +-model.residual_clip when set."""
        return self.hook_resid(x if self.clip is None else x.clamp(-self.clip, self.clip))

    def forward(self, x, layout: Layout):
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.attn(self.norm1(x), layout))
        return self.out(x + self.ffn(self.norm2(x)))


@NORM_POSITIONS.register("post")
class PostNormBlock(Block):
    """x = norm(x + attn(x)); x = norm(x + ffn(x)); no final norm."""

    final_norm = False

    llama = False

    def forward(self, x, layout: Layout):
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(self.norm1(x + self.attn(x, layout)))
        return self.out(self.norm2(x + self.ffn(x)))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        cfg.require_vocab()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.sink_tokens = nn.Parameter(torch.zeros(cfg.n_sink_tokens, cfg.d_model)) if cfg.n_sink_tokens else None
        self.pos = POSITIONS.selected(cfg).from_config(cfg)
        # a forward longer than the context is refused, except while a measurement reads the model past it
        # (`sinklab measure --past-context`, Target.past_context): relative positions extrapolate, absolute ones refuse
        self.past_context = False
        block = NORM_POSITIONS.selected(cfg)
        self.blocks = nn.ModuleList(block(cfg, layer) for layer in range(cfg.n_layer))
        self.norm = NORMS.selected(cfg).build(cfg) if block.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one weight, (V, d): rows of the embedding are the output head's rows
            self.lm_head.weight = self.tok_emb.weight
        # with a layer pattern, model.window is the local layers' (Layout.windowed), the others see every key
        window = cfg.window if cfg.layer_pattern is None else None
        self.mask_mod = compose_mask(cfg.n_sink_tokens, cfg.prefix_len, window)
        self.plain_causal = cfg.prefix_len == 0 and window is None  # mask_mod is `causal` (fused is_causal)
        self.local_mask_mod = compose_mask(cfg.n_sink_tokens, cfg.prefix_len, cfg.window) if window != cfg.window \
            else None
        self.register_load_state_dict_pre_hook(upgrade_state_dict)
        self.aux_losses: dict[str, torch.Tensor] = {}  # the last forward's (`forward`)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, model.init_std) for matrices and embeddings (default sqrt(2 / (5 d)), the reference study's);
        N(0, model.bias_init_std) for sink tokens; a component with `init_parameters(std, bias_std)` initialises its
        own subtree (attention biases: small; kernel MLP: zero biases). Parameters are drawn in registration order."""
        std, bias_std = self.cfg.std, self.cfg.bias_init_std
        if self.sink_tokens is not None:
            nn.init.normal_(self.sink_tokens, std=bias_std)

        def init(module: nn.Module) -> None:
            own = getattr(module, "init_parameters", None)
            if own is not None:
                own(std, bias_std)
                return
            for p in module.parameters(recurse=False):
                if p.dim() >= 2:
                    nn.init.normal_(p, std=std)
            for child in module.children():
                init(child)

        for child in self.children():
            init(child)

    def set_step(self, step: int) -> None:
        """Tell every layer's attention operation the training step about to run (a warm-up's clock)."""
        for block in self.blocks:
            block.attn.op.set_step(step)

    def new_cache(self, keep_first: Optional[int] = None, recent: Optional[int] = None,
                  policy: Optional[CachePolicy] = None, evict: str = "decoding") -> KVCache:
        """An empty KV cache for `forward(idx, cache=...)`: dense, keeping the first / recent tokens, or evicting by
        a policy (`sinklab.model.cache_policies`) after every forward or when compressed (`evict`)."""
        return KVCache(self.cfg.n_layer, self.cfg.n_sink_tokens, keep_first, recent, policy, evict)

    def layout(self, T: int, device: torch.device, cache: Optional[KVCache] = None,
               extra_mask: Union[MaskMod, LayerMask, None] = None) -> Layout:
        """The layout of T new tokens (and the sink tokens, unless a cache holds them already); `extra_mask` (an
        intervention's: a key dropped) is obeyed on top of the model's mask, by every layer, or by the layers and
        heads a `LayerMask` names (kept as `Layout.intervention`: those layers restrict their own layout by it)."""
        if T > self.cfg.block_size and not self.past_context:
            raise ValueError(f"sequence length {T} exceeds the model context model.block_size={self.cfg.block_size}")
        start = cache.length if cache is not None else 0
        if cache is not None and self.cfg.prefix_len and start and start < self.cfg.n_sink_tokens + self.cfg.prefix_len:
            raise ValueError(f"decoding with a KV cache needs the first forward (the prompt) to cover the prefix "
                             f"model.prefix_len={self.cfg.prefix_len}: its tokens see each other")
        n_pos = T + (self.cfg.n_sink_tokens if start == 0 else 0)
        rope = self.pos.rotary(start + n_pos, start)
        extra_mask, intervention = split_extra(extra_mask)
        mask_mod = self.mask_mod if extra_mask is None else and_masks(self.mask_mod, extra_mask)
        layout = Layout(n_pos=n_pos, n_sink=self.cfg.n_sink_tokens, n_slots=self.cfg.n_slots,
                        mask_mod=mask_mod, plain_causal=self.plain_causal and extra_mask is None,
                        logit_bias=self.pos.logit_bias, rope=rope, device=device, start=start,
                        rope_keys=self.pos.rotary(start + n_pos) if start and not cache.stores_rotated else None,
                        cache=cache, bias_params=tuple(self.pos.parameters()) if self.pos.logit_bias else (),
                        rotary_at=self.pos.rotary, intervention=intervention)
        if self.local_mask_mod is not None:  # the local layers' layout: the same sequence under the window
            local = self.local_mask_mod if extra_mask is None else and_masks(self.local_mask_mod, extra_mask)
            layout.windowed = dataclasses.replace(layout, mask_mod=local, plain_causal=False, memo={})
        return layout

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """idx (B, T) -> x (B, S + T, d) with the learned sink tokens prepended (at start 0: a KV cache that holds
        `start` positions has them already, and the tokens take positions start .. start + T - 1)."""
        x = self.tok_emb(idx)
        if self.sink_tokens is not None and start == 0:
            x = torch.cat([self.sink_tokens[None].expand(idx.shape[0], -1, -1).to(x.dtype), x], dim=1)
        table = self.pos.absolute(start + x.shape[1])
        return x + table[start:].to(x.dtype) if table is not None else x

    def forward(self, idx: torch.Tensor, return_hidden: bool = False, cache: Optional[KVCache] = None,
                extra_mask: Union[MaskMod, LayerMask, None] = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab) for the real tokens (sink tokens are never predicted).

        return_hidden: the final hidden states (B, T, d) instead of logits.
        cache: a KVCache (`new_cache`) holding the earlier positions: idx are the next tokens; the cache keeps them
        and evicts by its policy after the forward.
        extra_mask: a mask function every query obeys on top of the model's (an intervention's), or a `LayerMask`
        that the queries of some layers / heads obey.
        Measurements record q, k, v, the attention output and the residual stream through forward hooks
        (`sinklab.metrics.record`); nothing recorded changes what this returns.
        After the forward, `aux_losses` holds the auxiliary losses the layers added in it ({} outside training, and
        for most operations): name -> a scalar, which training adds to the loss (`sinklab.train.module`).
        """
        layout = self.layout(idx.shape[1], idx.device, cache, extra_mask)
        x = self.embed(idx, layout.start)
        for block in self.blocks:
            x = block(x, layout)
        # each auxiliary loss summed over the layers (each layer's own term keeps its weight 1 at any depth)
        self.aux_losses = {name: torch.stack(terms).sum() for name, terms in layout.aux_losses.items()}
        if cache is not None:
            cache.commit(idx.shape[1])
        x = self.norm(x[:, layout.n_pos - idx.shape[1]:])  # the real tokens
        return x if return_hidden else self.lm_head(x)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight once
        if non_embedding:
            n -= self.tok_emb.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        return n

    def flops_per_token(self, T: int) -> float:
        """Training FLOPs per token (6N + attention), as in the PaLM appendix."""
        c = self.cfg
        n = sum(p.numel() for p in self.parameters())  # the output head's matmul counts, the embedding lookup not
        n -= 0 if c.tie_embeddings else self.tok_emb.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * c.hd * T
