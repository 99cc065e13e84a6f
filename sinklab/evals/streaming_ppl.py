"""Perplexity over a long text with a KV cache that keeps the first x tokens and the y most recent ones, and the two
baselines of StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", arXiv
2309.17453).

What the paper does (section 4.1, Figure 3, Table 2): it feeds the concatenated PG19 test books (up to 4M tokens) one
token at a time to Llama-2 / MPT / Falcon / Pythia through a cache of 4 initial tokens + the most recent ones, with
positions counted inside the cache (a kept token's RoPE / ALiBi position is its place in the cache, not in the text),
and compares with dense attention (a cache that never evicts: it fails past the training context), window attention
(x = 0: it fails once the first tokens leave the cache) and sliding window with re-computation (every token predicted
from the last L tokens recomputed from scratch: good, but O(L^2) per token). Table 2 varies x over 0, 1, 2, 4, 8.

Decided here:
- y counts the token being fed: it attends to at most x + y keys (the first x, the y - 1 kept before it, itself), so
  x + y <= the model context keeps every position inside the trained range, and x = 0, y = context is the window of
  the recompute baseline without the recomputation. The paper's code keeps start + recent keys between steps and
  attends with one more: its (start, recent) is our (x, y - 1). `Target.stream(x, y)` makes that cache, for every
  model source (sinklab's cache keeps keys before RoPE; transformers' keys are re-rotated when the cache evicts).
- Every target after the first token is scored, also those before the cache is full, so all settings score the same
  N - 1 targets; perplexity per position bucket (`bucket_ppl`) shows where they part.
- Learned sink tokens (model.n_sink_tokens) and K / KV bias slots stay in the cache besides the first x tokens.
- The recompute baseline's first `context` targets come from one forward over the first `context` tokens (each sees
  every token before it); each later one from the window of the `context` tokens ending at its input, windows batched.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from sinklab.evals.registry import EVALUATIONS, NON_NEGATIVE, PERPLEXITY, Evaluation
from sinklab.model.lm_loss import perplexity
from sinklab.targets.interface import Step, Target


@torch.no_grad()
def stream_nll(step: Step, tokens: torch.Tensor, progress: Optional[Callable[[int], None]] = None,
               chunk: int = 256) -> torch.Tensor:
    """tokens (N,) fed one at a time through `step` -> the NLL of tokens[1:], (N - 1,) float32 on the CPU. The
    logits are scored `chunk` steps at a time (one cross-entropy call per chunk, not per token)."""
    n = tokens.shape[0]
    nll, rows = torch.empty(n - 1), []
    for t in range(n - 1):
        rows.append(step(tokens[t:t + 1].view(1, 1)))
        if len(rows) == chunk or t == n - 2:
            a = t + 1 - len(rows)
            logits = torch.cat(rows).float()  # (R, V): the predictions of tokens a + 1 .. t + 1
            nll[a:t + 1] = F.cross_entropy(logits, tokens[a + 1:t + 2], reduction="none").cpu()
            rows = []
            if progress is not None:
                progress(logits.shape[0])
    return nll


@torch.no_grad()
def recompute_nll(target: Target, tokens: torch.Tensor, context: int, batch_size: int = 32,
                  progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Sliding window with re-computation: the NLL (N - 1,) of tokens[1:], each predicted from at most the `context`
    tokens before it, computed from scratch (no cache)."""
    n = tokens.shape[0]
    head = min(context, n - 1)
    out = [F.cross_entropy(target.logits(tokens[None, :head])[0].float(), tokens[1:head + 1], reduction="none")]
    if progress is not None:
        progress(head)
    if n - 1 > context:
        # the input windows of targets context + 1 .. n - 1: window s is tokens[s .. s + context - 1], s = 1 ..
        windows = tokens[1:n - 1].unfold(0, context, 1)  # (n - 1 - context, context)
        for b in range(0, windows.shape[0], batch_size):
            w = windows[b:b + batch_size]
            y = tokens[context + 1 + b:context + 1 + b + w.shape[0]]  # the next token of each window
            out.append(F.cross_entropy(target.last_logits(w).float(), y, reduction="none"))
            if progress is not None:
                progress(w.shape[0])
    return torch.cat(out).cpu()


def bucket_ends(n_targets: int, size: int) -> list[int]:
    """The end (exclusive index into the targets, = the position of the last one) of each run of `size` targets; a
    last run shorter than half a bucket joins the one before it (a handful of targets is noise, not a point)."""
    ends = list(range(size, n_targets, size)) + [n_targets]
    if len(ends) > 1 and n_targets - ends[-2] < size / 2:
        del ends[-2]
    return ends


def bucket_ppl(nll: torch.Tensor, ends: list[int]) -> list[float]:
    """Perplexity of the targets of each bucket (`bucket_ends`; `sinklab.model.lm_loss.perplexity`)."""
    return [perplexity(nll[a:b]) for a, b in zip([0] + ends[:-1], ends)]



# ----------------------------------------------------------------------------------------------------- in sweeps
_SETTING = r"(x\d+_y\d+|[a-z0-9]+_b\d+|dense|recompute(_w\d+)?)"


@EVALUATIONS.register("streaming")
class StreamingPerplexity(Evaluation):
    """`sinklab eval streaming`; in a sweep's streaming.csv: for each setting <setting>_ppl, <setting>_bpb (bits per
    byte) and <setting>_keys (the setting: x4_y60 for a cache of the first 4 + 60 recent tokens, h2o_b32 for a cache
    policy at a budget of 32 keys, dense and recompute for the baselines, recompute_w128 for a recompute window of 128
    tokens other than the model context), then n_tokens."""

    command = "sinklab.cli.streaming"
    summary = "perplexity over a long text with a KV cache of x first + y recent tokens"
    bounds = ((rf"^{_SETTING}_ppl$", PERPLEXITY), (rf"^({_SETTING}_(keys|bpb)|n_tokens)$", NON_NEGATIVE))
    settings = {"settings": "name"}
    same = ("source", "data", "text", "n_tokens", "context", "bucket")

    @staticmethod
    def row(result: dict) -> dict:
        def setting(s: dict) -> str:
            if s["kind"] == "policy":
                return f"{s['policy']}_b{s['budget']}"
            if s["kind"] == "recompute" and s["keys"] != result["context"]:
                return f"recompute_w{s['keys']}"  # --window L: a window other than the model context's
            return f"x{s['first']}_y{s['recent']}" if s["kind"] == "streaming" else s["kind"]

        row = {f"{setting(s)}_{k}": s.get(k) for s in result["settings"] for k in ("ppl", "bpb", "keys")}
        return {**row, "n_tokens": result["n_tokens"]}
