"""`sinklab prepare` (also scripts/prepare_data.py): tokenise a corpus once into a prepared directory.

    sinklab prepare --config conf/data/fineweb_edu.yaml --out /data/fineweb_edu_neox --num-proc 16
    sinklab prepare --corpus local --files a.jsonl b.parquet --vocab-size 8192 --out /data/mine
    sinklab-train data=fineweb_edu data.prepared_dir=/data/fineweb_edu_neox

The directory holds train/shard_NNNNN.bin and val/shard_NNNNN.bin (flat uint16, or uint32 for
tokenizers with more than 65536 ids), tokenizer.json and manifest.json; see sinklab/data/token_store.py.
Training reads the shards as memmaps, never loading them into memory.

Resumable: after an interruption (Ctrl-C, SIGKILL, a preempted job) run the same command again:
finished shards are kept, a partially written one is redone, and the result is byte-identical to an
uninterrupted run. A directory built with another tokenizer or from another corpus is refused
(--overwrite rebuilds it). `--config` reads the defaults from a conf/data/*.yaml file; flags win.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import typing
from pathlib import Path

from omegaconf import OmegaConf
from tokenizers import Tokenizer

from .token_store import build_store
from .config import DataConfig, from_settings, load_preset
from .corpus import open_corpus
from .errors import UserError
from .fsutil import resolve_cache_dir, safe_name
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


def _flag_type(key: str) -> type:
    hint = typing.get_type_hints(DataConfig)[key]
    return next((t for t in (int, float) if hint in (t, typing.Optional[t])), str)


def parse_args(argv: list[str], prog: str) -> tuple[argparse.Namespace, DataConfig]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (created; resumed if it exists)")
    parser.add_argument("--config", help="a conf/data/*.yaml file whose keys give the defaults")
    for key, default in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if key == "files":
            parser.add_argument(flag, nargs="+", help="local .txt/.jsonl/.parquet files")
        elif key == "streaming":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help="stream the corpus (default: hub)")
        else:
            parser.add_argument(flag, type=_flag_type(key), help=f"data.{key} (default: {default})")
    parser.add_argument("--overwrite", action="store_true", help="rebuild a directory made with another tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    settings = dict(DEFAULTS)
    if args.config:
        preset = load_preset(args.config)
        for key in KEYS:  # not the interpolations into the training config, nor a required value left open (???)
            if not OmegaConf.is_interpolation(preset, key) and not OmegaConf.is_missing(preset, key):
                settings[key] = preset[key]
    for key in KEYS:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.files and args.corpus is None and settings["corpus"] == "shakespeare":  # --files alone: those files
        settings["corpus"] = "local"
    return args, from_settings(DataConfig, settings)


def main(argv: list[str] | None = None, prog: str = "sinklab prepare") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, config = parse_args(argv, prog)
    out, _, manifest = tokenise(config, resolve_cache_dir(config.cache_dir), Path(args.out).expanduser().resolve(),
                                overwrite=args.overwrite, progress=not args.no_progress,
                                command=f"{prog} {shlex.join(argv)}")
    t = manifest["tokens"]
    print(f"{out}: {len(manifest['chunks'])} shards, {t['train']:,} training + {t['val']:,} validation tokens "
          f"({manifest['dtype']}, {manifest['tokenizer']['vocab_size']} ids); train with data.prepared_dir={out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(prog="python -m sinklab.data.prepare"))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
