"""Induction and previous-token scores per head (Olsson et al. 2022, "In-context Learning and Induction Heads"; the
definitions of TransformerLens's repeated-token test), on an input of its own: repeated random tokens.

Input (`own_input`, the same on every call): N = 8 sequences [t_0, r_1 .. r_L, r_1 .. r_L] of 2L + 1 tokens with
L = (T0 - 1) // 2 for the given probe input of length T0 (31 at T0 = 64). t_0 is the first token of a probe sequence
(the BOS token in runs whose data puts one first, as the default run's probe set does); the r_j are drawn uniformly,
with a fixed seed, from the distinct token ids of the probe input after its first column, so that they are ids the
model has seen in training.

With A the head's map over the real tokens (0-based positions; |A| / sum |A| where rows do not sum to one):
- previous-token score = the mean over queries i = 1 .. 2L of A[i, i-1];
- induction score = the mean over the queries of the second repeat, i = L+1 .. 2L, of A[i, i-L+1]: the attention on
  the token that followed the earlier occurrence of the query's token (TransformerLens's stripe, offset L-1).
Each is in [0, 1] and is averaged over the sequences. Logged: act/induction_score and act/prev_token_score (the
best head of the model), act/layer<i>/induction_score and act/layer<i>/prev_token_score (the best head of layer i),
so that a trajectory shows which forms first; for a sinklab model, by head type (the `heads` metric's split,
sinklab/metrics/heads.py) heads/<type>/induction and heads/<type>/prev_token: the best head's among the heads of each
type present. `measure --json` induction: {seq_len, repeat, num_seqs, seed, by_head {induction, prev_token: [[per
head] per layer]}, by_layer (the best head's), induction, prev_token, by_type {type: {induction, prev_token (the best
head's), induction_mean, prev_token_mean (the mean over the type's heads)}} (sinklab models only)}.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sinklab.keys import ACT_PREFIX

from .base import METRICS, UNIT, Context, Metric, layer_table
from .heads import HEADS_PREFIX, head_types, type_scores
from .sink import renormalise

NUM_SEQS = 8
SEED = 0
SCORES = ("induction", "prev_token")


def repeated_tokens(tokens: torch.Tensor, num_seqs: int = NUM_SEQS, seed: int = SEED) -> torch.Tensor:
    """The probe input (N0, T0) -> (num_seqs, 2L + 1): its first tokens, then L random ids of it, repeated once."""
    tokens = tokens.cpu()
    L = max(1, (tokens.shape[1] - 1) // 2)
    pool = torch.unique(tokens[:, 1:]) if tokens.shape[1] > 1 else torch.unique(tokens)  # sorted distinct ids
    gen = torch.Generator().manual_seed(seed)
    r = pool[torch.randint(0, pool.numel(), (num_seqs, L), generator=gen)]  # (N, L)
    first = tokens[torch.arange(num_seqs) % tokens.shape[0], :1]  # (N, 1)
    return torch.cat([first, r, r], dim=1)


@METRICS.register("induction")
class InductionScores(Metric):
    records = frozenset({"maps"})
    bounds = ((r"^act/(layer\d+/)?(induction|prev_token)_score$", UNIT),
              (r"^heads/\w+/(induction|prev_token)$", UNIT))
    json_key = "induction"
    headline = ("act/induction_score", "act/prev_token_score")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.repeat: Optional[int] = None  # L, known once the input is built
        self.batch: dict[str, dict[int, torch.Tensor]] = {name: {} for name in SCORES}  # layer -> (B, H) sums
        self.sums: dict[str, torch.Tensor] = {}  # (L, H) sums over sequences
        self.n = 0

    def own_input(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = repeated_tokens(tokens)
        self.repeat = (ids.shape[1] - 1) // 2
        return ids

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        a = maps.double()
        if self.ctx.row_normalised is not True:
            a = renormalise(a)
        a = a[..., self.ctx.n_extra:]  # (B, H, R, T): the real keys
        L = self.repeat
        for name, offset, first in (("prev_token", 1, 1), ("induction", L - 1, L + 1)):
            queries = rows >= first  # (R,)
            keys = (rows - offset).clamp_min(0)  # the key each query row is scored on
            picked = a[:, :, torch.arange(rows.numel(), device=a.device), keys]  # (B, H, R)
            s = (picked * queries).sum(-1)  # (B, H)
            self.batch[name][layer] = self.batch[name][layer] + s if layer in self.batch[name] else s

    def end_batch(self) -> None:
        if not self.batch["induction"]:
            return
        L, T = self.repeat, 2 * self.repeat + 1
        for name, count in (("prev_token", T - 1), ("induction", L)):
            per_seq = torch.stack([self.batch[name][i] for i in sorted(self.batch[name])], 1).cpu() / count
            self.sums[name] = self.sums[name] + per_seq.sum(0) if name in self.sums else per_seq.sum(0)  # (L, H)
            self.batch[name] = {}
            n = per_seq.shape[0]
        self.n += n

    def result(self) -> dict[str, Any]:
        by_head = {name: self.sums[name] / self.n for name in SCORES}  # (L, H)
        out = {"seq_len": 2 * self.repeat + 1, "repeat": self.repeat, "num_seqs": self.n, "seed": SEED,
               "by_head": {name: v.tolist() for name, v in by_head.items()},
               "by_layer": {name: v.max(1).values.tolist() for name, v in by_head.items()},
               **{name: v.max().item() for name, v in by_head.items()}}
        if self.ctx.model is not None:  # a sinklab model's config says each head's type
            types = head_types(self.ctx.model.cfg)
            by_type: dict[str, dict[str, float]] = {t: {} for t in types}
            for name, grid in by_head.items():
                for t, s in type_scores(grid, types).items():
                    by_type[t].update({name: s["max"], f"{name}_mean": s["mean"]})
            out["by_type"] = by_type
        return out

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {}
        for name in SCORES:
            out[f"{ACT_PREFIX}{name}_score"] = float(result[name])
            out.update({f"{ACT_PREFIX}layer{i}/{name}_score": float(v) for i, v in enumerate(result["by_layer"][name])})
        for t, scores in result.get("by_type", {}).items():
            out.update({f"{HEADS_PREFIX}{t}/{name}": float(scores[name]) for name in SCORES})
        return out

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """The best head's scores per layer and over all layers, then per head type (sinklab models)."""
        return [f"induction and previous-token scores of the best head per layer ({part['num_seqs']} sequences of "
                f"{part['repeat']} random tokens repeated)",
                *layer_table([("induction", part["by_layer"]["induction"], 9, 3),
                              ("prev tok", part["by_layer"]["prev_token"], 8, 3)],
                             overall=[part["induction"], part["prev_token"]]),
                *[f"{t + ' heads:':<15} induction {v['induction']:.3f}, prev tok {v['prev_token']:.3f} (best head)"
                  for t, v in part.get("by_type", {}).items()]]
