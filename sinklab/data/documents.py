"""The Corpus object every reader returns and the token store is built from, and the `datasets` helpers they share.

`datasets` is imported where a corpus is read or tokenised, never at import: training from a prepared directory
(data.prepared_dir) and `sinklab measure` run without it (a stock GPU image has none)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

from sinklab.errors import import_optional

if TYPE_CHECKING:
    import datasets


def import_datasets(needed_by: str) -> ModuleType:
    """The `datasets` package for reading a corpus (`needed_by`: the option that reads one, e.g. data.corpus=local);
    not installed: a one-line error that names the option and points to a prepared directory, which needs none."""
    return import_optional("datasets", needed_by, instead="or train from a directory made by `sinklab prepare` "
                           "where it is installed (data=local data.prepared_dir=DIR), which needs none")


@contextmanager
def quiet_datasets():
    """No `datasets` progress bars inside (for the many small internal maps and filters)."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


@dataclass
class Corpus:
    """Documents in a fixed order, each with a 'text' and, once split (corpus.open_corpus), a 'split' ('train' or
    'val'); a reader's documents before the split may also hold the group field."""

    name: str          # short id, used in cache paths
    fingerprint: str   # content + split rule; keys every cache built from this corpus
    source: str        # human-readable origin, recorded in manifests
    licence: str
    documents: datasets.Dataset | datasets.IterableDataset

    @property
    def streaming(self) -> bool:
        import datasets

        return isinstance(self.documents, datasets.IterableDataset)

    @property
    def num_documents(self) -> int | None:
        return None if self.streaming else len(self.documents)

    def chunks(self, start: int, docs_per_chunk: int) -> Iterator[datasets.Dataset]:
        """Chunks k = start, start+1, ... of `docs_per_chunk` consecutive documents (the last may be short)."""
        import datasets

        if not self.streaming:
            n = len(self.documents)
            for k in range(start, (n + docs_per_chunk - 1) // docs_per_chunk):
                yield self.documents.select(range(k * docs_per_chunk, min((k + 1) * docs_per_chunk, n)))
            return
        stream = self.documents.skip(start * docs_per_chunk) if start else self.documents
        rows: list[dict] = []
        for row in stream:
            rows.append({"text": row["text"], "split": row["split"]})
            if len(rows) == docs_per_chunk:
                yield datasets.Dataset.from_list(rows)
                rows = []
        if rows:
            yield datasets.Dataset.from_list(rows)

    def train_texts(self, max_chars: int | None = None) -> Iterator[str]:
        """Training-split texts in corpus order, stopping after `max_chars` characters."""
        if self.streaming:
            rows = iter(self.documents)
        else:
            rows = ({"text": t, "split": s} for batch in self.documents.iter(batch_size=256)
                    for t, s in zip(batch["text"], batch["split"]))
        seen = 0
        for row in rows:
            if row["split"] != "train":
                continue
            yield row["text"]
            seen += len(row["text"])
            if max_chars is not None and seen >= max_chars:
                return
