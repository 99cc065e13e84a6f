"""Per-layer attention patterns: `model.layer_pattern`, a string of layer kinds repeated over the depth.

- `G`: a global layer, the model's `attn_op` over the full (causal / prefix) mask;
- `L`: a local layer, the model's `attn_op` under the sliding window `model.window`;
- any other capital letter X: a global layer running the attention operation `model.pattern_ops` names for it
  (a recurrent one, Gated DeltaNet, without `model.gate`: it has its own output gate),
  "X:op" (several: "X:op,Y:op", quoted on the command line), with the model-wide knobs of that op; e.g. a hybrid
  of linear attention with a softmax layer every fourth: `model.attn_op=kernel model.layer_pattern=GGGS
  model.pattern_ops=S:softmax`.

The pattern repeats over the depth and is cut at model.n_layer, as Gemma 3's 5:1 pattern over its 26 layers
(4 x LLLLLG + LL); refused: a pattern longer than n_layer, a local layer without model.window, model.window without
a local layer (it would do nothing), an undefined letter and a defined one left unused. null (the default): every
layer alike, model.window (if set) in every layer. The knobs belong to the block layouts (`pre`, `post`).

A layer's attention is built from its own config (`layer_config`: the model's, with its op and its window), so an op
is the same component in a pattern as alone; local layers get the layout's `windowed` variant (masks.py), which runs
fused (SDPA with the window mask, or FlexAttention's block mask) as a windowed model does.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from .knobs import KNOBS
from .registry import ATTENTION_OPS, GATES, Component, ConfigError

GLOBAL, LOCAL = "G", "L"


class LayerPattern(Component):
    """The knobs and rules of `model.layer_pattern` (mixed into the block layouts)."""

    @dataclasses.dataclass
    class Knobs:
        # the contract tests try: every layer alike, a local and a global layer, a kernel or Gated DeltaNet layer
        # among softmax ones
        layer_pattern: Optional[str] = dataclasses.field(default=None, metadata={"cases": (None, "LG", "GK")})
        pattern_ops: Optional[str] = dataclasses.field(
            default=None, metadata={"cases": (None, "K:kernel", "K:gated_deltanet")})

    llama_knobs = {"layer_pattern": None, "pattern_ops": None}

    @classmethod
    def contract_needs(cls, case: dict) -> dict:
        """What a contract case needs to build: a window (5 positions) for its local layers."""
        return {"window": 5} if LOCAL in (case.get("layer_pattern") or "") else {}

    @classmethod
    def validate(cls, cfg: Any) -> None:
        pattern, ops = cfg.layer_pattern, pattern_ops(cfg)
        if pattern is None:
            if ops:
                raise ConfigError(f"model.pattern_ops={cfg.pattern_ops} names ops for the letters of a layer pattern, "
                                  "but model.layer_pattern is null; set a pattern (e.g. layer_pattern=GGGS) or "
                                  "pattern_ops=null")
            return
        if not isinstance(pattern, str) or not re.fullmatch(r"[A-Z]+", pattern):
            raise ConfigError(f"model.layer_pattern={pattern!r} must be capital letters, one per layer (L local, "
                              f"G global, others from model.pattern_ops), e.g. LLLG; or null")
        if len(pattern) > cfg.n_layer:
            raise ConfigError(f"model.layer_pattern={pattern} has {len(pattern)} letters, more than model.n_layer="
                              f"{cfg.n_layer}; allowed: 1..{cfg.n_layer} letters (the pattern repeats over the "
                              f"depth), or model.n_layer >= {len(pattern)}")
        undefined = sorted(set(pattern) - {GLOBAL, LOCAL} - set(ops))
        if undefined:
            raise ConfigError(f"model.layer_pattern={pattern}: letter {undefined[0]} is not defined; allowed: L, G "
                              f"and the letters of model.pattern_ops (e.g. pattern_ops={undefined[0]}:softmax)")
        unused = sorted(set(ops) - set(pattern))
        if unused:
            raise ConfigError(f"model.pattern_ops defines {unused[0]}, which model.layer_pattern={pattern} never uses; "
                              f"remove it or use it in the pattern")
        if LOCAL in pattern and cfg.window is None:
            raise ConfigError(f"model.layer_pattern={pattern} has local layers (L) but model.window is null; "
                              f"set model.window (allowed: 1..{cfg.block_size})")
        if LOCAL not in pattern and cfg.window is not None:
            raise ConfigError(f"model.window={cfg.window} is used by no layer of model.layer_pattern={pattern} "
                              f"(no L); add local layers or set model.window=null")
        for letter in dict.fromkeys(pattern):  # each kind of layer builds: its op with the model's other switches
            try:
                layer_config(cfg, pattern.index(letter))
            except ConfigError as err:
                raise ConfigError(f"layer kind {letter} of model.layer_pattern={pattern}: {err}") from None


def pattern_ops(cfg: Any) -> dict[str, str]:
    """model.pattern_ops "X:op,Y:op" -> {"X": "op", ...} (empty when null), each op a registered attention op."""
    if cfg.pattern_ops is None:
        return {}
    ops = {}
    for item in str(cfg.pattern_ops).split(","):
        letter, _, op = item.strip().partition(":")
        if not re.fullmatch(r"[A-Z]", letter) or letter in (GLOBAL, LOCAL) or not op:
            raise ConfigError(f"model.pattern_ops={cfg.pattern_ops!r}: {item.strip()!r} must be LETTER:op with a "
                              f"capital letter other than L and G, e.g. S:softmax or K:kernel")
        if op not in ATTENTION_OPS:
            raise ConfigError(f"model.pattern_ops={cfg.pattern_ops!r}: {op!r} is not an attention op; allowed: "
                              f"{', '.join(ATTENTION_OPS.names())}")
        ops[letter] = op
    return ops


def layer_letter(cfg: Any, layer: int) -> Optional[str]:
    """The kind of layer `layer` (0-indexed) in model.layer_pattern, or None without a pattern."""
    return None if cfg.layer_pattern is None else cfg.layer_pattern[layer % len(cfg.layer_pattern)]


def is_local(cfg: Any, layer: int) -> bool:
    """Whether layer `layer` is a local layer of a pattern (its attention takes the layout's windowed mask)."""
    return layer_letter(cfg, layer) == LOCAL


def layer_ops(cfg: Any) -> set[str]:
    """Every attention op some layer runs: model.attn_op, and those of model.pattern_ops."""
    return {cfg.attn_op, *pattern_ops(cfg).values()}


def layer_config(cfg: Any, layer: int) -> Any:
    """The config layer `layer`'s attention is built from: `cfg` itself without a pattern; else `cfg` with the
    layer's op (its knobs as configured, the other ops' knobs at their defaults) and window (model.window for L, none
    otherwise), and no pattern; a recurrent op's layer (Gated DeltaNet) without model.gate, which gates the softmax
    layers only (the recurrent layer has its own output gate)."""
    letter = layer_letter(cfg, layer)
    if letter is None:
        return cfg
    op = pattern_ops(cfg).get(letter, cfg.attn_op)
    own = ATTENTION_OPS.get(op)
    foreign = {key: f.default for key, (f, owners) in KNOBS.items()
               if owners[0].registry is ATTENTION_OPS and own not in owners}
    if own.recurrent:  # a recurrent layer has its own output gate: model.gate gates the softmax layers
        foreign.update({key: f.default for key, (f, owners) in KNOBS.items() if owners[0].registry is GATES},
                       gate="none")
    return dataclasses.replace(cfg, **foreign, attn_op=op, window=cfg.window if letter == LOCAL else None,
                               layer_pattern=None, pattern_ops=None)
