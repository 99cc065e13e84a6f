"""Measuring Hugging Face causal LMs (LLaMA, Mistral, GPT-2, GPT-NeoX, ...) with the sinklab metric.

transformers is an optional extra (``pip install 'sinklab[hf]'``); nothing here imports it at module level.

Attention maps come from ``output_attentions=True`` with the eager kernel (maps are materialised, one batch at a
time, and reduced layer by layer with `column_scores`). The residual stream per layer is captured with forward
hooks on the decoder layers: HF's ``output_hidden_states`` replaces its last entry with the output of the final
norm, which would hide the last layer's massive activations. Statistics follow `activation_stats`' definitions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from sinklab.errors import UserError
from sinklab.metrics.sink import AttentionScores, column_scores, renormalise

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


class HiddenStats:
    """Massive activations and the first token's norm ratio from per-layer residual streams (B, T, d), with the
    definitions of `sinklab.metrics.activation_stats` (token 1-indexed, medians and ratios averaged over sequences,
    the top value the max over all sequences)."""

    def __init__(self):
        self.top: Optional[torch.Tensor] = None  # (L, 3): value, token, channel
        self.median_sum: Optional[torch.Tensor] = None  # (L,)
        self.h1_sum: Optional[torch.Tensor] = None
        self.n = 0

    def update(self, hidden: list[torch.Tensor]) -> None:
        tops, medians, h1 = [], [], []
        for h in hidden:
            h = h.float()
            B, T, d = h.shape
            flat = h.abs().reshape(B, -1)
            val, pos = flat.max(-1)
            tops.append(torch.stack([val, (pos // d).float() + 1, (pos % d).float()], -1))  # (B, 3)
            medians.append(flat.median(-1).values)
            norms = h.norm(dim=-1)  # (B, T)
            h1.append(norms[:, 0] / norms[:, 1:].mean(-1) if T > 1 else torch.full((B,), float("nan")))
        bt = torch.stack(tops, 1).cpu()  # (B, L, 3)
        best = bt[bt[..., 0].argmax(0), torch.arange(bt.shape[1])]  # (L, 3)
        self.top = best if self.top is None else torch.where(best[:, :1] > self.top[:, :1], best, self.top)
        med = torch.stack(medians, 1).sum(0).cpu()
        r = torch.stack(h1, 1).sum(0).cpu()
        self.median_sum = med if self.median_sum is None else self.median_sum + med
        self.h1_sum = r if self.h1_sum is None else self.h1_sum + r
        self.n += bt.shape[0]

    def result(self) -> dict:
        median = (self.median_sum / self.n).tolist()
        top = self.top[:, 0].tolist()
        return {
            "massive_top": top,
            "massive_median": median,
            "massive_ratio": [t / max(m, 1e-12) for t, m in zip(top, median)],
            "massive_token": [int(x) for x in self.top[:, 1].tolist()],
            "massive_channel": [int(x) for x in self.top[:, 2].tolist()],
            "h1_norm_ratio": (self.h1_sum / self.n).tolist(),
        }


@torch.no_grad()
def hf_scores(model: nn.Module, tokens: torch.Tensor, k: int = 4,
              batch_size: int = 25) -> tuple[AttentionScores, bool, dict]:
    """tokens (N, T) -> (scores with alpha (N, L, H, K) and alpha_star, row_normalised, hidden-state stats).

    alpha_star (the metric on |A| / sum |A|) is always computed; row_normalised says whether every row of every
    map summed to one (within 1e-3), in which case Sink* equals Sink and the caller may drop it."""
    layers = decoder_layers(model)
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, (tuple, list)) else output)

    hooks = [layer.register_forward_hook(grab) for layer in layers] if layers else []
    device = next(model.parameters()).device
    alphas, alphas_star = [], []
    row_normalised = True
    hidden = HiddenStats()
    try:
        for start in range(0, tokens.shape[0], batch_size):
            idx = tokens[start:start + batch_size].to(device)
            captured.clear()
            out = model(input_ids=idx, attention_mask=torch.ones_like(idx), output_attentions=True,
                        output_hidden_states=not layers, use_cache=False)
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
            # no decoder-layer list found: HF's hidden states (the last one is after the final norm)
            states = captured if layers else list(out.hidden_states[1:])
            del maps, out  # free this batch's maps before the next forward
            alphas.append(torch.stack(per_layer, 1).cpu())  # (B, L, H, K)
            alphas_star.append(torch.stack(per_layer_star, 1).cpu())
            if len(states) != len(per_layer):
                raise UserError(f"--hf-model: captured {len(states)} decoder-layer outputs for {len(per_layer)} "
                                "attention maps; this architecture is not supported")
            hidden.update(states)
    finally:
        for h in hooks:
            h.remove()
    scores = AttentionScores(alpha=torch.cat(alphas), alpha_star=torch.cat(alphas_star))
    return scores, row_normalised, hidden.result()
