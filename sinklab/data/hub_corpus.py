"""Hugging Face hub data sets as a corpus (`data.corpus=hub`, `data.hub_path`, e.g. FineWeb-Edu, the Pile).

Loaded with `datasets.load_dataset(hub_path, hub_name, split=hub_split)`, streamed by default (`data.streaming`),
so nothing is downloaded up front; the text column is `data.text_field`, the split groups by `data.group_field`.
"""

from __future__ import annotations

from typing import Sequence

from .config import DataConfig
from .documents import Corpus
from .errors import UserError
from .fsutil import hash_strings


def open_hub(config: DataConfig, streaming: bool, settings: Sequence[str]) -> Corpus:
    """The documents of the hub data set, not yet split, as columns text (+ group_field); `settings` (how they are
    read and split) join the data set's id in the fingerprint."""
    import datasets

    path, name, split = config.hub_path, config.hub_name, config.hub_split
    text_field, group_field = config.text_field, config.group_field
    ds = datasets.load_dataset(path, name, split=split, streaming=streaming)
    columns = ds.column_names or []  # unknown (empty) for some streaming data sets
    missing = [c for c in (text_field, group_field) if c and columns and c not in columns]
    if missing:
        raise UserError(f"hub data set {path} ({name}) has no column {missing[0]!r} (found {ds.column_names}); "
                        f"set data.text_field / data.group_field")
    ds = ds.select_columns([text_field] + ([group_field] if group_field else []))
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return Corpus(name="hub-" + "-".join(x.replace("/", "_") for x in (path, name) if x),
                  fingerprint=hash_strings("hub", path, name or "", split, *settings),
                  source=f"https://huggingface.co/datasets/{path} ({name or 'default'}, split {split})",
                  licence=f"see https://huggingface.co/datasets/{path}", documents=ds)
