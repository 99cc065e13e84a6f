"""A sinklab model as a transformers causal LM: `SinklabForCausalLM`, for every component sinklab has.

`sinklab export-hf` writes this file into an export whose config LLaMA cannot represent (modeling_sinklab.py, beside
configuration_sinklab.py); config.json's `auto_map` names both, so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it, offline too. The design: this file runs sinklab's own model, built from the config's `sinklab_model` dict
(`ModelConfig.from_dict`, as a checkpoint builds it), so every component (gates, sink logits and tokens, K / V
biases, QK-norm, differential / sigmoid / kernel attention, layer patterns, any position, sparse operations, per-head
norms) computes exactly what it computed in training, and a new component needs no new export code. It therefore
imports sinklab (`pip install sinklab==<config.sinklab_version>`: one line says so when it is missing). A model with a
plugin's component needs that plugin loaded by the user (its package's entry point, or SINKLAB_PLUGINS):
`config.sinklab_plugins` names the modules, and a missing one is one ImportError saying how to load it, but a module
is never imported because a file names it. The weights are the checkpoint's, `model.` + sinklab's names.

- `forward` takes input_ids (no padding: sinklab's models have no padding mask) and returns CausalLMOutputWithPast.
- Generation goes through transformers' cache API: `SinklabCache` is a `transformers.Cache` over sinklab's own dense
  `KVCache` (`sinklab.model.kv_cache`), which keeps each layer's keys and values (and an operation's own per-token
  tensors, NSA's and DSA's), the learned sink tokens included; a forward with it feeds only the new tokens.
  `generate` makes one (this model declines transformers' DynamicCache: the layers extend their own cache).
- `output_attentions=True` gives each layer's map as sinklab's metrics score it, (B, H, T_new, T_past + T_new) over
  the real tokens: the learned sink tokens' and K / KV bias slots' columns are left out (as transformers' gpt-oss
  leaves its sink logit out), so a row's mass on them is 1 - its sum.
- `output_hidden_states=True`: the first block's input, then each block's output, the last one after the final norm
  (transformers' convention), real tokens only.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_sinklab import SinklabConfig

# the output's cache field: `cache` in transformers 5, `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def sinklab_model(config: SinklabConfig) -> torch.nn.Module:
    """sinklab's Transformer built from config.sinklab_model. The plugin modules config.json names
    (`sinklab_plugins`) are never imported because a file names them: they must be among the plugins the user loads
    (an installed package's entry point, or SINKLAB_PLUGINS), else one ImportError says how to load them. One-line
    ImportErrors for a missing sinklab too."""
    try:
        importlib.import_module("sinklab")
    except ImportError:
        raise ImportError(f"this model's code (modeling_sinklab.py) runs sinklab's model: pip install "
                          f"sinklab=={config.sinklab_version}") from None
    from sinklab.errors import UserError
    from sinklab.model import ModelConfig, Transformer
    from sinklab.plugins import ENV, load_plugins

    loaded = load_plugins()  # the user's own: entry points and SINKLAB_PLUGINS
    missing = {module: package for module, package in config.sinklab_plugins.items() if module not in loaded}
    if missing:
        packages = ", ".join(dict.fromkeys(package for package in missing.values() if package))
        raise ImportError(f"this model uses plugin module(s) {', '.join(map(repr, missing))}, which sinklab does not "
                          "import because a file names them: " + (f"pip install {packages} (its entry point loads "
                          "them) or " if packages else "") + f"set {ENV}={','.join(missing)}")
    try:
        cfg = ModelConfig.from_dict(config.sinklab_model)
    except UserError as err:
        import sinklab

        raise ValueError(f"{err} (the export was written by sinklab {config.sinklab_version}, this is sinklab "
                         f"{sinklab.__version__})") from None
    return Transformer(cfg)


def without_extra_state(_module, state: dict, _prefix: str, _metadata) -> None:
    """A state-dict hook: the modules' non-tensor `_extra_state` entries dropped (config.json holds them)."""
    for key in [k for k in state if k.endswith("._extra_state")]:
        del state[key]


class SinklabCacheLayer(CacheLayerMixin):
    """One layer of a `SinklabCache`: a view of sinklab's KVCache for that layer (its keys and values are written
    by sinklab's attention, never through `update`)."""

    def __init__(self, kv, layer: int):  # noqa: D107  (no CacheLayerMixin.__init__: keys / values are views here)
        self.kv, self.layer = kv, layer
        self.is_initialized = True

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """(B, Hkv, L, hd) the keys held (after RoPE: a dense cache), or None before the first forward."""
        k = self.kv.k[self.layer]
        return None if k is None else k[:, :, :self.kv.length]

    @property
    def values(self) -> Optional[torch.Tensor]:
        v = self.kv.v[self.layer]
        return None if v is None else v[:, :, :self.kv.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("sinklab's attention extends its own cache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError("sinklab's attention extends its own cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.length + query_length, 0

    def get_seq_length(self) -> int:
        """The text tokens fed so far (the learned sink tokens are not input tokens)."""
        return self.kv.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length in transformers before 5.20
        return -1

    def reset(self) -> None:
        raise NotImplementedError("make a new SinklabCache instead")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the layer's keys, values and the operation's own tensors follow their sequences."""
        kv, i = self.kv, self.layer
        if kv.k[i] is None:
            return
        kv.k[i], kv.v[i] = (t.index_select(0, beam_idx.to(t.device)) for t in (kv.k[i], kv.v[i]))
        kv.extra[i] = {name: t.index_select(0, beam_idx.to(t.device)) for name, t in kv.extra[i].items()}


class SinklabCache(Cache):
    """transformers' Cache over sinklab's own dense KVCache (`kv`, from `Transformer.new_cache()`)."""

    def __init__(self, kv):
        super().__init__(layers=[SinklabCacheLayer(kv, i) for i in range(kv.n_layer)])
        self.kv = kv


class SinklabForCausalLM(PreTrainedModel, GenerationMixin):
    """sinklab's Transformer (`self.model`) as a transformers causal LM (module docstring)."""

    config_class = SinklabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: SinklabConfig):
        super().__init__(config)
        # built on the CPU, not on transformers' meta device: sinklab computes its non-persistent buffers (RoPE
        # tables, ALiBi slopes) when it is built; from_pretrained replaces them by empty tensors and has
        # `_init_weights` fill them, from the copies each module keeps here
        with torch.device("cpu"):
            self.model = sinklab_model(config)
        # non-tensor state (DSA's step) comes from config.json, and stays out of the weights file
        for name, value in config.sinklab_extra_state.items():
            self.model.get_submodule(name.removesuffix("._extra_state")).set_extra_state(value)
        self._register_state_dict_hook(without_extra_state)
        for module in self.model.modules():
            kept = {name: buf.detach().clone() for name, buf in module.named_buffers(recurse=False)
                    if name in module._non_persistent_buffers_set}
            if kept:
                module._sinklab_buffers = kept
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """A module's non-persistent buffers, as sinklab computed them; parameters are left as they are (sinklab's
        model initialised them when it was built, `reset_parameters`, and from_pretrained loads every one)."""
        for name, value in getattr(module, "_sinklab_buffers", {}).items():
            getattr(module, name).copy_(value)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """transformers' DynamicCache is declined: `forward` makes a SinklabCache (sinklab's layers extend their own)."""
        return False

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_emb

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T, vocab) (the last `logits_to_keep` positions when > 0); with a
        SinklabCache (or use_cache=True, which makes one) input_ids are the tokens after those it holds."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("SinklabForCausalLM takes input_ids only (sinklab's model embeds its own tokens and "
                             "learned sink tokens)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("SinklabForCausalLM: attention_mask has padding (zeros); sinklab's models have no "
                             "padding mask: pass sequences of one length without padding")
        if cache is None and use_cache:
            cache = SinklabCache(self.model.new_cache())
        if cache is not None and not isinstance(cache, SinklabCache):
            raise ValueError(f"SinklabForCausalLM keeps its keys in a SinklabCache (its layers extend sinklab's own "
                             f"cache), got {type(cache).__name__}; pass use_cache=True or no cache")
        kv = cache.kv if cache is not None else None
        T = input_ids.shape[1]
        seen = kv.seen if kv is not None else 0
        if position_ids is not None and not torch.equal(position_ids.reshape(-1, T)[0].cpu(),
                                                          torch.arange(seen, seen + T)):
            raise ValueError(f"SinklabForCausalLM: position_ids other than {seen} .. {seen + T - 1} (the tokens' "
                             "places after those the cache holds) are not supported")
        want_maps = output_attentions if output_attentions is not None else self.config.output_attentions
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        layout = self.model.layout(T, input_ids.device, kv) if want_maps else None
        with self.recording(layout, want_hidden, T) as (maps, hidden_states):
            hidden = self.model(input_ids, return_hidden=True, cache=kv)  # (B, T, d) after the final norm
        if hidden_states:
            hidden_states[-1] = hidden
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.model.lm_head(hidden[:, keep])  # (B, T_keep, vocab)
        loss = None
        if labels is not None:  # next-token loss, as transformers' causal LMs compute it (-100: not scored)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        extra = self.model.cfg.n_slots + self.model.cfg.n_sink_tokens  # key columns before the real tokens
        attentions = tuple(a[:, :, -T:, extra:] for a in maps) if want_maps else None  # (B, H, T, T_past + T)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=tuple(hidden_states) or None,
                                      attentions=attentions, **{CACHE_FIELD: cache})

    def recording(self, layout, hidden: bool, T: int):
        """A context giving (the maps of `recorded_maps` under `layout`, [] when layout is None; the residual stream
        of the T real tokens before the first block and after each, [] when not `hidden`)."""
        from sinklab.metrics.record import recorded_maps

        @contextlib.contextmanager
        def record():
            states: list[torch.Tensor] = []
            handles = []
            if hidden:  # (B, S + T, d) -> (B, T, d): the learned sink tokens left out
                handles.append(self.model.blocks[0].register_forward_pre_hook(
                    lambda _m, args: states.append(args[0][:, -T:])))
                for block in self.model.blocks:
                    handles.append(block.hook_resid.register_forward_hook(
                        lambda _m, _i, out: states.append(out[:, -T:])))
            try:
                if layout is None:
                    yield [], states
                else:
                    with recorded_maps(self.model, layout) as maps:
                        yield maps, states
            finally:
                for h in handles:
                    h.remove()
        return record()
