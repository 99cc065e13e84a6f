"""`sinklab prepare` (also scripts/prepare_data.py): tokenise a corpus once into a prepared directory
(`sinklab.data.prepare`).

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
import shlex
import sys
import typing
from pathlib import Path

from sinklab.data.config import DataConfig
from sinklab.data.fsutil import resolve_cache_dir
from sinklab.data.prepare import DEFAULTS, KEYS, prepare_config, tokenise

SUMMARY = "tokenise a corpus once into sharded memmaps"  # the line in `sinklab --help`


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

    return args, prepare_config(args.config, {key: getattr(args, key) for key in KEYS})


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
