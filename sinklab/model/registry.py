"""Components chosen by name, resolved in one place (litgpt style).

Every architecture family (attention operation, positional encoding, norm, feed-forward, gate, attention bias, block
layout) is a `Registry`: a component class registers itself under the name that selects it in the config
(`model.attn_op=sigmoid`). A component declares its config knobs as a `Knobs` dataclass; `ModelConfig` gathers them,
so one module adds an op together with its knobs, its parameters and its behaviour.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any, Callable, ClassVar, Generic, Iterator, Optional, TypeVar

from sinklab.errors import UserError, word
from sinklab.registries import discover


def import_components() -> None:
    """Import every module of `sinklab.model` (`sinklab.registries.discover`) but those that import the config
    themselves (they build on it, e.g. compile.py); ops/ imports its own modules. Each registers its components when
    it is imported, so a new component module needs no import list. `sinklab.model.config` calls it before it
    gathers the knobs (`sinklab.model.knobs`); no module imported so imports the config."""
    discover(__name__.rpartition(".")[0], keep=lambda name: not builds_on_config(name))


def builds_on_config(module: str) -> bool:
    """Whether a module of `sinklab.model` imports the model config at its top (read from its source: importing it
    while the config is being built would be a cycle)."""
    spec = importlib.util.find_spec(module)
    return spec.submodule_search_locations is None and bool(
        _IMPORTS_CONFIG.search(Path(spec.origin).read_text(encoding="utf-8")))


_IMPORTS_CONFIG = re.compile(r"^from (\.|sinklab\.model\.)config import", re.MULTILINE)


class ConfigError(UserError):
    """A user error in the configuration: one line naming the key, the value and what is allowed."""


def check_positive_int(cfg: Any, key: str, optional: bool = False) -> None:
    """Refuse model.<key> unless it is an integer >= 1 (or None when optional), in one ConfigError line."""
    value = getattr(cfg, key)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model.{key}={value!r} must be a positive integer")


class Component:
    """What every registered component class provides to the config and the generic tests.

    name:       the registered name (set by `Registry.register`)
    Knobs:      a dataclass of the config keys this component reads; `ModelConfig` gets one field per knob
    validate:   cross-field rules of this component, raising ConfigError naming the key (called once per config)
    llama_ok:   whether LLaMA (transformers LlamaForCausalLM) can represent this component with these knobs (the
                class attribute `llama`, and each knob of `llama_knobs` at the value LLaMA needs, unless overridden)
    retrofit:   how it starts when a retrofit adds it to a trained model (`init_from=` a checkpoint whose model has
                its family's default instead: sinklab.model.retrofit), one line; "" where a retrofit cannot add it.
                `retrofit_knobs` are the knobs that add something when set away from their default in such a model
                (per-head NoPE: rope_heads); `retrofit_identity(cfg)` says whether the model then computes at step 0
                what the checkpoint's did (to float32 rounding); a module's `retrofit_init(parent)`, where it has one,
                sets its new parameters after the checkpoint's weights were copied (else they keep the fresh init)
    """

    name: ClassVar[str] = ""
    registry: ClassVar["Registry"]
    llama: ClassVar[bool] = False  # LLaMA has this component (with default knobs)
    llama_knobs: ClassVar[dict[str, Any]] = {}  # knob -> the value LLaMA needs (rope_fraction: 1.0)
    retrofit: ClassVar[str] = ""
    retrofit_knobs: ClassVar[tuple[str, ...]] = ()

    @dataclasses.dataclass
    class Knobs:
        pass

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        """Whether a model with this component, added by a retrofit, computes at step 0 what it did without it."""
        return False

    @classmethod
    def validate(cls, cfg: Any) -> None:
        """Refuse impossible settings of this component (the chosen one only) with one ConfigError line."""

    @classmethod
    def contract_needs(cls, case: dict) -> dict:
        """Other model keys a contract-test case of this component needs to build (e.g. a window for local layers)."""
        return {}

    @classmethod
    def llama_knob_mismatches(cls, cfg: Any) -> list[str]:
        """'model.knob=value (LLaMA needs ...)' for each knob of `llama_knobs` away from the value LLaMA needs."""
        return [f"model.{key}={word(getattr(cfg, key))} (LLaMA needs {word(need)})"
                for key, need in cls.llama_knobs.items() if getattr(cfg, key) != need]

    @classmethod
    def llama_ok(cls, cfg: Any) -> bool:
        return cls.llama and not cls.llama_knob_mismatches(cfg)

    @classmethod
    def llama_mismatch(cls, cfg: Any) -> Optional[str]:
        """None when LLaMA can represent this component as configured, else 'model.key=value (LLaMA needs ...)'."""
        if cls.llama_ok(cfg):
            return None
        if cls.llama:  # LLaMA's component with a knob LLaMA lacks
            return cls.llama_knob_mismatches(cfg)[0]
        return f"model.{cls.registry.key}={getattr(cfg, cls.registry.key)} (LLaMA needs {cls.registry.llama})"


C = TypeVar("C", bound=type)


class Registry(Generic[C]):
    """name -> component class for one family, selected by the config key `key`.

    Declaring a family is this one entry: it gives `ModelConfig` its field `key` (a string, `default` unless set;
    sinklab.model.config) and takes its place in `FAMILIES`, in the order of declaration (that of the config's
    fields, the knobs and the reference pages); `family=False` declares a registry that is no architecture family
    (`ATTN_BACKENDS`: its field is the config's own). Its config group `conf/model/<group>/` selects an option.

    `listeners` are called with each class registered after them (sinklab.model.config gives `ModelConfig` the
    knobs of a component registered from a user's package, sinklab.plugins)."""

    listeners: ClassVar[list[Callable[[type], None]]] = []

    def __init__(self, key: str, what: str, llama: str, group: str, default: Optional[str] = None,
                 family: bool = True):
        # llama: the option LLaMA has; group: the config group whose files select an option (conf/model/<group>/);
        # default: the option a config selects unless told otherwise (LLaMA's unless given)
        self.key, self.what, self.llama, self.group = key, what, llama, group
        self.default = llama if default is None else default
        self._classes: dict[str, C] = {}
        if family:
            FAMILIES.append(self)

    def register(self, name: str) -> Callable[[C], C]:
        def add(cls: C) -> C:
            if name in self._classes:
                raise ConfigError(f"{self.what} {name!r} is registered twice ({self._classes[name]} and {cls}); "
                                  "give one of them another name")
            cls.name, cls.registry = name, self
            self._classes[name] = cls
            try:
                for listener in Registry.listeners:
                    listener(cls)
            except Exception:
                del self._classes[name]  # refused (e.g. a knob that clashes): the registry stays as it was
                raise
            return cls
        return add

    def get(self, name: str) -> C:
        if name not in self._classes:
            raise ConfigError(f"model.{self.key}={name!r} is not supported; allowed: {', '.join(self._classes)}")
        return self._classes[name]

    def selected(self, cfg: Any) -> C:
        """The class chosen by the config (a component may pick a subclass for its variant: `resolve`)."""
        cls = self.get(getattr(cfg, self.key))
        resolve: Optional[Callable[[Any], C]] = getattr(cls, "resolve", None)
        return resolve(cfg) if resolve is not None else cls

    def names(self) -> list[str]:
        return list(self._classes)

    def __iter__(self) -> Iterator[C]:
        return iter(self._classes.values())

    def __contains__(self, name: str) -> bool:
        return name in self._classes


# The architecture families, each selected by its model.<key>, in the order of ModelConfig's fields
FAMILIES: list[Registry] = []

POSITIONS: Registry = Registry("pos", "positional encoding", llama="rope", group="pos")
NORMS: Registry = Registry("norm", "norm", llama="rms", group="norm")
NORM_POSITIONS: Registry = Registry("norm_position", "block layout", llama="pre", group="norm")
FFNS: Registry = Registry("ffn", "feed-forward network", llama="swiglu", group="ffn")
ATTENTION_OPS: Registry = Registry("attn_op", "attention operation", llama="softmax", group="attn")
ATTN_BIASES: Registry = Registry("attn_bias", "attention bias", llama="none", group="bias")
GATES: Registry = Registry("gate", "attention-output gate", llama="none", group="gate")
QK_NORMS: Registry = Registry("qk_norm", "query/key norm", llama="none", group="qk_norm")
SPARSITIES: Registry = Registry("sparsity", "sparse attention pattern", llama="none", group="sparsity")
HEAD_NORMS: Registry = Registry("head_norm", "per-head output norm", llama="none", group="head_norm")
# how attention runs, not what it computes (an execution choice, like model.compile): not an architecture family
ATTN_BACKENDS: Registry = Registry("attn_backend", "attention backend", llama="sdpa", group="backend", family=False)
