"""Measuring Hugging Face causal LMs (LLaMA, Mistral, GPT-2, GPT-NeoX, ...) with the sinklab metric.

transformers is an optional extra (``pip install 'sinklab[hf]'``); nothing here imports it at module level.

Every registered metric (`sinklab.metrics.METRICS`) measures a HF model through `HFTarget`, the same way it
measures a sinklab model: attention maps come from ``output_attentions=True`` with the eager kernel (materialised,
one batch at a time, handed to the metrics layer by layer). The residual stream per layer is captured with forward
hooks on the decoder layers: HF's ``output_hidden_states`` replaces its last entry with the output of the final
norm, which would hide the last layer's massive activations. Queries, keys and values are recomputed from each
attention's input in a forward pre-hook (`project_qkv`: the model's own projections and, for RoPE models, its own
``apply_rotary_pos_emb`` on the (cos, sin) the model hands to the attention); the attention's output (after its
output projection) in a forward hook. Norm weights are not read from HF models (metrics with `needs_model`).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import torch
from einops import rearrange
from torch import nn

from sinklab.errors import UserError

INSTALL_HINT = "--hf-model needs transformers, an optional extra: pip install 'sinklab[hf]'"
ROW_SUM_TOL = 1e-3  # rows whose sum differs from 1 by more than this: the op is not row-normalised (Sink* reported)


def require_transformers():
    """The transformers module, or a one-line UserError saying how to install it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return transformers


def dtype_kwargs(transformers, dtype: torch.dtype) -> dict:
    """`dtype=` for transformers >= 4.56, `torch_dtype=` before (the old name is deprecated in v5)."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_hf_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
                  dtype: torch.dtype = torch.float32, revision: Optional[str] = None) -> nn.Module:
    """A local causal-LM dir -> the model in eval mode with the eager attention kernel (maps available); `revision`
    goes to from_pretrained."""
    transformers = require_transformers()
    p = Path(path)
    if not p.is_dir():  # never let transformers read a missing path as a hub repo id
        raise UserError(f"--hf-model {path}: no such directory (pass a local dir written by save_pretrained)")
    if not (p / "config.json").is_file():
        raise UserError(f"--hf-model {path}: the directory has no config.json (pass a dir written by save_pretrained)")
    hf_logging = transformers.utils.logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # keep stderr for what matters (errors are one line)
    hf_logging.set_verbosity_error()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p), attn_implementation="eager", local_files_only=True, revision=revision,
            **dtype_kwargs(transformers, dtype))
    except Exception as err:  # unknown architecture, missing weights, ...
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"--hf-model {path}: transformers cannot load it as a causal LM "
                        f"({type(err).__name__}: {first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


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


def project_qkv(attn: nn.Module, hidden: torch.Tensor, position_embeddings=None):
    """The attention's input hidden (B, T, d) -> q, k, v (B, H, T, hd) as the model attends with them: keys after
    RoPE (with the model's own `apply_rotary_pos_emb` and the (cos, sin) the model passed to the attention), the kv
    heads of grouped-query attention repeated to H as HF's repeat_kv does. None for a layout not known here.

    Layouts: q_proj / k_proj / v_proj (LLaMA, Mistral, Qwen2, ...), query_key_value with [q | k | v] per head
    (GPT-NeoX), c_attn with [q | k | v] over all heads (GPT-2). Attentions that normalise q or k (q_norm, k_norm)
    are not reproduced and give None."""
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return None
    if all(isinstance(getattr(attn, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj")) and \
            isinstance(getattr(attn, "head_dim", None), int):
        q, k, v = (rearrange(proj(hidden), "b t (h d) -> b h t d", d=attn.head_dim)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    elif isinstance(getattr(attn, "query_key_value", None), nn.Module) and hasattr(attn, "head_size"):
        qkv = attn.query_key_value(hidden)  # (B, T, H * 3 * hd), per head [q | k | v]
        q, k, v = rearrange(qkv, "b t (h three d) -> three b h t d", three=3, d=attn.head_size)
    elif isinstance(getattr(attn, "c_attn", None), nn.Module) and hasattr(attn, "head_dim") and \
            not getattr(attn, "is_cross_attention", False):
        qkv = attn.c_attn(hidden)  # (B, T, 3 * H * hd): [q | k | v], each over all heads
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, d=attn.head_dim)
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


class HFTarget:
    """A Hugging Face causal LM as a measurement target (`sinklab.metrics.record`): forward hooks on each decoder
    layer (its output: the residual stream `h`), on its attention's input (a pre-hook recomputing `q`, `k`, `v`
    with `project_qkv`) and output (`attn`); a layer's tensors go to the metrics when the layer has run. The maps
    come from ``output_attentions=True`` after the forward, one layer at a time as one chunk of every row.
    `row_normalised` is known after the maps were seen (every row summed to one within 1e-3); `settle` tells the
    metrics. Key statistics are left out for attention layouts `project_qkv` does not know."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = decoder_layers(model)
        tcfg = text_config(model)
        self.n_layer = len(self.layers) if self.layers else int(getattr(tcfg, "num_hidden_layers", 0) or 0)
        self.n_head = int(getattr(tcfg, "num_attention_heads", 0) or 0)
        self.row_normalised = True

    def context(self, eps=(0.3,), k: int = 4):
        from sinklab.metrics import Context

        return Context(n_layer=self.n_layer, n_head=self.n_head, row_normalised=None, eps=list(eps), k=k)

    def settle(self, metrics) -> None:
        for m in metrics:
            m.ctx.row_normalised = self.row_normalised

    def _hooks(self, names: set, on_layer) -> list:
        current: dict = {}
        handles = []

        def hidden(i):
            def hook(_module, _inputs, output):
                if "h" in names:
                    current["h"] = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, d)
                rec = dict(current)
                current.clear()
                on_layer(i, rec)
            return hook

        def attn_out(_module, _inputs, output):
            current["attn"] = output[0] if isinstance(output, (tuple, list)) else output  # after the projection

        def qkv(attn, args, kwargs):
            hidden_states = args[0] if args else kwargs.get("hidden_states")
            found = project_qkv(attn, hidden_states, kwargs.get("position_embeddings")) \
                if hidden_states is not None else None
            if found is not None:
                current.update(zip(("q", "k", "v"), found))

        for i, layer in enumerate(self.layers):
            attn = attention_module(layer)
            if attn is not None and "attn" in names:
                handles.append(attn.register_forward_hook(attn_out))
            if attn is not None and names & {"q", "k", "v"}:
                handles.append(attn.register_forward_pre_hook(qkv, with_kwargs=True))
            handles.append(layer.register_forward_hook(hidden(i)))
        return handles

    def run(self, idx: torch.Tensor, metrics) -> None:
        names = set().union(*(m.records for m in metrics)) if metrics else set()
        device = next(self.model.parameters()).device
        idx = idx.to(device)

        def on_layer(i: int, rec: dict) -> None:
            for m in metrics:
                m.update(i, {n: rec[n] for n in m.records if n in rec})

        handles = self._hooks(names, on_layer) if self.layers else []
        try:
            out = self.model(input_ids=idx, attention_mask=torch.ones_like(idx), output_attentions=True,
                             output_hidden_states=not self.layers, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        if not self.layers:  # no decoder-layer list found: HF's hidden states (the last one is after the final norm)
            for i, h in enumerate(out.hidden_states[1:]):
                on_layer(i, {"h": h})
        maps = out.attentions
        if not maps or any(m is None for m in maps):
            raise UserError("--hf-model: the model returned no attention maps with output_attentions=True "
                            "(its eager attention does not expose them)")
        if len(maps) != self.n_layer:
            raise UserError(f"--hf-model: {len(maps)} attention maps for {self.n_layer} decoder layers; this "
                            "architecture is not supported")
        rows = torch.arange(idx.shape[1], device=device)
        for i, m in enumerate(maps):  # (B, H, T, T), one layer at a time
            m = m.float()
            if self.row_normalised and (m.sum(-1) - 1).abs().max().item() > ROW_SUM_TOL:
                self.row_normalised = False
            for metric in metrics:
                if "maps" in metric.records:
                    metric.update_maps(i, rows, m)
