"""Retrieval under KV-cache eviction: the exact-match accuracy of a planted key (passkey) or of associative recall
(MQAR) when the model reads its prompt through a cache that keeps a budget of keys chosen by a policy
(`sinklab.model.cache_policies`), against the dense cache (`REFERENCE`), which keeps every key.

Two protocols, the two the field uses:
- prefill: the prompt before the question (`Sample.ask`) in one forward with every key, then the cache compressed to
  the budget once, then the question and its answer read through it (kvpress's protocol: compress at prefill, ask
  after; kvpress with its KeyRerotationPress, that is: the kept keys move to their places in the cache and are
  re-rotated there, where a plain kvpress press leaves every key at the position it came in at, so the question's
  positions continue from the prompt's length, not from the keys kept);
- decoding: the sample fed token by token, the cache evicting to the budget after each (StreamingLLM). The first
  budget + 1 tokens go in one forward: no key is evicted before then, and every policy's state is that of feeding
  them one at a time.
Answers are scored teacher-forced (`sinklab.data.retrieval.answer_scores`: a span is right when the argmax at each of
its tokens is that token, which is greedy decoding's exact match). Beside the accuracy each setting reports what the
cache held when the question came: the share of (layer, kv head) kept sets that hold the first text token (token 1,
the BOS token where the data has one) and the share that hold the whole key (passkey's planted digits; MQAR's pairs).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from sinklab.errors import UserError
from sinklab.evals.registry import EVALUATIONS, NON_NEGATIVE, UNIT, Evaluation
from sinklab.model.cache_policies import CACHE_POLICIES, CachePolicy, Dense, build, knob_defaults
from sinklab.targets.interface import Target

PROTOCOLS = ("prefill", "decoding")
REFERENCE = Dense.name  # the policy of the reference setting, run first: no eviction


@dataclass(frozen=True)
class Setting:
    """One cache: a protocol, a policy and its budget (text keys kept; None: dense), the policy's knobs."""

    protocol: str
    policy: str
    budget: Optional[int]
    knobs: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def label(self) -> str:
        """Its column prefix in a sweep's CSV, e.g. prefill_h2o_b16 (dense: prefill_dense)."""
        return f"{self.protocol}_{self.policy}" + ("" if self.budget is None else f"_b{self.budget}")

    def make(self) -> CachePolicy:
        return build(self.policy, self.budget, **self.knobs)


def with_knob(task, name: str, value):
    """A copy of a retrieval task with one knob set (passkey's depth, mqar's n_pairs), checked as the config checks
    it."""
    if name not in task.KNOBS:
        raise UserError(f"--grid {name}: task {task.name} has no knob {name!r}; its knobs: {', '.join(task.KNOBS)}")
    from sinklab.data.retrieval import RetrievalConfig

    out = copy.copy(task)
    out.knobs = {**task.knobs, name: value}
    RetrievalConfig(task=task.name, **out.knobs)  # the knob's rule, one line naming it
    setattr(out, name, value)
    return out


def read_at_end(task, grid_knob: str):
    """The task as evaluated: a passkey task trained with its question anywhere (query_at null) asks at the sample's
    end (query_at=1), unless the grid varies query_at; samples of one question place also read as one batch."""
    if getattr(task, "query_at", 1.0) is None and grid_knob != "query_at":
        return with_knob(task, "query_at", 1.0)
    return task


def key_positions(sample) -> np.ndarray:
    """Positions (text indices) of what the question asks for: passkey's planted key digits (the answer's tokens
    before the question), or, for a task whose answers each follow their key, every answer token's earlier twin."""
    tokens, answer, ask = sample.tokens, sample.answer, sample.ask
    wanted = set(tokens[answer].tolist())
    return np.array([i for i in range(ask) if tokens[i] in wanted], dtype=np.int64)


@torch.no_grad()
def run_batch(target: Target, samples: Sequence, setting: Setting) -> list[dict]:
    """Samples of one length and one question place through one cache each, as a batch: per sample its answer loss
    and span accuracy, and whether the kept sets held the first text token and the whole key when the question came
    (the share of (layer, kv head) sets)."""
    from sinklab.data.retrieval import answer_scores

    tokens = torch.as_tensor(np.stack([s.tokens for s in samples]), device=target.device)  # (B, L)
    B, L = tokens.shape
    ask = samples[0].ask
    dec = target.decoder(setting.make(), "prefill" if setting.protocol == "prefill" else "decoding")
    if setting.protocol == "prefill":
        first = dec(tokens[:, :ask])
        dec.compress()
        kept = dec.kept()
        logits = torch.cat([first, dec(tokens[:, ask:L - 1])], dim=1)  # (B, L - 1, V)
    else:
        head = min(L - 1, ask, (setting.budget or L) + 1)
        parts, kept = [dec(tokens[:, :head])], None
        for t in range(head, L - 1):
            if t == ask:
                kept = dec.kept()
            parts.append(dec(tokens[:, t:t + 1]))
        kept = kept if kept is not None else dec.kept()
        logits = torch.cat(parts, dim=1)
    kept = torch.cat(kept, dim=1)  # (B, layers x Hkv, K): every layer's kept sets
    out = []
    for b, sample in enumerate(samples):
        answer = torch.as_tensor(sample.answer, device=tokens.device)[None]
        loss, acc = answer_scores(logits[b:b + 1], tokens[b:b + 1], answer)
        keys = torch.as_tensor(key_positions(sample), device=tokens.device)
        held = kept[b]  # (layers x Hkv, K)
        out.append({"loss": float(loss), "accuracy": float(acc),
                    "first_kept": float((held == 0).any(-1).float().mean()),
                    "key_kept": float(torch.stack([torch.isin(keys, row).all() for row in held]).float().mean())
                    if len(keys) else None})
    return out


def run_sample(target: Target, sample, setting: Setting) -> dict:
    """One sample through one cache (`run_batch` of one)."""
    return run_batch(target, [sample], setting)[0]


def batches(samples: Sequence, setting: Setting, size: int = 16) -> list[list]:
    """The samples in batches of one length and question place (a masking policy's, one at a time)."""
    if CACHE_POLICIES.get(setting.policy).masks:
        return [[s] for s in samples]
    groups: dict[tuple[int, int], list] = {}
    for s in samples:
        groups.setdefault((len(s.tokens), s.ask), []).append(s)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


def evaluate(target: Target, samples_by_cell: dict, settings: Sequence[Setting],
             progress: Optional[Callable[[int], None]] = None) -> list[dict]:
    """Every setting on every grid cell's samples ({grid value: [Sample, ...]}): per setting, per cell, the mean
    accuracy, answer loss and kept shares (`run_sample`)."""
    out = []
    for setting in settings:
        cells = {}
        for value, samples in samples_by_cell.items():
            rows = [r for batch in batches(samples, setting) for r in run_batch(target, batch, setting)]
            if progress is not None:
                progress(len(rows))
            keyed = [r["key_kept"] for r in rows if r["key_kept"] is not None]
            cells[value] = {"accuracy": float(np.mean([r["accuracy"] for r in rows])),
                            "loss": float(np.mean([r["loss"] for r in rows])),
                            "first_kept": float(np.mean([r["first_kept"] for r in rows])),
                            "key_kept": float(np.mean(keyed)) if keyed else None}
        mean = {k: float(np.mean([c[k] for c in cells.values() if c[k] is not None]))
                if any(c[k] is not None for c in cells.values()) else None
                for k in ("accuracy", "loss", "first_kept", "key_kept")}
        out.append({"protocol": setting.protocol, "policy": setting.policy, "budget": setting.budget,
                    "knobs": setting.knobs, "knobs_used": setting.make().knobs(), "label": setting.label,
                    "cells": cells, **mean})
    return out


class Recording(Dense):
    """A dense cache policy that keeps every layer's maps (per kv head, summed over its query heads) in its state:
    how `head_scores` reads a model's attention through the same interface for every model source."""

    needs_maps = True

    def __init__(self, budget: Optional[int] = None):
        super().__init__(None)
        self.layers: list[dict] = []  # each layer's state, in the order the forward reaches them

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        if not any(s is state for s in self.layers):
            self.layers.append(state)
        state.setdefault("maps", []).append(probs)


@torch.no_grad()
def head_scores(target: Target, samples: Sequence, first: int = 4, recent: int = 16, batch: int = 16) -> list[dict]:
    """Per (layer, kv head), averaged over the samples read densely (samples of one length `batch` to a forward;
    maps averaged over a GQA group's query heads):
    - alpha_1: the attention on the first text token, averaged over every query (the sink metric's alpha_1);
    - retrieval: the attention the queries that predict an answer token put on the key's tokens (`key_positions`):
      how much the head reads what the question asks for (a retrieval head);
    - streaming: the share of attention outside the first `first` + the `recent` latest keys, averaged over every
      query: what the head loses when it becomes a streaming head (DuoAttention's concern, measured on the fly).
    "Are sink heads the streaming heads?" is alpha_1 against retrieval."""
    sums: dict[tuple[int, int], np.ndarray] = {}
    by_length: dict[int, list] = {}
    for sample in samples:
        by_length.setdefault(len(sample.tokens), []).append(sample)
    chunks = [group[i:i + batch] for group in by_length.values() for i in range(0, len(group), batch)]
    for chunk in chunks:
        policy = Recording()
        dec = target.decoder(policy)
        tokens = torch.as_tensor(np.stack([s.tokens for s in chunk]), device=target.device)  # (B, L)
        dec(tokens[:, :-1])
        T = tokens.shape[1] - 1
        q = torch.arange(T, device=tokens.device)[:, None]
        k = torch.arange(T, device=tokens.device)[None, :]
        outside = ((k >= first) & (k < q - recent + 1)).float()  # (T, T) keys a streaming head drops
        for layer, state in enumerate(policy.layers):
            maps = state["maps"][0]  # (B, Hkv, T, T), summed over each group's query heads
            group = target_group(target, maps.shape[1])
            first_share = maps[..., 0].mean(-1)  # (B, Hkv)
            lost = (maps * outside).sum(-1).mean(-1)  # (B, Hkv)
            for b, sample in enumerate(chunk):
                keys = torch.as_tensor(key_positions(sample), device=tokens.device)
                rows = torch.as_tensor(np.flatnonzero(sample.answer) - 1, device=tokens.device)  # answers' queries
                read = (maps[b][:, rows][:, :, keys].sum(-1).mean(-1) if len(keys) and len(rows)
                        else maps.new_zeros(maps.shape[1]))  # (Hkv,)
                values = torch.stack([first_share[b], read, lost[b]], dim=-1) / group  # (Hkv, 3)
                for h, row in enumerate(values.cpu().numpy()):
                    sums[layer, h] = sums.get((layer, h), 0) + row
    return [{"layer": layer, "head": h, "alpha_1": float(v[0] / len(samples)), "retrieval": float(v[1] / len(samples)),
             "streaming": float(v[2] / len(samples))} for (layer, h), v in sorted(sums.items())]


def measured_duo(setting: Setting, heads: list[dict]) -> Setting:
    """A setting whose policy takes its retrieval heads named (a `heads` knob, DuoAttention's) with them named: the
    `retrieval` share (its knob) of the (layer, kv head)s with the highest measured retrieval score
    (`head_scores`); other settings unchanged."""
    knobs = knob_defaults(CACHE_POLICIES.get(setting.policy))
    if "heads" not in knobs:
        return setting
    share = setting.knobs.get("retrieval", knobs["retrieval"])
    ranked = sorted(heads, key=lambda h: -h["retrieval"])[:int(round(share * len(heads)))]
    return Setting(setting.protocol, setting.policy, setting.budget,
                   {**setting.knobs, "heads": [[h["layer"], h["head"]] for h in ranked]})


def heads_by_sink(heads: list[dict], eps: float = 0.3) -> dict:
    """The mean retrieval score of the sink heads (alpha_1 > eps, the sink metric's threshold) and of the others
    (None where a group is empty)."""
    sink = [h["retrieval"] for h in heads if h["alpha_1"] > eps]
    other = [h["retrieval"] for h in heads if h["alpha_1"] <= eps]
    return {"sink_heads": len(sink), "sink_heads_retrieval": float(np.mean(sink)) if sink else None,
            "other_heads_retrieval": float(np.mean(other)) if other else None}


def target_group(target: Target, n_kv: int) -> int:
    """Query heads per kv head of the target's attention (1 without GQA)."""
    cfg = getattr(target.model, "cfg", None)
    n_head = cfg.n_head if cfg is not None else getattr(getattr(target.model, "config", None), "num_attention_heads",
                                                         n_kv)
    return max(1, n_head // n_kv)


# ----------------------------------------------------------------------------------------------------- in sweeps
UNRECORDED = {"pooling": "sinklab"}  # a rule's value in results written before `knobs_used`, where not its default


def rules_used(setting: dict) -> dict:
    """The rules (`CachePolicy.rules`) a result's setting ran with: its `knobs_used`; in a result written before
    those were recorded, the knobs it was given over the values sinklab had then (SnapKV's pooling: sinklab's, the
    only one; every other rule: its default)."""
    cls = CACHE_POLICIES.get(setting["policy"])
    if not cls.rules:
        return {}
    used, given = setting.get("knobs_used"), setting.get("knobs", {})
    if used is None:
        used = {**build(setting["policy"], setting["budget"], **given).knobs(), **UNRECORDED, **given}
    return {k: used[k] for k in cls.rules}


_LABEL = r"(prefill|decoding)_[a-z0-9]+(_b\d+)?"


@EVALUATIONS.register("retrieval")
class Retrieval(Evaluation):
    """`sinklab eval retrieval`; in a sweep's retrieval.csv, per setting (e.g. prefill_h2o_b16): <setting>_acc (the
    mean exact-match accuracy over the grid), <setting>_first_kept and <setting>_key_kept (the share of kept sets
    holding token 1 / the key), <setting>_<rule> for each of its policy's `rules` (the knob choosing the reference's
    rule or another: prefill_snapkv_b16_pooling = reference or sinklab), then chance, n_samples and eval_seed (the
    samples' seed, `--seed`: jobs evaluated at different seeds are told apart in one CSV)."""

    command = "sinklab.cli.retrieval"
    summary = "exact-match retrieval of a planted key under KV-cache eviction policies and budgets"
    bounds = ((rf"^{_LABEL}_(acc|first_kept|key_kept)$", UNIT), (rf"^{_LABEL}_loss$", NON_NEGATIVE),
              (r"^chance$", UNIT), (r"^(n_samples|sink_heads|(sink|other)_heads_retrieval)$", NON_NEGATIVE),
              (r"^heads_rho$", (-1.0, 1.0)), (r"^eval_seed$", NON_NEGATIVE))
    settings = {"settings": "label"}
    same = ("source", "task", "grid", "length", "context", "n_samples", "seed")

    @staticmethod
    def row(result: dict) -> dict:
        row = {}
        for s in result["settings"]:
            row.update({f"{s['label']}_acc": s["accuracy"], f"{s['label']}_loss": s["loss"],
                        f"{s['label']}_first_kept": s["first_kept"], f"{s['label']}_key_kept": s["key_kept"]})
            row.update({f"{s['label']}_{k}": v for k, v in rules_used(s).items()})
        return {**row, "sink_heads": result["sink_heads"], "sink_heads_retrieval": result["sink_heads_retrieval"],
                "other_heads_retrieval": result["other_heads_retrieval"],
                "heads_rho": result["heads_rank_correlation"], "chance": result["chance"],
                "n_samples": result["n_samples"], "eval_seed": result.get("seed")}
