"""Simulated (fake) post-training quantization of a language model's linear layers, and its validation perplexity.

The setup follows Bondarenko et al. 2023 ("Quantizable Transformers", Sec. 5 and App. C.4): uniform affine
quantization, symmetric min-max weights, asymmetric activations with static ranges from a running min-max estimator
(an exponential moving average of each calibration batch's min and max, Krishnamoorthi 2018; the paper uses
momentum 0.9 over 16 training batches), and the final linear layer (the LM head) kept in floating point.
Details the paper leaves open or that differ here:
- what is quantized: the weights and the *inputs* of every linear layer (`torch.nn.Linear`, and transformers'
  `Conv1D` of GPT-2), i.e. the attention q/k/v/o projections, the FFN, the attention-output gates and the kernel
  op's feature MLP. The paper also quantizes layer outputs, softmax inputs and residual sums; here they stay fp32,
  so the gap measures the error of integer matmuls only. Embeddings are lookups, not matmuls, and stay fp32;
  the LM head stays fp32 unless `quantize_head` (for a model whose head is tied to the embedding, as GPT-2,
  that quantizes the embedding too: it is the same tensor). Biases stay fp32 (int32 on real hardware).
- granularity: weights per tensor (the paper's min-max) or per output channel; activation ranges per tensor.
- the activation range is widened to contain 0 (zero is exactly representable), the zero point rounded to an
  integer; a layer called several times in one forward (the kernel op's MLP, on queries and keys) updates its
  running range at every call.
- rounding is to the nearest integer, ties to even (torch.fake_quantize_*), values outside the range clamp.
- "A16" (W8A16, W4A16) means activations are not quantized: they stay fp32 here (fp16 rounding is not simulated).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from sinklab.errors import UserError
from sinklab.model.lm_loss import bits_per_byte, mean_nll, perplexity


@dataclass(frozen=True)
class Scheme:
    """w_bits: weight bits (None: fp32 weights); a_bits: bits of every linear layer's input (None: fp32)."""

    name: str
    w_bits: Optional[int]
    a_bits: Optional[int]

    def describe(self) -> tuple[str, str]:
        return (f"int{self.w_bits}" if self.w_bits else "fp32", f"uint{self.a_bits}" if self.a_bits else "fp32")


FP32 = Scheme("fp32", None, None)
SCHEMES = {s.name: s for s in (Scheme("w8a16", 8, None), Scheme("w8a8", 8, 8), Scheme("w4a16", 4, None),
                               Scheme("w4a4", 4, 4))}
GRANULARITIES = ("per-tensor", "per-channel")


# ----------------------------------------------------------------------------------------------- quantizers
def quantize_symmetric(w: torch.Tensor, bits: int, per_channel: bool = False, axis: int = 0) -> torch.Tensor:
    """w rounded to the grid scale * {-(2^(b-1) - 1), ..., 2^(b-1) - 1}, scale = max |w| / (2^(b-1) - 1) over the
    tensor, or over each slice along `axis` (the output channel) when per_channel. An all-zero slice stays zero."""
    qmax = 2 ** (bits - 1) - 1
    if per_channel:
        scale = w.detach().abs().amax(dim=[d for d in range(w.dim()) if d != axis]).float() / qmax  # (channels,)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.zeros_like(scale, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero, axis, -qmax, qmax)
    scale = w.detach().abs().max().item() / qmax
    return torch.fake_quantize_per_tensor_affine(w, scale if scale > 0 else 1.0, 0, -qmax, qmax)


def asymmetric_grid(bits: int, lo: float, hi: float) -> tuple[float, int]:
    """(scale, zero point) of the unsigned b-bit grid over [min(lo, 0), max(hi, 0)]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / (2 ** bits - 1)
    if not scale > 0:  # an all-zero range
        return 1.0, 0
    return scale, round(-lo / scale)


def quantize_asymmetric(x: torch.Tensor, bits: int, lo: float, hi: float) -> torch.Tensor:
    """x rounded to scale * (q - zero point), q in {0, ..., 2^b - 1}, the grid of `asymmetric_grid(bits, lo, hi)`;
    values outside the range clamp to its ends."""
    scale, zero = asymmetric_grid(bits, lo, hi)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 2 ** bits - 1)


# ----------------------------------------------------------------------------------------------- layers
def weight_axis(module: nn.Module) -> Optional[int]:
    """The output-channel axis of a linear layer's weight: 0 for nn.Linear (out, in), 1 for transformers' Conv1D
    (GPT-2's, (in, out)); None for a module that is not a linear layer."""
    if isinstance(module, nn.Linear):
        return 0
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return 1
    return None


def output_head(model: nn.Module) -> Optional[nn.Module]:
    """The LM head: transformers' get_output_embeddings(), sinklab's lm_head."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else getattr(model, "lm_head", None)


def quantizable_layers(model: nn.Module, quantize_head: bool = False) -> dict[str, nn.Module]:
    """Every linear layer of the model by name, the LM head only when quantize_head."""
    head = output_head(model)
    return {name: m for name, m in model.named_modules()
            if weight_axis(m) is not None and (quantize_head or m is not head)}


class RangeRecorder:
    """Forward pre-hooks that keep, per layer, the running min-max of its input: the first call sets (lo, hi), each
    later call moves them to momentum * (lo, hi) + (1 - momentum) * (min, max) of that call's input."""

    def __init__(self, layers: dict[str, nn.Module], momentum: float):
        self.momentum = momentum
        self.ranges: dict[str, torch.Tensor] = {}  # name -> (2,) [lo, hi]
        self.hooks = [m.register_forward_pre_hook(self._hook(name)) for name, m in layers.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            seen = torch.stack(torch.aminmax(args[0].detach().float()))  # (2,)
            old = self.ranges.get(name)
            self.ranges[name] = seen if old is None else self.momentum * old + (1 - self.momentum) * seen
        return hook

    def remove(self) -> dict[str, tuple[float, float]]:
        for h in self.hooks:
            h.remove()
        return {name: (float(r[0]), float(r[1])) for name, r in self.ranges.items()}


@torch.no_grad()
def calibrate(logits_of: Callable, layers: dict[str, nn.Module], batches: Iterable[torch.Tensor],
              momentum: float = 0.9) -> dict[str, tuple[float, float]]:
    """Static input ranges {layer: (lo, hi)} from the model's forward on each batch's inputs batch[:, :-1]."""
    recorder = RangeRecorder(layers, momentum)
    try:
        for batch in batches:
            logits_of(batch[:, :-1])
    finally:
        ranges = recorder.remove()
    return ranges


@contextlib.contextmanager
def fake_quantized(layers: dict[str, nn.Module], scheme: Scheme, ranges: Optional[dict] = None,
                   per_channel: bool = False):
    """Within the block the layers compute with fake-quantized weights (swapped in) and inputs (forward pre-hooks
    with the static `ranges` of `calibrate`); the model is restored on exit. A weight shared by several layers
    is quantized once."""
    saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    hooks = []
    try:
        for name, m in layers.items():
            if scheme.w_bits is not None and id(m.weight) not in saved:
                saved[id(m.weight)] = (m.weight, m.weight.data)
                m.weight.data = quantize_symmetric(m.weight.data, scheme.w_bits, per_channel, weight_axis(m))
            if scheme.a_bits is not None:
                if ranges is None or name not in ranges:
                    raise ValueError(f"layer {name} has no calibrated input range (was it called in calibration?)")
                lo, hi = ranges[name]
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, args, lo=lo, hi=hi: (quantize_asymmetric(args[0], scheme.a_bits, lo, hi), *args[1:])))
        yield
    finally:
        for h in hooks:
            h.remove()
        for weight, data in saved.values():
            weight.data = data


# ----------------------------------------------------------------------------------------------- evaluation
def evaluate(model: nn.Module, logits_of: Callable, val: list[torch.Tensor], calib: list[torch.Tensor],
             schemes: Iterable[Scheme], per_channel: bool = False, momentum: float = 0.9,
             quantize_head: bool = False, prefix_len: int = 0, bytes_per_token: Optional[float] = None) -> dict:
    """Validation loss, perplexity and bits per byte in fp32 and under each scheme, with its gap against fp32.

    -> {"val_targets": scored targets, "layers": [names], "ranges": {layer: [lo, hi]}, "schemes": {"fp32" | scheme:
    {w_bits, a_bits, loss, ppl, bpb, gap (ppl - fp32 ppl), rel_gap (gap / fp32 ppl)}}}.
    `logits_of(idx (B, T))` -> logits (B, T, V); val and calib hold (B, T + 1) blocks; `bytes_per_token`: the bytes
    of text per scored target of `val` (`sinklab.model.lm_loss.bits_per_byte`; bpb is None without it)."""
    schemes = list(schemes)
    layers = quantizable_layers(model, quantize_head)
    if not layers:
        raise UserError("the model has no linear layer to quantize (torch.nn.Linear or transformers' Conv1D)")
    ranges = calibrate(logits_of, layers, calib, momentum) if any(s.a_bits for s in schemes) else {}
    rows: dict[str, dict] = {}
    for scheme in [FP32, *schemes]:
        with fake_quantized(layers, scheme, ranges, per_channel):
            loss, count = mean_nll(logits_of, val, prefix_len)
        ppl = perplexity(loss)
        base = rows["fp32"]["ppl"] if rows else ppl
        rows[scheme.name] = {"w_bits": scheme.w_bits, "a_bits": scheme.a_bits, "loss": loss, "ppl": ppl,
                             "bpb": bits_per_byte(loss, bytes_per_token), "gap": ppl - base,
                             "rel_gap": (ppl - base) / base}
    return {"val_targets": count, "layers": list(layers), "ranges": {k: list(v) for k, v in ranges.items()},
            "schemes": rows}
