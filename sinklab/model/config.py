"""One config dataclass for every architecture ablation.

Components are chosen by name (litgpt style) and resolved in one place: `ModelConfig.validate()` refuses
impossible combinations with one line naming the key, the value and what is allowed, before anything is built.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from sinklab.errors import UserError

POS = ("nope", "sinusoidal", "learnable", "alibi", "rope", "relative")
NORM = ("rms", "layer")
NORM_POSITION = ("pre", "post")
FFN = ("relu", "gelu", "swish", "reglu", "geglu", "swiglu")
ATTN_OP = ("softmax", "sigmoid", "elu", "kernel", "softpick")
KERNEL_MAP = ("identity", "elu", "mlp")
ATTN_BIAS = ("none", "k", "kv", "v")
GATE = ("none", "headwise", "elementwise")
SINK_LOGIT = ("none", "learned", "zero")


class ConfigError(UserError):
    """A user error in the configuration: one line naming the key, the value and what is allowed."""


@dataclass
class ModelConfig:
    # sizes
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # grouped-query attention; None = n_head
    d_model: int = 128
    head_dim: Optional[int] = None  # None = d_model // n_head
    d_ff: int = 352
    block_size: int = 64  # context length
    # positional encoding
    pos: str = "rope"
    rope_base: float = 10000.0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # norm
    norm: str = "rms"
    norm_position: str = "pre"
    norm_eps: float = 1e-5
    # feed-forward
    ffn: str = "swiglu"
    # attention operation
    attn_op: str = "softmax"
    softmax_scale: float = 1.0  # alpha in softmax(alpha * q.k / sqrt(d_h))
    attn_normalize: bool = False  # row normalisation for sigmoid / elu / kernel ops
    sigmoid_bias: float = 0.0  # b in sigmoid(q.k / sqrt(d_h) + b), e.g. -log(n)
    kernel_map: str = "elu"
    # attention biases and sinks
    attn_bias: str = "none"
    attn_bias_shared: bool = False  # one bias for all heads instead of one per head
    attn_bias_fixed_value_scale: Optional[float] = None  # K bias whose value is a fixed vector of this norm
    attn_bias_fixed_value_seed: int = 0  # which fixed direction (v' = 0, v'' = 1, ...)
    n_sink_tokens: int = 0
    sink_logit: str = "none"  # learned per-head logit / softmax-off-by-one
    gate: str = "none"
    # masks
    prefix_len: int = 0
    window: Optional[int] = None
    # init
    init_std: Optional[float] = None  # None = sqrt(2 / (5 d)) as in the reference study
    bias_init_std: float = 0.02
    # execution
    fused: bool = True  # use fused SDPA whenever the switches allow it
    compile: bool = False

    # ------------------------------------------------------------------ derived
    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def std(self) -> float:
        return self.init_std if self.init_std is not None else math.sqrt(2.0 / (5 * self.d_model))

    @property
    def row_normalised(self) -> bool:
        """Whether attention rows sum to one (else the metric also reports Sink* on the renormalised map)."""
        if self.attn_op == "softmax":
            return self.sink_logit == "none"
        if self.attn_op in ("sigmoid", "elu"):
            return self.attn_normalize
        return False  # kernel maps can be negative; softpick rows sum to at most one

    @property
    def n_slots(self) -> int:
        """Extra key slots visible to every query (the K / KV bias)."""
        return 1 if self.attn_bias in ("k", "kv") else 0

    @property
    def can_fuse(self) -> bool:
        """Plain softmax without extra logits: SDPA can compute it with a boolean or additive mask."""
        return self.fused and self.attn_op == "softmax" and self.sink_logit == "none"

    @property
    def llama_compatible(self) -> bool:
        return (
            self.pos == "rope" and self.norm == "rms" and self.norm_position == "pre" and self.ffn == "swiglu"
            and self.attn_op == "softmax" and self.softmax_scale == 1.0 and self.attn_bias == "none"
            and self.n_sink_tokens == 0 and self.sink_logit == "none" and self.gate == "none"
            and self.prefix_len == 0 and self.window is None and self.head_dim in (None, self.d_model // self.n_head)
        )

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ModelConfig":
        def choice(key: str, allowed: tuple) -> None:
            value = getattr(self, key)
            if value not in allowed:
                raise ConfigError(f"model.{key}={value!r} is not supported; allowed: {', '.join(allowed)}")

        def positive(key: str) -> None:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")

        for key, allowed in (("pos", POS), ("norm", NORM), ("norm_position", NORM_POSITION), ("ffn", FFN),
                             ("attn_op", ATTN_OP), ("kernel_map", KERNEL_MAP), ("attn_bias", ATTN_BIAS),
                             ("gate", GATE), ("sink_logit", SINK_LOGIT)):
            choice(key, allowed)
        for key in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "block_size"):
            positive(key)
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}; "
                              "choose n_head among the divisors of d_model or set model.head_dim")
        if self.head_dim is not None:
            positive("head_dim")
        if self.n_kv_head is not None:
            positive("n_kv_head")
            if self.n_head % self.n_kv_head:
                raise ConfigError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head}")
        if self.pos == "rope" and self.hd % 2:
            raise ConfigError(f"model.pos=rope needs an even head size, got head size {self.hd} "
                              f"(d_model={self.d_model} / n_head={self.n_head}); change n_head or head_dim")
        if self.pos == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model.pos=sinusoidal needs an even d_model, got {self.d_model}")
        if self.window is not None:
            if not isinstance(self.window, int) or self.window < 1:
                raise ConfigError(f"model.window={self.window!r} must be a positive integer or null")
            if self.window > self.block_size:
                raise ConfigError(f"model.window={self.window} exceeds the context model.block_size={self.block_size}; "
                                  f"allowed: 1..{self.block_size} or null")
        if not isinstance(self.prefix_len, int) or self.prefix_len < 0:
            raise ConfigError(f"model.prefix_len={self.prefix_len!r} must be an integer >= 0")
        if self.prefix_len >= self.block_size:
            raise ConfigError(f"model.prefix_len={self.prefix_len} must be smaller than the context "
                              f"model.block_size={self.block_size}")
        if self.n_sink_tokens < 0:
            raise ConfigError(f"model.n_sink_tokens={self.n_sink_tokens} must be >= 0")
        if self.sink_logit != "none" and self.attn_op != "softmax":
            raise ConfigError(f"model.sink_logit={self.sink_logit} needs model.attn_op=softmax, "
                              f"got attn_op={self.attn_op}")
        if self.attn_bias_fixed_value_scale is not None and self.attn_bias != "k":
            raise ConfigError("model.attn_bias_fixed_value_scale fixes the value of a K bias; it needs "
                              f"model.attn_bias=k, got attn_bias={self.attn_bias}")
        if self.attn_normalize and self.attn_op in ("softmax", "softpick"):
            raise ConfigError(f"model.attn_normalize applies to sigmoid, elu and kernel; "
                              f"attn_op={self.attn_op} is normalised by construction (set attn_normalize=false)")
        if self.attn_op == "kernel" and self.pos in ("alibi", "relative"):
            raise ConfigError(f"model.attn_op=kernel has no logits to add a model.pos={self.pos} bias to; "
                              "allowed pos with kernel attention: nope, sinusoidal, learnable, rope")
        if self.softmax_scale <= 0:
            raise ConfigError(f"model.softmax_scale={self.softmax_scale} must be > 0")
        if self.rope_base <= 0:
            raise ConfigError(f"model.rope_base={self.rope_base} must be > 0 (RoPE frequencies base^(-2i/d); "
                              "LLaMA uses 10000)")
        if self.norm_eps <= 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be > 0 (e.g. 1e-5)")
        if not isinstance(self.relative_buckets, int) or self.relative_buckets < 4:
            # a prefix LM splits the buckets by direction, and each half needs at least one exact distance
            raise ConfigError(f"model.relative_buckets={self.relative_buckets!r} must be an integer >= 4")
        if self.relative_max_distance <= self.relative_buckets // 2:
            # T5 buckets: the first buckets // 2 distances are exact, the rest log-spaced up to max_distance
            raise ConfigError(f"model.relative_max_distance={self.relative_max_distance} must exceed the "
                              f"{self.relative_buckets // 2} exact distances of model.relative_buckets="
                              f"{self.relative_buckets}; allowed: > {self.relative_buckets // 2}")
        if self.attn_bias_fixed_value_scale is not None and self.attn_bias_fixed_value_scale < 0:
            raise ConfigError(f"model.attn_bias_fixed_value_scale={self.attn_bias_fixed_value_scale} is the norm "
                              "of the fixed value; allowed: >= 0 or null")
        # switches that would silently do nothing
        if self.sigmoid_bias != 0 and self.attn_op != "sigmoid":
            raise ConfigError(f"model.sigmoid_bias={self.sigmoid_bias} applies to model.attn_op=sigmoid only, "
                              f"got attn_op={self.attn_op}; set sigmoid_bias=0")
        if self.attn_bias_shared and self.attn_bias == "none":
            raise ConfigError("model.attn_bias_shared=true shares a K, KV or V bias across heads, but "
                              "model.attn_bias=none; allowed: attn_bias=k, kv or v, or attn_bias_shared=false")
        if self.kernel_map != "elu" and self.attn_op != "kernel":
            raise ConfigError(f"model.kernel_map={self.kernel_map} applies to model.attn_op=kernel only, "
                              f"got attn_op={self.attn_op}; leave kernel_map at its default elu")
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"_target_", "preset"})
        if unknown:
            raise ConfigError(f"unknown model option(s) {', '.join('model.' + u for u in unknown)}; "
                              f"allowed: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in d.items() if k in names}).validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Size presets (also in conf/model/*.yaml): name -> overrides.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, d_ff=352, block_size=64),
    "14m": dict(n_layer=6, n_head=6, d_model=384, d_ff=1024, block_size=256),
    "60m": dict(n_layer=10, n_head=8, d_model=768, d_ff=1536, block_size=2048),
    "1b": dict(n_layer=22, n_head=16, d_model=2048, d_ff=5632, block_size=2048),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; allowed: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides}).validate()

