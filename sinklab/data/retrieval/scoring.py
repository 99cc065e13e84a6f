"""Scoring retrieval answers: exact match per answer span, teacher-forced."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def answer_scores(logits: torch.Tensor, tokens: torch.Tensor, answer: torch.Tensor,
                  scored: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy in nats over the answer tokens, exact-match accuracy over the answer spans) of logits
    (B, L - 1, V) computed on tokens[:, :-1], for tokens and answer (B, L). A span (a maximal run of answer tokens in a
    row) is right when the argmax at each of its tokens is that token: teacher-forced, the same as greedy decoding
    of the span. `scored` (B, L - 1) bool: the targets that may be scored (a prefix-LM's prefix is not)."""
    target = tokens[:, 1:]                       # (B, L - 1)
    mask = answer[:, 1:].bool()                  # (B, L - 1)
    if scored is not None:
        mask = mask & scored
    flat = logits.float()[mask]                  # (N, V) the answer positions
    loss = F.cross_entropy(flat, target[mask]) if len(flat) else logits.new_zeros(())
    right = (logits.argmax(-1) == target) | ~mask  # (B, L - 1)
    before = F.pad(mask[:, :-1], (1, 0))         # (B, L - 1) the previous target is an answer too
    starts = mask & ~before
    span = torch.cumsum(starts.flatten(), 0) - 1  # (B * (L - 1),) span index of each answer position
    n_spans = int(starts.sum())
    if n_spans == 0:
        return loss, logits.new_zeros(())
    wrong = torch.zeros(n_spans, dtype=torch.bool, device=logits.device)
    wrong[span[(mask & ~right).flatten()]] = True
    return loss, 1.0 - wrong.float().mean()
