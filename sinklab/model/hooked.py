"""TransformerLens's canonical hook names on a sinklab Transformer, and its `run_with_cache` / `run_with_hooks`.

The field's tools (SAE libraries, attention viewers such as attnview, TransformerLens's own utilities) key on these
names; `hook_names(model)` maps each to a hook point of the model (`sinklab.model.hooks`) or a module, with the
reshape between the point's tensor and TransformerLens's shape. Positions (`pos`) are the model's: the learned sink
tokens (model.n_sink_tokens) first, then the tokens; a K / KV bias slot is no position.

    blocks.{i}.hook_resid_pre      [batch, pos, d_model]  the block's input
    blocks.{i}.hook_resid_mid      [batch, pos, d_model]  between the attention and FFN sublayers (post-norm: normed)
    blocks.{i}.hook_resid_post     [batch, pos, d_model]  the block's output after model.residual_clip's clamp: the
                                                          same hook point as sinklab's `hook_resid`
    blocks.{i}.hook_attn_out       [batch, pos, d_model]  the attention sublayer's output (after o_proj, a G5 gate)
    blocks.{i}.hook_mlp_out        [batch, pos, d_model]  the FFN's output
    blocks.{i}.attn.hook_q         [batch, pos, head_index, d_head]     as projected (QK-norm, a G4 gate), before
    blocks.{i}.attn.hook_k / hook_v  [batch, pos, kv_head_index, d_head]  RoPE (sinklab's `hook_q_in` .. `hook_v_in`)
    blocks.{i}.attn.hook_rot_q     [batch, pos, head_index, d_head]     after RoPE (a RoPE layer only): sinklab's own
    blocks.{i}.attn.hook_rot_k     [batch, pos, kv_head_index, d_head]  `hook_q` / `hook_k`, without the bias slot
                                                                        and the kv heads' repeat
    blocks.{i}.attn.hook_attn_scores [batch, head_index, query_pos, key_pos]  the logits (scaled, position biases
                                   added), -inf where a key is not seen; an op with one matrix of logits only (not
                                   differential, kernel, NSA, DSA)
    blocks.{i}.attn.hook_pattern   [batch, head_index, query_pos, key_pos]  the map the metrics score, over the
                                   positions: rows sum to one for softmax; to less than one where the rest goes to a
                                   sink logit (model.attn_op=softmax with a learned / off-by-one logit) or a bias slot
                                   (hook_slot_pattern); to anything for ops that do not normalise (sigmoid, ReLU,
                                   differential attention: `row_normalised` false)
    blocks.{i}.attn.hook_slot_pattern [batch, head_index, query_pos, n_slots]  a K / KV bias slot's share (with one)
    blocks.{i}.attn.hook_z         [batch, pos, head_index, d_head]  each head's output, o_proj's input (after the
                                   op's output, the head norm, a V bias and a G1 gate)
    hook_embed                     [batch, token, d_model]  the token embeddings (without sink tokens or positions)
    ln_final.hook_normalized       [batch, token, d_model]  the final norm's output (its weight applied): the LM
                                   head's input (pre-norm models; a post-norm model has no final norm)

A hook on hook_attn_scores, hook_pattern or hook_slot_pattern makes that layer compute its whole map explicitly
(`Attention.hooked_map`); without one nothing is computed for them. A hook that returns a replacement changes the
forward: the layer then attends with the returned map (an op whose branches have values of their own, NSA, refuses).
sinklab's own hook points (`hook_q` etc. after RoPE with the bias slot, `hook_extra`, NSA's `hook_gate`) stay
where they are, for `register_forward_hook`; in these names `hook_q` is TransformerLens's (before RoPE).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from sinklab.errors import UserError

from .ops.base import AttentionOp

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookFn = Callable[[torch.Tensor, "HookSite"], Optional[torch.Tensor]]

# `cache["pattern", 0]`: TransformerLens's short names (utils.get_act_name) -> the name's template
SHORT_NAMES = {"resid_pre": "blocks.{}.hook_resid_pre", "resid_mid": "blocks.{}.hook_resid_mid",
               "resid_post": "blocks.{}.hook_resid_post", "attn_out": "blocks.{}.hook_attn_out",
               "mlp_out": "blocks.{}.hook_mlp_out", "q": "blocks.{}.attn.hook_q", "k": "blocks.{}.attn.hook_k",
               "v": "blocks.{}.attn.hook_v", "rot_q": "blocks.{}.attn.hook_rot_q", "rot_k": "blocks.{}.attn.hook_rot_k",
               "attn_scores": "blocks.{}.attn.hook_attn_scores", "pattern": "blocks.{}.attn.hook_pattern",
               "attn": "blocks.{}.attn.hook_pattern", "slot_pattern": "blocks.{}.attn.hook_slot_pattern",
               "z": "blocks.{}.attn.hook_z"}


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def swap_12(t: torch.Tensor) -> torch.Tensor:
    """(B, h, N, hd) <-> (B, N, h, hd), a view."""
    return t.transpose(1, 2)


@dataclass(frozen=True)
class HookSite:
    """A canonical name on a model: the module whose output it is, `to_name` (the module's output -> the name's
    shape) and `from_name` (a replacement in the name's shape, the module's output -> the module's output). The
    `hook` a hook function receives (TransformerLens's fn(tensor, hook): `hook.name`, `hook.layer()`)."""

    name: str
    module: nn.Module
    to_name: Callable[[torch.Tensor], torch.Tensor] = same
    from_name: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda new, _out: new

    def layer(self) -> Optional[int]:
        match = re.match(r"blocks\.(\d+)\.", self.name)
        return int(match.group(1)) if match else None

    def attach(self, fn: HookFn) -> torch.utils.hooks.RemovableHandle:
        """fn(tensor in the name's shape, self) on every forward; a tensor it returns replaces the module's output."""
        def hook(_module, _inputs, out):
            new = fn(self.to_name(out), self)
            return None if new is None else self.from_name(new, out)
        return self.module.register_forward_hook(hook)


def rotated_keys(attn) -> tuple[Callable, Callable]:
    """sinklab's hook_k (B, H, n_slots + P, hd), the kv heads repeated -> (B, P, Hkv, hd), and back."""
    n, group = attn.attn_bias.n_slots, attn.n_head // attn.n_kv

    def to_name(t: torch.Tensor) -> torch.Tensor:
        return t[:, ::group, n:].transpose(1, 2)  # one head of each kv group: the repeat's copies are adjacent

    def from_name(new: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        keys = new.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hkv, P, hd) -> (B, H, P, hd)
        return torch.cat([out[:, :, :n], keys.to(out.dtype)], dim=2)
    return to_name, from_name


def hook_names(model) -> dict[str, HookSite]:
    """Every canonical name of a sinklab Transformer (module docstring), in forward order per layer."""
    sites = [HookSite("hook_embed", model.tok_emb)]
    rotary = model.pos.rotary(1) is not None  # RoPE (in the layers that `rotate`: not a NoPE layer of nope_every)
    for i, block in enumerate(model.blocks):
        attn, p = block.attn, f"blocks.{i}."
        sites += [HookSite(p + "hook_resid_pre", block.hook_resid_pre),
                  HookSite(p + "attn.hook_q", attn.hook_q_in), HookSite(p + "attn.hook_k", attn.hook_k_in),
                  HookSite(p + "attn.hook_v", attn.hook_v_in)]
        if rotary and attn.rotates:
            sites += [HookSite(p + "attn.hook_rot_q", attn.hook_q, swap_12, lambda new, _out: swap_12(new)),
                      HookSite(p + "attn.hook_rot_k", attn.hook_k, *rotated_keys(attn))]
        if type(attn.op).probs is AttentionOp.probs:
            sites.append(HookSite(p + "attn.hook_attn_scores", attn.hook_attn_scores))
        sites.append(HookSite(p + "attn.hook_pattern", attn.hook_pattern))
        if attn.attn_bias.n_slots:
            sites.append(HookSite(p + "attn.hook_slot_pattern", attn.hook_slot_pattern))
        sites += [HookSite(p + "attn.hook_z", attn.hook_z), HookSite(p + "hook_attn_out", attn),
                  HookSite(p + "hook_resid_mid", block.hook_resid_mid), HookSite(p + "hook_mlp_out", block.ffn),
                  HookSite(p + "hook_resid_post", block.hook_resid)]
    if not isinstance(model.norm, nn.Identity):
        sites.append(HookSite("ln_final.hook_normalized", model.norm))
    return {s.name: s for s in sites}


def selected(sites: dict[str, HookSite], names: NamesFilter, what: str) -> list[HookSite]:
    """The sites a names filter picks (TransformerLens's: None every name, a name, a list of names, or a function of
    the name); a name the model does not have is a one-line UserError."""
    if names is None:
        return list(sites.values())
    if callable(names):
        return [s for name, s in sites.items() if names(name)]
    wanted = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in sites]
    if unknown:
        templates = sorted({re.sub(r"^blocks\.\d+\.", "blocks.{i}.", n) for n in sites})
        raise UserError(f"{what} {unknown[0]!r}: not a hook name of this model; allowed (i < {count_layers(sites)}): "
                        + ", ".join(templates))
    return [sites[n] for n in wanted]


def count_layers(sites: dict[str, HookSite]) -> int:
    return 1 + max((s.layer() for s in sites.values() if s.layer() is not None), default=-1)


def read_only(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`from_name` of a name whose tensor a hook may read but not replace."""
    def refuse(_new: torch.Tensor, _out) -> torch.Tensor:
        raise UserError(f"a hook on {name} returned a tensor: this name is read-only on this model; allowed: a hook "
                        "that returns None")
    return refuse


@contextlib.contextmanager
def hooks(sites: dict[str, HookSite], fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]]
          ) -> Iterator[None]:
    """Inside, each (name or filter, fn) of `fwd_hooks` is attached to every site of `sites` it picks; all are
    removed on the way out, also when the forward (or a hook) raised."""
    picked = [(site, fn) for names, fn in fwd_hooks for site in selected(sites, names, "fwd_hooks")]
    handles = []
    try:
        for site, fn in picked:
            handles.append(site.attach(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()


class ActivationCache(dict):
    """name -> tensor (detached), as TransformerLens's ActivationCache: `cache["blocks.0.attn.hook_pattern"]`, or by
    its short name and layer, `cache["pattern", 0]` (SHORT_NAMES; a negative layer counts from the last)."""

    def __init__(self, tensors: dict[str, torch.Tensor], n_layer: int):
        super().__init__(tensors)
        self.n_layer = n_layer

    def __getitem__(self, key):
        if isinstance(key, tuple):
            short, layer = key
            if short not in SHORT_NAMES:
                raise KeyError(f"{short!r}: not a short hook name; allowed: {', '.join(SHORT_NAMES)}")
            key = SHORT_NAMES[short].format(layer + self.n_layer if layer < 0 else layer)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True


def cached(sites: dict[str, HookSite], names_filter: NamesFilter,
           forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ActivationCache]:
    """(forward(), the activations at the sites `names_filter` picks, detached)."""
    tensors: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, hook: HookSite) -> None:
        tensors[hook.name] = t.detach()
    picked = selected(sites, names_filter, "names_filter")
    with hooks(sites, [(site.name, keep) for site in picked]):
        logits = forward()
    return logits, ActivationCache(tensors, count_layers(sites))


def run_with_hooks(model, idx: torch.Tensor, fwd_hooks: Sequence[tuple], **forward) -> torch.Tensor:
    """A sinklab Transformer's model(idx, **forward) with `fwd_hooks` attached (TransformerLens's fn(tensor, hook)
    -> None or a replacement), removed afterwards."""
    with hooks(hook_names(model), fwd_hooks):
        return model(idx, **forward)


def run_with_cache(model, idx: torch.Tensor, names_filter: NamesFilter = None,
                   **forward) -> tuple[torch.Tensor, ActivationCache]:
    """(logits of a sinklab Transformer's model(idx, **forward), the activations at the names `names_filter` picks,
    detached); reading the maps changes no logit."""
    return cached(hook_names(model), names_filter, lambda: model(idx, **forward))
