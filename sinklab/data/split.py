"""Train / validation split of a corpus, by group, so that validation is really held out.

A group is the unit that never straddles the split: for Shakespeare a play (both editions), for other corpora
the value of `data.group_field` if set, else the document text itself (so exact duplicates never straddle it).
Groups are ordered by a hash of their key and moved to validation until it holds `val_fraction` of the
characters; the choice depends on the corpus only, never on the training seed. When groups are too coarse for
the fraction (e.g. a single text file), every document is cut instead: its last `val_fraction` (at a line
boundary) is validation. Streaming corpora (hub data sets) cannot be sized in advance: a document is validation
when the hash of its group falls below `val_fraction`.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Sequence

from .documents import quiet_datasets

if TYPE_CHECKING:
    import datasets

SPLIT_VERSION = "group-hash-v1"  # bump when the split rule changes: it is part of every corpus fingerprint


def group_hash(key: str) -> float:
    """A uniform number in [0, 1) from a group key; fixed for ever (it decides the split)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"sinklab-split").digest()
    return int.from_bytes(digest, "little") / 2.0**64


def assign_splits(keys: Sequence[str], sizes: Sequence[int], val_fraction: float,
                  coarse_ok: bool = False) -> list[str] | None:
    """'train'/'val' per document, whole groups at a time, validation ~ val_fraction of the characters.

    Groups are taken in hash order until validation holds val_fraction of the characters. Returns None
    when the groups are too coarse: validation would need more than twice the fraction (unless
    `coarse_ok`), or everything.
    """
    totals: dict[str, int] = defaultdict(int)
    for key, size in zip(keys, sizes):
        totals[key] += size
    total = sum(totals.values())
    target = val_fraction * total
    val, held = set(), 0
    for key in sorted(totals, key=group_hash):
        if held >= target:
            break
        val.add(key)
        held += totals[key]
    if len(totals) < 2 or held >= total or (held > 2 * target and not coarse_ok):
        return None
    return ["val" if key in val else "train" for key in keys]


def split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut a document so that its last ~val_fraction (from a line start) is held out."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut)
    if 0 <= newline < len(text) - 1:
        cut = newline + 1
    return text[:cut], text[cut:]


def _split_every_document(batch: dict, val_fraction: float) -> dict:
    texts, splits = [], []
    for text in batch["text"]:
        head, tail = split_tail(text, val_fraction)
        texts += [head, tail]
        splits += ["train", "val"]
    return {"text": texts, "split": splits}


def _keys_and_sizes(batch: dict, group_field: str | None) -> dict:
    groups = batch[group_field] if group_field else batch["text"]
    return {"_key": [hashlib.blake2b(str(g).encode("utf-8"), digest_size=16).hexdigest() for g in groups],
            "_size": [len(t) for t in batch["text"]]}


def _hash_split(batch: dict, group_field: str | None, val_fraction: float) -> dict:
    groups = batch[group_field] if group_field else batch["text"]
    return {"split": ["val" if group_hash(str(g)) < val_fraction else "train" for g in groups]}


def split_finite(ds: datasets.Dataset, val_fraction: float, group_field: str | None, what: str) -> datasets.Dataset:
    """Columns text, split of a sized data set (group split, or per-document tail split if too coarse)."""
    with quiet_datasets():
        keyed = ds.map(_keys_and_sizes, batched=True, fn_kwargs={"group_field": group_field})
        splits = assign_splits(keyed["_key"], keyed["_size"], val_fraction)
        ds = ds.select_columns(["text"])
        if splits is not None:
            return ds.add_column("split", splits)
        warnings.warn(f"{what}: too few groups to hold out {val_fraction:.0%} of the text by document; "
                      f"holding out the last {val_fraction:.0%} of every document instead")
        return ds.map(_split_every_document, batched=True, fn_kwargs={"val_fraction": val_fraction},
                      remove_columns=ds.column_names)


def split_streaming(ds: datasets.IterableDataset, val_fraction: float,
                    group_field: str | None) -> datasets.IterableDataset:
    """Columns text, split of a stream: a document is validation when the hash of its group is below val_fraction."""
    ds = ds.map(_hash_split, batched=True, fn_kwargs={"group_field": group_field, "val_fraction": val_fraction})
    return ds.select_columns(["text", "split"])
