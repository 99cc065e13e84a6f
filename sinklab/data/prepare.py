"""Tokenise a corpus once into a prepared directory (the command: `sinklab prepare`, `sinklab.cli.prepare`).

The directory holds train/shard_NNNNN.bin and val/shard_NNNNN.bin (flat uint16, or uint32 for tokenizers with more
than 65536 ids), tokenizer.json and manifest.json; see sinklab/data/token_store.py. Training reads the shards as
memmaps, never loading them into memory. Resumable (see the command's docstring).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from tokenizers import Tokenizer

from .config import DataConfig, from_settings, load_preset
from .corpus import open_corpus
from .fsutil import safe_name
from .token_store import build_store
from .tokenizer import BPE, eos_token_id, resolve_tokenizer, tokenizer_fingerprint

# the DataConfig keys that shape a token store (the others choose blocks from it); flags --corpus, --files, ...
KEYS = ("corpus", "files", "archive", "hub_path", "hub_name", "hub_split", "streaming", "text_field", "group_field",
        "encoding_errors", "val_fraction", "tokenizer", "vocab_size", "eos_token", "cache_dir", "max_train_tokens",
        "docs_per_shard", "num_proc")
DEFAULTS = {**{key: getattr(DataConfig(), key) for key in KEYS}, "num_proc": os.cpu_count() or 1}


def tokenizer_label(config: DataConfig) -> str:
    """The tokenizer's part of an automatic token store's directory name."""
    if config.tokenizer == BPE:
        return f"bpe{config.vocab_size}"
    if Path(config.tokenizer).expanduser().exists():
        return "tokenizer"
    return safe_name(config.tokenizer, 40)  # a hub id


def tokenise(config: DataConfig, cache: Path, out: Path | None = None, **options) -> tuple[Path, Tokenizer, dict]:
    """Open the configured corpus, resolve its tokenizer and build (or resume) its token store in `out`, by default
    the data module's automatic cache <cache>/tokens/<corpus>-<fp>/<tokenizer>-<fp>; `options` go to build_store.
    Returns (store directory, tokenizer, manifest)."""
    corpus = open_corpus(config, cache)
    tok = resolve_tokenizer(config.tokenizer, vocab_size=config.vocab_size, corpus=corpus, cache_dir=cache,
                            eos_token=config.eos_token)
    if out is None:
        out = (cache / "tokens" / f"{corpus.name}-{corpus.fingerprint[:12]}"
               / f"{tokenizer_label(config)}-{tokenizer_fingerprint(tok)[:12]}")
    manifest = build_store(corpus, tok, out, eos_id=eos_token_id(tok, config.eos_token, config.tokenizer),
                           docs_per_shard=config.docs_per_shard, num_proc=config.num_proc,
                           max_train_tokens=config.max_train_tokens, **options)
    return out, tok, manifest


def prepare_config(preset_file: Optional[str], settings: dict[str, Any]) -> DataConfig:
    """The DataConfig of a token store: DEFAULTS, then the keys of a conf/data/*.yaml `preset_file` (not its
    interpolations into the training config, nor a required value left open), then `settings` (None: not set); local
    `files` alone mean the local corpus."""
    merged = dict(DEFAULTS)
    if preset_file:
        preset = load_preset(preset_file)
        for key in KEYS:
            if not OmegaConf.is_interpolation(preset, key) and not OmegaConf.is_missing(preset, key):
                merged[key] = preset[key]
    merged.update({key: value for key, value in settings.items() if value is not None})
    if settings.get("files") and settings.get("corpus") is None and merged["corpus"] == "shakespeare":
        merged["corpus"] = "local"
    return from_settings(DataConfig, merged)
