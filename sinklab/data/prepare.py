"""`sinklab prepare` (also scripts/prepare_data.py): tokenise a corpus once into a prepared directory.

    sinklab prepare --config conf/data/fineweb_edu.yaml --out /data/fineweb_edu_neox --num-proc 16
    sinklab prepare --corpus local --files a.jsonl b.parquet --vocab-size 8192 --out /data/mine
    sinklab-train data=fineweb_edu data.prepared_dir=/data/fineweb_edu_neox

The directory holds train/shard_NNNNN.bin and val/shard_NNNNN.bin (flat uint16, or uint32 for
tokenizers with more than 65536 ids), tokenizer.json and manifest.json; see sinklab/data/cache.py.
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
from pathlib import Path

from omegaconf import OmegaConf

from .cache import build_store
from .corpus import open_corpus
from .errors import DataFileNotFoundError, UserError
from .fsutil import resolve_cache_dir
from .tokenizer import EOS_TOKEN, eos_token_id, resolve_tokenizer

DEFAULTS = {
    "corpus": "shakespeare", "files": None, "archive": None, "hub_path": None, "hub_name": None,
    "hub_split": "train", "streaming": None, "text_field": "text", "group_field": None,
    "encoding_errors": "strict", "val_fraction": 0.1, "tokenizer": "bpe", "vocab_size": 4096,
    "eos_token": EOS_TOKEN, "cache_dir": None, "max_train_tokens": None, "docs_per_shard": 50_000,
    "num_proc": os.cpu_count() or 1,
}
TYPES = {"val_fraction": float, "vocab_size": int, "max_train_tokens": int, "docs_per_shard": int, "num_proc": int}


def parse_args(argv: list[str], prog: str) -> tuple[argparse.Namespace, dict]:
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
            parser.add_argument(flag, type=TYPES.get(key, str), help=f"data.{key} (default: {default})")
    parser.add_argument("--overwrite", action="store_true", help="rebuild a directory made with another tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    settings = dict(DEFAULTS)
    if args.config:
        path = Path(args.config).expanduser()
        if not path.is_file():
            raise DataFileNotFoundError(f"--config: {path} does not exist")
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        for key in DEFAULTS:
            value = raw.get(key, settings[key])
            if isinstance(value, str) and "${" in value:  # interpolations into the training config
                continue
            settings[key] = value
    for key in DEFAULTS:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return args, settings


def main(argv: list[str] | None = None, prog: str = "sinklab prepare") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, s = parse_args(argv, prog)
    if s["num_proc"] < 1 or s["docs_per_shard"] < 1:
        raise UserError(f"--num-proc={s['num_proc']} and --docs-per-shard={s['docs_per_shard']} must be >= 1")
    cache = resolve_cache_dir(s["cache_dir"])
    corpus = open_corpus(s["corpus"], cache_dir=cache, files=s["files"], archive=s["archive"], hub_path=s["hub_path"],
                         hub_name=s["hub_name"], hub_split=s["hub_split"], streaming=s["streaming"],
                         text_field=s["text_field"], group_field=s["group_field"],
                         encoding_errors=s["encoding_errors"], val_fraction=s["val_fraction"])
    tok = resolve_tokenizer(s["tokenizer"], vocab_size=s["vocab_size"], corpus=corpus, cache_dir=cache,
                            eos_token=s["eos_token"])
    out = Path(args.out).expanduser().resolve()
    manifest = build_store(corpus, tok, out, eos_id=eos_token_id(tok, s["eos_token"], s["tokenizer"]),
                           docs_per_shard=s["docs_per_shard"], num_proc=s["num_proc"],
                           max_train_tokens=s["max_train_tokens"], overwrite=args.overwrite,
                           progress=not args.no_progress, command=f"{prog} {shlex.join(argv)}")
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
