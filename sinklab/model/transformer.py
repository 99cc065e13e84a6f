"""The LLaMA2-style decoder: embeddings, blocks (pre- or post-norm), final norm, untied LM head."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention import Attention, Layout
from .config import ModelConfig
from .layers import FeedForward, make_norm
from .positional import ALiBi, LearnablePositions, RelativeBias, Rotary, SinusoidalPositions


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.post = cfg.norm_position == "post"
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg.ffn, cfg.d_model, cfg.d_ff)

    def forward(self, x, layout: Layout, rope=None, record: Optional[dict] = None, return_probs: bool = False):
        if self.post:  # x = norm(x + attn(x)); x = norm(x + ffn(x))
            a = self.attn(x, layout, rope, record, return_probs)
            a, probs = a if return_probs else (a, None)
            x = self.norm1(x + a)
            x = self.norm2(x + self.ffn(x))
        else:  # x = x + attn(norm(x)); x = x + ffn(norm(x))
            a = self.attn(self.norm1(x), layout, rope, record, return_probs)
            a, probs = a if return_probs else (a, None)
            x = x + a
            x = x + self.ffn(self.norm2(x))
        return x, probs


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        n_pos = cfg.block_size + cfg.n_sink_tokens
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.sink_tokens = nn.Parameter(torch.zeros(cfg.n_sink_tokens, cfg.d_model)) if cfg.n_sink_tokens else None
        self.abs_pos = {"sinusoidal": SinusoidalPositions, "learnable": LearnablePositions}.get(cfg.pos)
        self.abs_pos = self.abs_pos(cfg.d_model, n_pos) if self.abs_pos else None
        self.rope = Rotary(cfg.hd, n_pos, cfg.rope_base) if cfg.pos == "rope" else None
        if cfg.pos == "alibi":
            self.pos_bias = ALiBi(cfg.n_head)
        elif cfg.pos == "relative":
            self.pos_bias = RelativeBias(cfg.n_head, cfg.relative_buckets, cfg.relative_max_distance,
                                         bidirectional=cfg.prefix_len > 0)
        else:
            self.pos_bias = None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, sqrt(2 / (5 d))) for linear and embedding weights; N(0, 0.02) for attention biases and sinks."""
        for name, p in self.named_parameters():
            if name.endswith(("k_bias", "v_bias", "v_out_bias", "sink_tokens")):
                nn.init.normal_(p, std=self.cfg.bias_init_std)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=self.cfg.std)
            elif name.endswith("bias") and "phi" in name:
                nn.init.zeros_(p)

    def layout(self, T: int, device: torch.device) -> Layout:
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the model context model.block_size={self.cfg.block_size}")
        return Layout(n_pos=self.cfg.n_sink_tokens + T, n_sink=self.cfg.n_sink_tokens, n_slots=self.cfg.n_slots,
                      prefix_len=self.cfg.prefix_len, window=self.cfg.window, pos_bias=self.pos_bias, device=device)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> x (B, S + T, d) with the learned sink tokens prepended."""
        x = self.tok_emb(idx)
        if self.sink_tokens is not None:
            x = torch.cat([self.sink_tokens[None].expand(idx.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if self.abs_pos is not None:
            x = x + self.abs_pos(x.shape[1]).to(x.dtype)
        return x

    def forward(self, idx: torch.Tensor, records: Optional[list] = None, return_probs: bool = False,
                return_hidden: bool = False):
        """idx (B, T) token ids -> logits (B, T, vocab) for the real tokens (sink tokens are never predicted).

        records: a list that receives, per layer, a dict with q, k, v (after RoPE, with the bias slot) and the
        block output `h`. return_probs: also return the attention maps, a list of (B, H, S + T, Tk) per layer.
        return_hidden: return the final hidden states (B, T, d) instead of logits.
        """
        layout = self.layout(idx.shape[1], idx.device)
        x = self.embed(idx)
        rope = self.rope.at(x.shape[1]) if self.rope is not None else None  # sliced once, not per layer
        all_probs = []
        for block in self.blocks:
            rec = {} if records is not None else None
            x, probs = block(x, layout, rope, rec, return_probs)
            if rec is not None:
                rec["h"] = x
                records.append(rec)
            all_probs.append(probs)
        x = self.norm(x[:, self.cfg.n_sink_tokens:])
        out = x if return_hidden else self.lm_head(x)
        return (out, all_probs) if return_probs else out

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() + self.lm_head.weight.numel()
        return n

    def flops_per_token(self, T: int) -> float:
        """Training FLOPs per token (6N + attention), as in the PaLM appendix."""
        c = self.cfg
        n = sum(p.numel() for p in self.parameters()) - self.tok_emb.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * c.hd * T
