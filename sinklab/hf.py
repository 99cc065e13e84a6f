"""Measuring Hugging Face causal LMs (LLaMA, Mistral, GPT-2, GPT-NeoX, ...) with the sinklab metric.

transformers is an optional extra (``pip install 'sinklab[hf]'``); nothing here imports it at module level.

Attention maps come from ``output_attentions=True`` with the eager kernel (maps are materialised, one batch at a
time, and reduced layer by layer with `column_scores`). The residual stream per layer is captured with forward
hooks on the decoder layers: HF's ``output_hidden_states`` replaces its last entry with the output of the final
norm, which would hide the last layer's massive activations. Queries, keys and values are recomputed from each
attention's input in a forward pre-hook (`project_qkv`: the model's own projections and, for RoPE models, its own
``apply_rotary_pos_emb`` on the (cos, sin) the model hands to the attention); the attention's output (after its
output projection) in a forward hook. Statistics use the same functions as `sinklab.metrics.activation_stats`
(`hidden_state_stats`, `qkv_stats`, `attention_output_stats`); norm weights are not read from HF models.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import torch
from einops import rearrange
from torch import nn

from sinklab.errors import UserError
from sinklab.metrics.activations import ActivationStats, attention_output_stats, hidden_state_stats, qkv_stats
from sinklab.metrics.sink import AttentionScores, column_scores, renormalise

INSTALL_HINT = "--hf-model needs transformers, an optional extra: pip install 'sinklab[hf]'"
QKV_NAMES = ("k1", "v1", "cos1", "cosj")  # the names of `qkv_stats`, left out when a layout is not known
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
                  dtype: torch.dtype = torch.float32) -> nn.Module:
    """A local causal-LM dir -> the model in eval mode with the eager attention kernel (maps available)."""
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
            str(p), attn_implementation="eager", local_files_only=True, **dtype_kwargs(transformers, dtype))
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


class LayerRecorder:
    """Forward hooks on the decoder layers and their attentions. During one forward, per layer i, `stats[i]`
    receives `hidden_state_stats` of the layer's output (the residual stream), `qkv_stats` of the queries, keys
    and values recomputed from the attention's input (`project_qkv`) and `attention_output_stats` of the
    attention's output, reduced at once so nothing per layer is kept. `qkv_supported` turns False when some
    attention's layout is not known (its key statistics are then left out); a model whose layers have no attention
    module found here has no attention-output statistics either."""

    def __init__(self, layers: list[nn.Module]):
        self.stats: list[dict[str, torch.Tensor]] = [{} for _ in layers]
        self.qkv_supported = True
        self.hooks = []
        for i, layer in enumerate(layers):
            self.hooks.append(layer.register_forward_hook(self._hidden_hook(i)))
            attn = attention_module(layer)
            if attn is None:
                self.qkv_supported = False
            else:
                self.hooks.append(attn.register_forward_pre_hook(self._qkv_hook(i), with_kwargs=True))
                self.hooks.append(attn.register_forward_hook(self._attn_hook(i)))

    def _hidden_hook(self, i: int):
        def hook(_module, _inputs, output):
            h = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, d)
            self.stats[i].update(hidden_state_stats(h))
        return hook

    def _attn_hook(self, i: int):
        def hook(_module, _inputs, output):
            a = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, d), after the output projection
            self.stats[i].update(attention_output_stats(a))
        return hook

    def _qkv_hook(self, i: int):
        def hook(attn, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            qkv = project_qkv(attn, hidden, kwargs.get("position_embeddings")) if hidden is not None else None
            if qkv is None:
                self.qkv_supported = False
            else:
                self.stats[i].update(qkv_stats(*qkv))
        return hook

    def start_batch(self) -> None:
        self.stats = [{} for _ in self.stats]

    def batch_stats(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, this batch's statistics (the key statistics only when every layer has them)."""
        if self.qkv_supported:
            return self.stats
        return [{name: v for name, v in s.items() if name not in QKV_NAMES} for s in self.stats]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def hf_scores(model: nn.Module, tokens: torch.Tensor, k: int = 4,
              batch_size: int = 25) -> tuple[AttentionScores, bool, dict]:
    """tokens (N, T) -> (scores with alpha (N, L, H, K) and alpha_star, row_normalised, activation statistics).

    alpha_star (the metric on |A| / sum |A|) is always computed; row_normalised says whether every row of every
    map summed to one (within 1e-3), in which case Sink* equals Sink. The statistics are those of
    `sinklab.metrics.activation_stats` (massive activations, h1 / k1 / v1 norm ratios, cos_q_k1, cos_q_kj); the
    key statistics are left out for attention layouts `project_qkv` does not know."""
    layers = decoder_layers(model)
    recorder = LayerRecorder(layers) if layers else None
    device = next(model.parameters()).device
    alphas, alphas_star = [], []
    row_normalised = True
    acc = ActivationStats()
    try:
        for start in range(0, tokens.shape[0], batch_size):
            idx = tokens[start:start + batch_size].to(device)
            if recorder is not None:
                recorder.start_batch()
            out = model(input_ids=idx, attention_mask=torch.ones_like(idx), output_attentions=True,
                        output_hidden_states=recorder is None, use_cache=False)
            maps = out.attentions
            if not maps or any(m is None for m in maps):
                raise UserError("--hf-model: the model returned no attention maps with output_attentions=True "
                                "(its eager attention does not expose them)")
            per_layer, per_layer_star = [], []
            for m in maps:  # (B, H, T, T), one layer at a time
                m = m.float()
                if row_normalised and (m.sum(-1) - 1).abs().max().item() > ROW_SUM_TOL:
                    row_normalised = False
                per_layer.append(column_scores(m, 0, k)[0])
                per_layer_star.append(column_scores(renormalise(m), 0, k)[0])
            if recorder is not None:
                stats = recorder.batch_stats()
            else:  # no decoder-layer list found: HF's hidden states (the last one is after the final norm)
                stats = [hidden_state_stats(h) for h in out.hidden_states[1:]]
            del maps, out  # free this batch's maps before the next forward
            alphas.append(torch.stack(per_layer, 1).cpu())  # (B, L, H, K)
            alphas_star.append(torch.stack(per_layer_star, 1).cpu())
            if len(stats) != len(per_layer) or any("top" not in s for s in stats):
                raise UserError(f"--hf-model: captured {len(stats)} decoder-layer outputs for {len(per_layer)} "
                                "attention maps; this architecture is not supported")
            acc.update(stats)
    finally:
        if recorder is not None:
            recorder.remove()
    scores = AttentionScores(alpha=torch.cat(alphas), alpha_star=torch.cat(alphas_star))
    return scores, row_normalised, acc.result()
