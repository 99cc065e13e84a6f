"""The one model interface every evaluation and analysis takes: a `Target`.

A Target is a language model from some source (a sinklab checkpoint, a transformers model, ...) with what the
evaluations ask of it, written once per source:
- logits: `logits(idx)` (B, T) -> (B, T, V), `last_logits(idx)` -> (B, V), `nll(batches)` the mean next-token loss;
- recording for the metrics: `recorder()` hooks the model for `sinklab.metrics.record.measure_all` (each layer's
  tensors and its attention map in row chunks), `measure(tokens, names, eps, k)` runs the registered metrics;
- interventions: `masked(mask_fn)` (a mask function every query obeys on top of the model's own, or a
  `sinklab.model.masks.LayerMask`: obeyed in some layers / by some query heads only),
  `set_output(layer, position, channels, values)` (a layer's output activations replaced) and
  `zero_value(layers, position)` (one position's value vectors set to 0 in some layers), context managers that
  change nothing once closed;
- a KV cache that evicts: `stream(first, recent)` feeds one token at a time through a cache of the first + recent
  tokens with positions re-indexed (RoPE re-rotated), `check_stream()` refuses before any work what cannot be;
  `decoder(policy, evict)` feeds tokens through a cache that evicts by any policy of
  `sinklab.model.cache_policies` (H2O, SnapKV, ...), after every forward or once when compressed, and says which
  tokens it kept;
- TransformerLens's hook names (`sinklab.model.hooked`): `run_with_cache(tokens, names_filter, prepend_bos)` ->
  (logits, an ActivationCache), `run_with_hooks(tokens, fwd_hooks, prepend_bos)`, BOS prepended as the source
  measures (a source gives its names in `hook_sites` and its BOS in `bos`; refused in one line where it has none);
- its metadata (`meta`: a `TargetMeta`) and, for natural input, `natural_tokens(...)` (a run's probe set, or text
  through the model's own tokenizer).
Sources register in `SOURCES` (`sinklab.targets.native`: sinklab checkpoints and run dirs; `transformers_lm`: hub ids
and local transformers dirs); `load_target(TargetSpec(...))` picks one. docs/extending.md shows a third.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional, Protocol, Sequence, Union

import torch

from sinklab.errors import UserError
from sinklab.model.lm_loss import mean_nll
from sinklab.registries import NameRegistry

# what a measurement runs on when the user sets no size: sequences of DEFAULT_SEQ_LEN tokens (within the model context),
# DEFAULT_NUM_SEQS of them (`Target.natural_tokens` of a source without a probe set of its own, `sinklab measure`)
DEFAULT_SEQ_LEN = 64
DEFAULT_NUM_SEQS = 100
Step = Callable[[torch.Tensor], torch.Tensor]  # one token (1, 1) -> logits of the next one (1, V)
MaskFn = Callable  # flex-style mask function (b, h, q_idx, kv_idx) -> bool tensor: True where the key is kept


@dataclass(frozen=True)
class TargetSpec:
    """Which model to load: `name` (a checkpoint, run dir, local dir or hub id) from `source` (a key of SOURCES),
    at `revision` (hub ids), in `dtype` ("auto", "float32", ...: sources that can cast), on `device`."""

    name: str
    source: str = "sinklab"
    revision: Optional[str] = None
    dtype: Union[str, torch.dtype] = "auto"
    device: Union[str, torch.device] = "cpu"


@dataclass
class TargetMeta:
    """What every output says about the model: `target` (what was loaded), `source`, `vocab_size`, `context` (None
    where the config has none), `prefix_len` (a prefix LM's bidirectional prefix), `revision` and `dtype` where the
    source has them, `run_dir` (the training run, None for a bare checkpoint or a foreign model), `model` (the
    architecture's description in `sinklab measure --json`) and `weights_note` (where the weights are not the model's
    own as trained: a GGUF file's quantization, dequantized; every command prints it beside the model)."""

    target: str
    source: str
    vocab_size: int
    context: Optional[int]
    prefix_len: int = 0
    revision: Optional[str] = None
    dtype: Optional[str] = None
    run_dir: Optional[Path] = None
    model: dict = field(default_factory=dict)
    weights_note: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def head(self) -> dict:
        """What each command's JSON starts with: target, source and, where the source has one, weights_note."""
        note = {"weights_note": self.weights_note} if self.weights_note else {}
        return {"target": self.target, "source": self.source, **note}


def model_title(res: dict) -> str:
    """'<source> model <target>', with the weights' note (`TargetMeta.weights_note`) where a result has one: the first
    words of each command's text."""
    return f"{res['source']} model {res['target']}" + (f" ({res['weights_note']})" if res.get("weights_note") else "")


def no_natural_input(kind: Optional[str], missing: str) -> UserError:
    """The one line refusing natural input (`kind` natural, or None: the default input) to a model without a probe
    set of its own; `missing` says why (`Target.no_probe_set`)."""
    where = "choose the input" if kind is None else "--input natural"
    return UserError(f"{where}: {missing}; pass --tokens FILE.npy or --input random|repeat")


class Recorder(Protocol):
    """What `sinklab.metrics.record.measure_all` drives: the metrics' context, one batch run with hooks, and what was
    learnt on the way (`settle`)."""

    def context(self, eps: Sequence[float] = (0.3,), k: int = 4) -> Any: ...

    def run(self, idx: torch.Tensor, metrics: Sequence[Any]) -> None: ...

    def settle(self, metrics: Sequence[Any]) -> None: ...


class Decoder(ABC):
    """A model fed through a KV cache that evicts by a policy (`Target.decoder`): call it with the next tokens (B, N)
    for their logits (B, N, V); `compress()` applies the policy now (the prefill-then-ask protocol); `kept()` says,
    per layer, which text tokens each kv head of each sequence holds. A policy that masks keys (`masks`) decodes one
    sequence at a time (B = 1)."""

    @abstractmethod
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, N): the next tokens -> their logits (B, N, V)."""

    @abstractmethod
    def compress(self) -> None:
        """Evict down to the policy's budget now."""

    @abstractmethod
    def kept(self) -> list[torch.Tensor]:
        """Per layer (B, Hkv, L): the index of the text token each held key came from (-1: a learned sink token, or a
        key the policy masks)."""


class Target(ABC):
    """A model as every evaluation and analysis sees it (module docstring). Subclasses implement the abstract
    methods; `load(spec)` builds one, `accepts(spec)` says whether a spec names a model of this source."""

    source: ClassVar[str] = ""
    n_prefix: int = 0  # positions before the real tokens (learned sink tokens): an intervention's first position

    def __init__(self, model: torch.nn.Module, meta: TargetMeta):
        self.model, self.meta = model, meta

    @classmethod
    @abstractmethod
    def load(cls, spec: TargetSpec) -> "Target":
        """The model `spec` names, in eval mode on spec.device; one-line UserErrors."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> dict:
        """What the outputs say the model is, first in `sinklab measure --json`: target, source and the weights' note
        if any (`TargetMeta.head`; sources that load at a revision, in a dtype, add them)."""
        return self.meta.head()

    # --------------------------------------------------------------------------------------------- logits
    @abstractmethod
    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V), under the open `masked` mask if any."""

    def last_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> the last position's logits (B, V); sources override it to skip the LM head elsewhere."""
        return self.logits(idx)[:, -1]

    def nll(self, batches: Iterable[torch.Tensor]) -> tuple[float, int]:
        """`sinklab.model.lm_loss.mean_nll` of (B, T + 1) batches: (mean next-token loss, scored targets)."""
        return mean_nll(self.logits, batches, self.meta.prefix_len)

    # --------------------------------------------------------------------------------------------- metrics
    @abstractmethod
    def recorder(self) -> Recorder:
        """The model hooked for the metrics (under the open `masked` mask if any)."""

    def measure(self, tokens: torch.Tensor, names: Optional[Sequence[str]] = None, eps: Sequence[float] = (0.3,),
                k: int = 4, batch_size: int = 32, also: Sequence[type] = ()) -> list:
        """The registered metrics `names` (default: every one that applies) measured on tokens (N, T); `also`:
        unregistered Metric classes measured in the same forwards (the atlas's map of one sequence), returned last."""
        from sinklab.metrics import METRICS, measure_all

        recorder = self.recorder()
        ctx = recorder.context(eps, k)
        metrics = METRICS.build(ctx, list(names) if names is not None else None) + [cls(ctx) for cls in also]
        measure_all(recorder, tokens.to(self.device), metrics, batch_size=batch_size)
        return metrics

    # --------------------------------------------------------------------------------------------- hook names
    def hook_sites(self) -> dict:
        """TransformerLens's names on this model, name -> `sinklab.model.hooked.HookSite`; refused in one line where
        the source has none (the default)."""
        raise UserError(f"run_with_cache / run_with_hooks: {self.meta.target} ({self.meta.source}) has no "
                        "TransformerLens hook names; allowed: a sinklab checkpoint or run dir, a transformers model")

    def bos(self) -> tuple[bool, Optional[list[int]]]:
        """(whether a measurement puts BOS first by default, the ids put first for it, None where unknown)."""
        return False, None

    def run_with_cache(self, tokens: torch.Tensor, names_filter: Any = None,
                       prepend_bos: Optional[bool] = None) -> tuple[torch.Tensor, Any]:
        """(logits (B, T, V), an ActivationCache of the names `names_filter` picks: None all, a name, a list, or a
        function of the name) of tokens (T,) or (B, T), BOS first where `prepend_bos` says (`hook_input`); names,
        shapes and the cache as TransformerLens's (`sinklab.model.hooked`); under the open `masked` mask if any."""
        from sinklab.model.hooked import cached

        sites = self.hook_sites()
        idx = self.hook_input(tokens, prepend_bos)
        return cached(sites, names_filter, lambda: self.logits(idx))

    def run_with_hooks(self, tokens: torch.Tensor, fwd_hooks: Sequence[tuple],
                       prepend_bos: Optional[bool] = None) -> torch.Tensor:
        """The logits of tokens with `fwd_hooks` [(name or a function of the name, fn(tensor, hook) -> None or a
        replacement)] attached during the forward, and removed afterwards (also when it raised)."""
        from sinklab.model.hooked import hooks

        sites = self.hook_sites()
        idx = self.hook_input(tokens, prepend_bos)
        with hooks(sites, fwd_hooks):
            return self.logits(idx)

    def hook_input(self, tokens, prepend_bos: Optional[bool]) -> torch.Tensor:
        """tokens (T,) or (B, T) ids -> (B, T) on the model's device, BOS put first where `prepend_bos` says (None:
        as `sinklab measure` puts it, `bos()`). The attention sink forms on BOS, so this is never implicit."""
        idx = torch.as_tensor(tokens).long()
        idx = idx[None] if idx.ndim == 1 else idx
        if idx.ndim != 2:
            raise UserError(f"tokens: shape {tuple(idx.shape)}; allowed: (T,) or (batch, T) token ids")
        first, ids = self.bos()
        if prepend_bos is None:
            prepend_bos = first
        if prepend_bos and not ids:
            raise UserError(f"prepend_bos=True: {self.meta.target} has no BOS id (no run config or tokenizer to read "
                            "it from); pass prepend_bos=False")
        if prepend_bos:
            idx = torch.cat([idx.new_tensor(ids).expand(idx.shape[0], -1), idx], dim=1)  # (B, len(ids) + T)
        return idx.to(self.device)

    # --------------------------------------------------------------------------------------------- interventions
    @abstractmethod
    def masked(self, mask: Optional[MaskFn]) -> contextlib.AbstractContextManager:
        """Inside, every query of every layer also drops the keys `mask` is False for (None: nothing changes); a
        `LayerMask`: the queries of the layers and heads it names only."""

    @abstractmethod
    def set_output(self, layer: int, position: int, channels: list[int],
                   values: torch.Tensor) -> contextlib.AbstractContextManager:
        """Inside, layer `layer`'s output has h[:, position, channels] = values (position counts `n_prefix`)."""

    @abstractmethod
    def zero_value(self, layers: Optional[Iterable[int]], position: int) -> contextlib.AbstractContextManager:
        """Inside, in each layer of `layers` (None: every layer) the value vector of sequence position `position`
        (counting `n_prefix`) is 0 in every head: the attention weights stay, what a query takes from that key is
        nothing (a forward without a KV cache)."""

    # --------------------------------------------------------------------------------------------- KV cache
    def check_stream(self) -> None:
        """Refuse, in one line and before any work, a model whose cache cannot evict and re-index positions."""

    @abstractmethod
    def stream(self, first: Optional[int], recent: Optional[int]) -> Step:
        """A step that feeds one token (1, 1) at a time through a KV cache keeping the first `first` and the
        `recent` most recent tokens (the token fed counted), positions re-indexed inside the cache; both None: a
        dense cache that never evicts."""

    def decoder(self, policy: Any, evict: str = "decoding") -> Decoder:
        """A `Decoder` whose cache evicts by `policy` (a `sinklab.model.cache_policies.CachePolicy`) after every
        forward (evict="decoding") or when compressed ("prefill"); refused in one line where the source cannot."""
        raise UserError(f"cache policy {policy.name}: {self.meta.target} ({self.meta.source}) has no evicting cache; "
                        "allowed: sinklab checkpoints and transformers RoPE models")

    def stream_notes(self) -> list[str]:
        """What the streaming evaluation should tell about this model's positions (none by default)."""
        return []

    def dense_limit(self, n: int) -> Optional[str]:
        """Why a dense cache cannot hold n tokens (e.g. absolute positions end at their table), or None."""
        return None

    def past_context(self, n: int) -> contextlib.AbstractContextManager:
        """Inside, a forward of n tokens may run past the training context (a length-extrapolation measurement:
        `sinklab measure --past-context`); refused in one line where the model cannot (by default: every model)."""
        raise UserError(f"--past-context: {self.meta.target} ({self.meta.source}) is not measured past its context "
                        f"{self.meta.context}; allowed: a sinklab checkpoint with relative positions (RoPE, ALiBi, NoPE)")

    # --------------------------------------------------------------------------------------------- inputs
    @abstractmethod
    def natural_tokens(self, num_seqs: Optional[int], seq_len: Optional[int],
                       texts: Optional[Sequence[str]] = None) -> tuple[torch.Tensor, Optional[str]]:
        """(natural token ids (N, T), the text they come from in words, or None for a run's probe set): a run's
        probe set, or text through the model's own tokenizer (`texts`: files to read instead of the default)."""

    def no_probe_set(self) -> Optional[str]:
        """Why the model has no probe set of its own to measure by default (None: it has one)."""
        return None

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token id as the text it stands for (special tokens included), for labels (`sinklab atlas`'s axes);
        by default, where the source has no tokenizer, the ids themselves."""
        return [str(int(i)) for i in ids]


class SourceRegistry(NameRegistry[type[Target]]):
    """source name -> Target class, in registration order (a plugin's source registers as sinklab's do); an unknown
    source is a one-line UserError (it is named by the user)."""

    what = "target source"
    attribute = "source"
    unknown = UserError


SOURCES = SourceRegistry()


def load_target(spec: TargetSpec) -> Target:
    """The model `spec` names, loaded by its source's Target class."""
    import sinklab.targets  # noqa: F401  (registers sinklab's sources)

    return SOURCES.get(spec.source).load(spec)
