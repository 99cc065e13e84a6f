"""A Hugging Face causal LM's structure as sinklab reads it (its decoder layers, attention modules, context and
vocabulary), its queries, keys and values recomputed (`project_qkv`), its hook sites (`hook_sites`) and its
measurement (`HFRecorder`), for the transformers target (`transformers_lm.py`).

Every registered metric (`sinklab.metrics.METRICS`) measures a HF model through `HFRecorder`, the same way it
measures a sinklab model: attention maps come from ``output_attentions=True`` with the eager kernel (materialised,
one batch at a time, handed to the metrics layer by layer). The residual stream per layer is captured with forward
hooks on the decoder layers: HF's ``output_hidden_states`` replaces its last entry with the output of the final
norm, which would hide the last layer's massive activations. Queries, keys and values are recomputed from each
attention's input in a forward pre-hook (`project_qkv`: the model's own projections and, for RoPE models, its own
``apply_rotary_pos_emb`` on the (cos, sin) the model hands to the attention); the attention's output (after its
output projection) in a forward hook. Norm weights are not read from HF models (metrics with `needs_model`).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Optional

import torch
from einops import rearrange
from torch import nn

from sinklab.errors import UserError

ROW_SUM_TOL = 1e-3  # rows whose sum differs from 1 by more than this: the op is not row-normalised (Sink* reported)


def text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def context_length(model: nn.Module) -> Optional[int]:
    """The model's context (max_position_embeddings / n_positions), None when the config has none."""
    cfg = text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(model: nn.Module) -> int:
    """Rows of the input embedding (can exceed config.vocab_size when padded)."""
    emb = model.get_input_embeddings()
    return int(emb.num_embeddings) if emb is not None else int(text_config(model).vocab_size)


def decoder_layers(model: nn.Module) -> Optional[list]:
    """The decoder blocks: the first ModuleList with num_hidden_layers entries (model.layers, transformer.h, ...)."""
    n = getattr(text_config(model), "num_hidden_layers", None)
    if not n:
        return None
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return list(mod)
    return None


def attention_module(layer: nn.Module) -> Optional[nn.Module]:
    """The self-attention of a decoder layer (self_attn: LLaMA, Mistral, ...; attention: GPT-NeoX; attn: GPT-2)."""
    for name in ("self_attn", "attention", "attn"):
        mod = getattr(layer, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def heads(x: torch.Tensor, hd: int, norm: Optional[nn.Module] = None) -> torch.Tensor:
    """A projection (B, T, n * hd) -> (B, n, T, hd), through the attention's q_norm / k_norm when it has one: per
    head when the norm's weight has hd entries (Qwen3, Gemma3), over the whole projection otherwise (OLMo2)."""
    if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.numel() == hd:
        return rearrange(norm(rearrange(x, "b t (h d) -> b t h d", d=hd)), "b t h d -> b h t d")
    if norm is not None:
        x = norm(x)
    return rearrange(x, "b t (h d) -> b h t d", d=hd)


def project_qkv(attn: nn.Module, hidden: torch.Tensor, position_embeddings=None):
    """The attention's input hidden (B, T, d) -> q, k, v (B, H, T, hd) as the model attends with them: q and k
    through the attention's q_norm / k_norm if any, then RoPE (the model's own `apply_rotary_pos_emb` on the
    (cos, sin) the model passed to the attention, partial rotary included), the kv heads of grouped-query
    attention repeated to H as HF's repeat_kv does. None for a layout not known here.

    Layouts: q_proj / k_proj / v_proj (LLaMA, Mistral, Qwen2/3, Gemma2/3, OLMo2, OPT, gpt-oss, ...), qkv_proj with
    [q | k | v] over all heads (Phi-3), query_key_value with [q | k | v] per head (GPT-NeoX), c_attn with
    [q | k | v] over all heads (GPT-2). OPT scales q inside the attention: its q here is unscaled (the key
    statistics are norms of k and v and cosines, which a scale of q does not change)."""
    hd = getattr(attn, "head_dim", None)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if all(isinstance(getattr(attn, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj")) and \
            isinstance(hd, int):
        q, k, v = (heads(proj(hidden), hd, norm) for proj, norm in ((attn.q_proj, q_norm), (attn.k_proj, k_norm),
                                                                       (attn.v_proj, None)))
    elif isinstance(getattr(attn, "qkv_proj", None), nn.Module) and isinstance(hd, int) and q_norm is None:
        n_q = attn.config.num_attention_heads * hd
        n_kv = attn.config.num_key_value_heads * hd
        q, k, v = (heads(x, hd) for x in attn.qkv_proj(hidden).split([n_q, n_kv, n_kv], dim=-1))
    elif isinstance(getattr(attn, "query_key_value", None), nn.Module) and hasattr(attn, "head_size"):
        qkv = attn.query_key_value(hidden)  # (B, T, H * 3 * hd), per head [q | k | v]
        q, k, v = rearrange(qkv, "b t (h three d) -> three b h t d", three=3, d=attn.head_size)
    elif isinstance(getattr(attn, "c_attn", None), nn.Module) and isinstance(hd, int) and \
            not getattr(attn, "is_cross_attention", False):
        qkv = attn.c_attn(hidden)  # (B, T, 3 * H * hd): [q | k | v], each over all heads
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, d=hd)
    else:
        return None
    apply_rope = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if position_embeddings is not None:
        if apply_rope is None:
            return None
        cos, sin = position_embeddings
        q, k = apply_rope(q, k, cos, sin)
    elif apply_rope is not None:  # a RoPE model that did not hand (cos, sin) to its attention: cannot reproduce it
        return None
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, Hkv, T, hd) -> (B, H, T, hd)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return q, k, v


def has_sink_logits(layers: Optional[list]) -> bool:
    """Whether every attention has learned sink logits (gpt-oss: a `sinks` parameter, one logit per head that
    joins each row's softmax and is dropped from the map the model returns)."""
    return bool(layers) and all(isinstance(getattr(attention_module(layer), "sinks", None), nn.Parameter)
                                for layer in layers)


def first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def replace_first(new: torch.Tensor, output):
    """A module's output with its first tensor (the hidden states) replaced by `new`."""
    return (new, *output[1:]) if isinstance(output, tuple) else new


def returned_map(output) -> torch.Tensor:
    """The attention map (B, H, T, T) an eager attention module returns beside its output."""
    a = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
    if a is None:
        raise UserError("hook_pattern: the model's eager attention returned no attention map; this architecture is "
                        "not supported")
    return a


def hook_sites(model: nn.Module) -> dict:
    """TransformerLens's names that a transformers causal LM's modules give (`sinklab.model.hooked` lists them all),
    through forward hooks on them: hook_embed (the input embedding), blocks.{i}.hook_attn_out (the attention
    module's output, after its output projection), blocks.{i}.hook_resid_post (the decoder layer's output), and, read
    only, blocks.{i}.attn.hook_pattern (the map the eager kernel returns, what `sinklab measure --hf-model` scores)
    and, for learned sink logits (gpt-oss), blocks.{i}.attn.hook_slot_pattern (the logit's share, 1 - the row's
    sum). q, k, v, z and the scores are inside transformers' attention function, which has no hooks."""
    from sinklab.model.hooked import HookSite, read_only

    layers = decoder_layers(model)
    if not layers:
        raise UserError(f"run_with_cache: no list of decoder layers found in {type(model).__name__}; this "
                        "architecture is not supported")
    sites = [HookSite("hook_embed", model.get_input_embeddings())]
    sink_logits = has_sink_logits(layers)
    for i, layer in enumerate(layers):
        attn, p = attention_module(layer), f"blocks.{i}."
        if attn is not None:  # a layer without a self-attention module we know has its output only
            sites.append(HookSite(p + "attn.hook_pattern", attn, returned_map, read_only(p + "attn.hook_pattern")))
            if sink_logits:
                sites.append(HookSite(p + "attn.hook_slot_pattern", attn,
                                      lambda out: 1.0 - returned_map(out).sum(-1, keepdim=True),  # (B, H, T, 1)
                                      read_only(p + "attn.hook_slot_pattern")))
            sites.append(HookSite(p + "hook_attn_out", attn, first, replace_first))
        sites.append(HookSite(p + "hook_resid_post", layer, first, replace_first))
    return {site.name: site for site in sites}


class HFRecorder:
    """A Hugging Face causal LM as a measurement target (`sinklab.metrics.record`): forward hooks on each decoder
    layer (its output: the residual stream `h`), on its attention's input (a pre-hook recomputing `q`, `k`, `v`
    with `project_qkv`) and output (`attn`, after the output projection, and the attention map the eager kernel
    returns beside it); a layer's tensors and its map (one chunk of every row) go to the metrics when the layer
    has run and are dropped, so one layer's map is held at a time. Recorded tensors are handed over in float32.

    Learned sink logits (gpt-oss) are an extra key column, `sink_logit`, scored as the bias slot of a sinklab
    model is (`sink/slot_sink_logit`): its attention is the mass the sink took from the row, 1 - the row's sum.
    `row_normalised` is known after the maps were seen (every row, with that column, summed to one within 1e-3);
    `settle` tells the metrics. Key statistics are left out for attention layouts `project_qkv` does not know."""

    def __init__(self, model: nn.Module, mask=None):
        self.model, self.mask = model, mask  # mask: an intervention's (`sinklab.targets.transformers_masking`)
        self.layers = decoder_layers(model)
        tcfg = text_config(model)
        self.n_layer = len(self.layers) if self.layers else int(getattr(tcfg, "num_hidden_layers", 0) or 0)
        self.n_head = int(getattr(tcfg, "num_attention_heads", 0) or 0)
        self.sink_logits = has_sink_logits(self.layers)
        self.row_normalised = True

    def context(self, eps=(0.3,), k: int = 4):
        from sinklab.metrics import Context

        slots = ["sink_logit"] if self.sink_logits else []
        return Context(n_layer=self.n_layer, n_head=self.n_head, n_extra=len(slots), slot_names=slots,
                       row_normalised=None, eps=list(eps), k=k)

    def settle(self, metrics) -> None:
        for m in metrics:
            m.ctx.row_normalised = self.row_normalised

    @contextlib.contextmanager
    def hooks(self, names: set, on_layer) -> Iterator[None]:
        """Inside, forward hooks fill one dict per layer with `names` (and "map" when "maps" is asked for) and call
        on_layer(layer, dict) when the decoder layer has run (as `SinklabRecorder.hooks`)."""
        current: dict = {}
        handles = []

        def hidden(i):
            def hook(_module, _inputs, output):
                if "h" in names:
                    current["h"] = first(output).float()  # (B, T, d)
                rec = dict(current)
                current.clear()
                on_layer(i, rec)
            return hook

        def attn_out(_module, _inputs, output):
            if "attn" in names:
                current["attn"] = first(output).float()  # after the output projection
            if "maps" in names:
                current["map"] = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None

        def qkv(attn, args, kwargs):
            hidden_states = args[0] if args else kwargs.get("hidden_states")
            found = project_qkv(attn, hidden_states, kwargs.get("position_embeddings")) \
                if hidden_states is not None else None
            if found is not None:
                current.update(zip(("q", "k", "v"), (t.float() for t in found)))

        for i, layer in enumerate(self.layers):
            attn = attention_module(layer)
            if attn is not None and names & {"attn", "maps"}:
                handles.append(attn.register_forward_hook(attn_out))
            if attn is not None and names & {"q", "k", "v"}:
                handles.append(attn.register_forward_pre_hook(qkv, with_kwargs=True))
            handles.append(layer.register_forward_hook(hidden(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def with_sink_column(self, m: torch.Tensor) -> torch.Tensor:
        """(B, H, T, T) -> (B, H, T, 1 + T): the sink logit's share (1 - the row's sum) first, for gpt-oss."""
        return torch.cat([1.0 - m.sum(-1, keepdim=True), m], dim=-1) if self.sink_logits else m

    def run(self, idx: torch.Tensor, metrics) -> None:
        from sinklab.metrics.record import feed_maps

        names = set().union(*(m.records for m in metrics)) if metrics else set()
        device = next(self.model.parameters()).device
        idx = idx.to(device)
        rows = torch.arange(idx.shape[1], device=device)
        map_users = [m for m in metrics if "maps" in m.records]

        def on_layer(i: int, rec: dict) -> None:
            for m in metrics:
                m.update(i, {n: rec[n] for n in m.records if n in rec})
            if not map_users:
                return
            a = rec.get("map")
            if a is None:
                raise UserError("--hf-model: the model's eager attention returned no attention map; this "
                                "architecture is not supported")
            a = self.with_sink_column(a.float())  # (B, H, T, n_extra + T), one layer
            if self.row_normalised and (a.sum(-1) - 1).abs().max().item() > ROW_SUM_TOL:
                self.row_normalised = False
            feed_maps(metrics, i, lambda: [(rows, a)])

        if not self.layers:
            raise UserError(f"--hf-model: no list of {self.n_layer} decoder layers found in the model; this "
                            "architecture is not supported")
        from .transformers_masking import masked_attention

        with self.hooks(names, on_layer), masked_attention(self.model, self.mask):
            self.model(input_ids=idx, attention_mask=torch.ones_like(idx), use_cache=False, logits_to_keep=1)
