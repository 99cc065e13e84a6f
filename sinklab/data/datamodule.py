"""LMDataModule: corpus -> tokenizer -> token store -> training / validation blocks and the probe set.

Built from conf/data/*.yaml (`_target_: sinklab.data.LMDataModule`) by `sinklab.data.config.build_data_module`.
Typical use:

    dm = build_data_module(cfg.data)
    dm.prepare()                          # fetch corpus, train/load tokenizer, build caches (idempotent)
    model = build_model(vocab_size=dm.vocab_size)   # padded size, includes a dedicated fixed token
    trainer.fit(model, datamodule=dm)     # Trainer(use_distributed_sampler=False, max_steps=...)

The train loader is endless and starts at `trainer.global_step` (Lightning restores a checkpoint
before it builds dataloaders), so a resumed run continues with exactly the samples an uninterrupted
run would have seen; it shards itself across DDP ranks (see blocks.py). With an endless loader, set
the trainer's `max_steps` and an integer `val_check_interval` (with `check_val_every_n_epoch=None`).
Batches are LongTensors (batch_size, block_size + 1): input b[:, :-1], targets b[:, 1:].

With data.retrieval.task set (sinklab/data/retrieval/), training blocks are replaced by retrieval samples at
data.retrieval.rate, and validation has a second loader of held-out retrieval samples, batches [tokens (B, T + 1),
answer (B, T + 1)] (the training module logs val/retrieval/*); `dm.retrieval_task` is the task with its ids.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from .blocks import RetrievalSamples, StepLoader, TrainBlocks, ValBlocks, probe_set
from .token_store import open_store
from .config import DataConfig, from_settings, settings_dict
from .controls import BlockControls
from .errors import DataFileNotFoundError, UserError
from .fsutil import atomic_write_bytes, resolve_cache_dir
from .prepare import tokenise
from .retrieval import RetrievalTask, task_for_data
from .tokenizer import (BPE, eos_token_id, load_tokenizer, padded_vocab_size, text_bytes, tokenizer_fingerprint,
                        tokenizer_size)

log = logging.getLogger(__name__)  # sinklab.data.datamodule: shown by the training entry point (Hydra logging)


def _info(message: str) -> None:
    if rank_zero_only.rank == 0:
        log.info(message)


def _after_prepare(name: str, doc: str) -> property:
    """A read-only attribute that exists once prepare() has run (a clear error before)."""
    def get(self):
        self._prepared()
        return getattr(self, name)
    return property(get, doc=doc)


class LMDataModule(StepLoader, L.LightningDataModule):
    """Corpus -> tokenizer -> token store -> blocks. The settings are the fields of DataConfig (sinklab/data/
    config.py, where their defaults and rules live), as keyword arguments: `LMDataModule(corpus="local",
    files=[...])`, or from a config node with `build_data_module(cfg.data)`. They are checked here, before any
    data is read, and kept as `dm.config` (and as Lightning hyperparameters)."""

    def __init__(self, **settings: Any):
        super().__init__()
        self.config: DataConfig = from_settings(DataConfig, settings)
        self.save_hyperparameters(settings_dict(self.config))
        cfg = self.config
        self._controls = BlockControls.from_config(cfg)
        self.block_size, self.batch_size, self.num_workers = cfg.block_size, cfg.batch_size, cfg.num_workers
        self.pin_memory = torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory
        self.seed = cfg.seed
        self.max_unique_tokens = cfg.max_unique_tokens
        # --- filled by prepare() ---
        self._tokenizer: Tokenizer | None = None
        self._vocab_size: int | None = None
        self._manifest: dict | None = None
        self._stores = None
        self._probe: np.ndarray | None = None
        self._train_blocks: TrainBlocks | None = None
        self._retrieval: RetrievalTask | None = None
        self.store_dir: Path | None = None
        self._val_bytes: dict[tuple, tuple[list[int], list[int]]] = {}  # val_bytes_per_token's count per block

    # ------------------------------------------------------------------------------------------
    # preparation

    def prepare(self) -> "LMDataModule":
        """Fetch the corpus, train/load the tokenizer, build the token store and probe set (idempotent)."""
        if self._stores is not None:
            return self
        cfg = self.config
        if cfg.prepared_dir:
            # tokenizer=bpe means "the directory's own tokenizer"; anything else must be the same tokenizer
            root = Path(cfg.prepared_dir).expanduser()
            stored = root / "tokenizer.json"
            if cfg.tokenizer == BPE and not stored.is_file():
                open_store(root)  # the clearer error if root is no token store at all
                raise DataFileNotFoundError(f"{stored} not found; set data.tokenizer to the tokenizer {root} was "
                                            f"prepared with")
            tok = load_tokenizer(str(stored) if cfg.tokenizer == BPE else cfg.tokenizer)
        else:
            root, tok, _ = tokenise(cfg, resolve_cache_dir(cfg.cache_dir),
                                    rebuild=cfg.rebuild_cache and rank_zero_only.rank == 0)
        manifest, stores = open_store(root, tokenizer_fingerprint(tok))
        eos = eos_token_id(tok, cfg.eos_token, cfg.tokenizer)
        if eos != manifest["eos_id"]:
            raise UserError(f"{root / 'manifest.json'} separates documents with id {manifest['eos_id']}, but "
                            f"data.eos_token={cfg.eos_token!r} is id {eos}; set data.eos_token to match")

        tok_vocab = tokenizer_size(tok)
        controls = self._controls.resolve(tok_vocab, eos)
        retrieval = task_for_data(cfg.retrieval, tok, f"data.tokenizer={cfg.tokenizer}", tok_vocab, eos,
                                  controls.bos_id, new_id=tok_vocab + controls.extra_ids)  # markers after a fixed token
        train_blocks = TrainBlocks(stores["train"], self.block_size, self.seed, self.max_unique_tokens, controls,
                                   retrieval, cfg.retrieval.rate if retrieval is not None else 0.0)
        ValBlocks(stores["val"], self.block_size, cfg.val_num_blocks)  # checks the validation split is long enough
        probe = self._load_probe(root, stores["val"], cfg.probe_num_seqs, cfg.probe_seq_len)

        self._tokenizer, self._manifest, self._stores, self._probe = tok, manifest, stores, probe
        self._controls, self._train_blocks, self.store_dir = controls, train_blocks, root
        self._retrieval = retrieval
        n_ids = max(tok_vocab + controls.extra_ids, retrieval.n_ids if retrieval is not None else 0)
        self._vocab_size = padded_vocab_size(n_ids, cfg.pad_vocab_to_multiple_of)
        return self

    @staticmethod
    def _load_probe(root: Path, store, num_seqs: int, seq_len: int) -> np.ndarray:
        path = root / "probe.npy"
        if path.is_file():
            probe = np.load(path)
            if probe.shape == (num_seqs, seq_len):
                return probe
        probe = probe_set(store, num_seqs, seq_len)  # (num_seqs, seq_len) int64
        buf = io.BytesIO()
        np.save(buf, probe)
        try:
            atomic_write_bytes(path, buf.getvalue())
        except OSError as e:  # a read-only prepared directory: keep it in memory
            log.info("could not save %s (%s)", path, e)
        return probe

    def prepare_data(self) -> None:
        self.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    def _prepared(self):
        if self._stores is None:
            raise RuntimeError("LMDataModule: call dm.prepare() first")

    # ------------------------------------------------------------------------------------------
    # public API

    vocab_size: int = _after_prepare("_vocab_size", "Vocabulary size the model must use: tokenizer ids (+ a "
                                                    "dedicated fixed token, + a retrieval task's markers), padded.")
    tokenizer: Tokenizer = _after_prepare("_tokenizer", "The tokenizer of this data.")
    train_blocks: TrainBlocks = _after_prepare("_train_blocks", "The training blocks (a Dataset).")
    retrieval_task: RetrievalTask | None = _after_prepare("_retrieval", "The retrieval task of data.retrieval on this "
                                                          "data, with its ids (sinklab/data/retrieval/); None when "
                                                          "data.retrieval.task is null.")

    @property
    def eos_id(self) -> int:
        self._prepared()
        return self._manifest["eos_id"]

    @property
    def unique_tokens(self) -> int:
        """Tokens training draws from: max_unique_tokens, or the whole training split."""
        return self.train_blocks.limit

    def epochs_over_unique(self, max_steps: int, global_batch: int) -> float:
        """Passes over the unique training tokens made by max_steps steps of global_batch blocks."""
        return max_steps * global_batch * self.block_size / self.unique_tokens

    def train_dataset(self) -> TrainBlocks:
        return self.train_blocks

    def train_dataloader(self) -> DataLoader:
        step, rank, world, accumulate = self._distributed()
        trainer = self.trainer
        global_batch = self.batch_size * world * accumulate
        if trainer is not None and trainer.max_steps and trainer.max_steps > 0:
            seen = trainer.max_steps * global_batch * self.block_size
            _info(f"data: {trainer.max_steps} steps x {global_batch} blocks x {self.block_size} tokens = "
                           f"{seen:,} tokens = {self.epochs_over_unique(trainer.max_steps, global_batch):.2f} epochs "
                           f"over {self.unique_tokens:,} unique training tokens"
                           + (" (max_unique_tokens)" if self.max_unique_tokens else ""))
        if step:
            _info(f"data: train loader starts at step {step} (sample {step * global_batch})")
        return self.make_train_loader(step, rank, world, accumulate)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation blocks, on the training distribution: with data.bos each starts with the BOS token, as
        every training block does (the other controls, random and fixed tokens, are interventions on training and
        leave validation natural). The training's val/loss, `sinklab quant` and `sinklab eval intervene` read
        these. With data.retrieval.task set, a list: these, then the held-out retrieval samples
        (`retrieval_dataloader`)."""
        text = self._loader(self._val_blocks())
        return text if self._retrieval is None else [text, self.retrieval_dataloader()]

    def retrieval_dataloader(self) -> DataLoader:
        """This rank's share of data.retrieval.val_num_samples held-out retrieval samples (fixed seed, filler from
        the validation split), batches [tokens (B, T + 1), answer (B, T + 1)]."""
        _, rank, world, _ = self._distributed()
        if self.retrieval_task is None:
            raise UserError("data.retrieval.task is null: this data has no retrieval samples")
        return self._loader(RetrievalSamples(self._retrieval, self._stores["val"], self.block_size,
                                             self.config.retrieval.val_num_samples, rank, world))

    def _loader(self, dataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def _val_blocks(self) -> ValBlocks:
        """This rank's validation blocks ((T + 1,) each), in the order val_dataloader batches them."""
        _, rank, world, _ = self._distributed()
        self._prepared()
        return ValBlocks(self._stores["val"], self.block_size, self.config.val_num_blocks, rank, world,
                         bos_id=self._controls.bos_id)

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer's file: data.tokenizer's where it names one (a tokenizer.json, or a dir holding one), else the
        copy every token store keeps of the tokenizer it was encoded with (a trained BPE, a hub tokenizer)."""
        self._prepared()
        given = Path(self.config.tokenizer).expanduser()
        if self.config.tokenizer != BPE and given.exists():
            return given / "tokenizer.json" if given.is_dir() else given
        return self.store_dir / "tokenizer.json"

    def text_bytes(self, rows, what: str) -> list[int]:
        """The UTF-8 bytes of the text each row of token ids decodes to with this data's tokenizer
        (`sinklab.data.tokenizer.text_bytes`: special tokens decode to none; one line naming the tokenizer file when
        it does not decode `what` to UTF-8)."""
        return text_bytes(self.tokenizer, rows, str(self.tokenizer_file), what)

    def val_bytes_per_token(self, n_batches: int | None = None, prefix_len: int = 0) -> float | None:
        """UTF-8 bytes of text per scored target of this rank's first `n_batches` validation batches (all with
        None): the targets val/loss averages over (`sinklab.model.lm_loss.scored_targets`: not a block's first
        token, the BOS token where data.bos; a prefix LM's (model.prefix_len) first targets neither), so that
        bits per byte = val/loss / (ln 2 x this) (`sinklab.model.lm_loss.bits_per_byte`). The blocks are decoded
        once and their counts cached; None where the targets decode to no text. One line naming the tokenizer file
        when it does not decode the validation blocks to UTF-8."""
        from sinklab.model.lm_loss import bytes_per_token, scored_targets

        _, rank, world, _ = self._distributed()
        key = (prefix_len, rank, world)
        if key not in self._val_bytes:
            blocks = self._val_blocks()
            rows = scored_targets(torch.stack([blocks[i] for i in range(len(blocks))]), prefix_len)
            self._val_bytes[key] = (self.text_bytes(rows, "the validation blocks"), [len(r) for r in rows])
        n_bytes, n_targets = self._val_bytes[key]
        k = len(n_bytes) if n_batches is None else n_batches * self.batch_size  # the loader's first n batches
        return bytes_per_token(sum(n_bytes[:k]), sum(n_targets[:k]))

    def probe_tokens(self) -> torch.Tensor:
        """LongTensor (probe_num_seqs, probe_seq_len): held-out natural text, identical for all runs on this data."""
        self._prepared()
        probe = torch.from_numpy(self._probe.copy())
        if self.config.probe_bos:
            probe = torch.cat([torch.full_like(probe[:, :1], self.eos_id), probe[:, :-1]], dim=1)
        if self.config.probe_fixed_token:  # the token the model saw at that position in every block
            probe[:, self._controls.fixed_position - 1] = self._controls.fixed_token_id
        return probe

    def val_text(self, n_tokens: int) -> torch.Tensor:
        """LongTensor (n_tokens,): the start of the validation split as one contiguous text (documents joined by the
        separator, as stored), with the BOS id first when data.bos (as every training block starts). For evaluations
        over contexts longer than a block (`sinklab eval streaming`)."""
        self._prepared()
        store, bos = self._stores["val"], int(self.config.bos)
        if len(store) < n_tokens - bos:
            raise UserError(f"the validation split has {len(store)} tokens, fewer than the {n_tokens - bos} asked for")
        text = torch.from_numpy(store.read(0, n_tokens - bos))  # (n_tokens - bos,) int64
        return torch.cat([torch.tensor([self.eos_id]), text]) if bos else text

    @property
    def first_probe_token(self) -> str:
        """What token 1 of the probe sequences is (Sink_1 scores attention on it), in words."""
        if self.config.probe_bos:
            return f"the BOS token {self.config.eos_token!r}"
        if self.config.probe_fixed_token and self._controls.fixed_position == 1:
            return "the fixed token (data.fixed_token)"
        return "the first text token of each probe sequence (no BOS: data.probe_bos=false)"

    def describe(self) -> dict:
        """Short summary for logging."""
        self._prepared()
        m, cfg = self._manifest, self.config
        out = {
            "source": m["corpus"]["source"],
            "corpus": m["corpus"]["name"],
            "tokenizer": str(self.store_dir / "tokenizer.json") if cfg.prepared_dir else cfg.tokenizer,
            "tokenizer_vocab": m["tokenizer"]["vocab_size"],
            "vocab_size": self._vocab_size,
            "tokens": dict(m["tokens"]),
            "unique_tokens": self.unique_tokens,
            "block_size": self.block_size,
            "store": str(self.store_dir),
        }
        out.update(self._controls.describe())
        if self._retrieval is not None:
            out["retrieval"] = {**self._retrieval.describe(), "rate": cfg.retrieval.rate}
        trainer = self.trainer
        if trainer is not None and trainer.max_steps and trainer.max_steps > 0:
            _, _, world, accumulate = self._distributed()
            out["epochs_over_unique"] = round(self.epochs_over_unique(trainer.max_steps,
                                                                      self.batch_size * world * accumulate), 3)
        return out
