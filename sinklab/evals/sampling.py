"""Decoding for `sinklab sample` (the command: `sinklab.cli.sample`): the next token from the logits (greedy, or a
draw at a temperature among the top k) and generation with a KV cache that, past the context, evicts as StreamingLLM
does (Xiao et al. 2024, arXiv 2309.17453): it keeps the first KEEP_FIRST tokens and the most recent ones, at most
block_size in all, positions re-indexed inside the cache (the model's own, `sinklab.model.kv_cache`)."""
from __future__ import annotations

from typing import Optional

import torch

KEEP_FIRST = 4  # StreamingLLM's initial tokens (its default attention-sink count)


# ----------------------------------------------------------------------------------------------------- decoding
def pick(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator],
         allowed: Optional[int] = None) -> torch.Tensor:
    """logits (B, V) -> the next token (B, 1): argmax at temperature 0, else a draw from softmax(logits / T) over
    the top k. `allowed`: only ids < allowed (the tokenizer's) are drawn."""
    logits = logits.float()
    if allowed is not None and allowed < logits.shape[-1]:
        logits = logits.clone()
        logits[:, allowed:] = -float("inf")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def kept(idx: torch.Tensor, first: int, context: int) -> torch.Tensor:
    """The tokens an evicting cache lets the last one see: all of idx (B, L) within the context, else the first
    `first` and the last context - first."""
    if idx.shape[1] <= context:
        return idx
    return torch.cat([idx[:, :first], idx[:, idx.shape[1] - (context - first):]], dim=1)  # (B, context)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
             generator: Optional[torch.Generator] = None, allowed: Optional[int] = None,
             cached: bool = True, policy=None) -> torch.Tensor:
    """prompt (1, P) -> the new tokens (1, max_new_tokens).

    policy: a cache policy (`sinklab.model.cache_policies`) instead of StreamingLLM's first KEEP_FIRST + recent: the
    cache evicts by it after every forward (the prompt's first block_size tokens in one, then one token each).

    cached: the prompt's first block_size tokens in one forward through a StreamingLLM cache (the first KEEP_FIRST
    tokens + the most recent, block_size in all), the rest of the prompt and every new token one forward of one token.
    cached=False is the reference: every step recomputes, from scratch, the tokens that cache would hold (the whole
    prefix within the context); the two agree within the context for any model, and past it for a one-layer model
    with relative positions (RoPE, ALiBi): a deeper model's cached keys were computed when their tokens came, from
    what those tokens saw then, and absolute positions are part of a key from the start."""
    context = model.cfg.block_size
    first = min(KEEP_FIRST, context - 2)
    idx, new = prompt, []
    if cached:
        cache = model.new_cache(keep_first=first, recent=context - first - 1) if policy is None else \
            model.new_cache(policy=policy)  # StreamingLLM's keeps the token fed besides them: block_size in all
        logits = model(prompt[:, :context], cache=cache)[:, -1]  # (1, V)
        for t in range(context, prompt.shape[1]):
            logits = model(prompt[:, t:t + 1], cache=cache)[:, -1]
    for i in range(max_new_tokens):
        if not cached:  # the LM head on the last position only, as the cached path
            logits = model.lm_head(model(kept(idx, first, context), return_hidden=True)[:, -1])
        nxt = pick(logits, temperature, top_k, generator, allowed)  # (1, 1)
        new.append(nxt)
        if cached and i < max_new_tokens - 1:
            logits = model(nxt, cache=cache)[:, -1]
        elif not cached:
            idx = torch.cat([idx, nxt], dim=1)
    return torch.cat(new, dim=1) if new else prompt[:, :0]
