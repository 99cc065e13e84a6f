"""Fixed-length token blocks for training, validation and the probe set.

Training (TrainBlocks + StepBatchSampler)
    Sample index i is a (block_size + 1)-token block read at a random offset of the training split,
    with no BOS by default (as in the reference). Everything random about sample i (its offset, and
    the tokens of `random_positions`) comes from the counter-based generator
    `numpy.random.default_rng([seed, i])`, so a sample depends on (seed, i) only: not on the worker
    that loads it, the world size, or what was loaded before. Micro-batch step m of rank r in a world
    of W ranks is the indices m*B*W + r*B + j, j < B: ranks are disjoint, and a run resumed at
    optimizer step s (micro-step s * accumulate) sees exactly the batches an uninterrupted run sees.
    With `unique_tokens = N` offsets are drawn from [0, N - (block_size + 1)], so training only ever
    reads the first N tokens of the split.

With a retrieval task (data.retrieval, sinklab/data/retrieval/) sample i is instead, with probability `rate`, a
retrieval sample whose filler is read from the same tokens; the choice and the sample come from their own generator
`retrieval.mix_rng(seed, i)`, so that every other block is the one a run without retrieval reads.

Validation (ValBlocks): `num_blocks` blocks at evenly spaced offsets of the validation split, with the BOS
token first when the training blocks have one (data.bos).

Retrieval validation (RetrievalSamples): `num_samples` retrieval samples of block_size + 1 tokens at the fixed seed
retrieval.VAL_SEED, their filler read from the validation split, with their answer masks.

Probe (probe_offsets): `num_seqs` sequences at evenly spaced offsets of the validation split; no seed,
so every run on the same data probes the same held-out text.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from .token_store import TokenStore
from .controls import BlockControls
from .errors import UserError
from .retrieval import VAL_SEED, RetrievalTask, Sample, TokenRun, make_samples, mix_rng


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of training sample `index`: a pure function of (seed, index)."""
    return np.random.default_rng([seed, index])


def evenly_spaced(n_tokens: int, length: int, count: int) -> np.ndarray:
    """`count` start offsets of `length`-token windows spread evenly over [0, n_tokens)."""
    if n_tokens < length:
        raise UserError(f"need at least {length} tokens, have {n_tokens}")
    return np.linspace(0, n_tokens - length, count).round().astype(np.int64)  # (count,)


class TrainBlocks(Dataset):
    """Map-style: item i is training sample i, a LongTensor (block_size + 1,)."""

    def __init__(self, store: TokenStore, block_size: int, seed: int, unique_tokens: int | None = None,
                 controls: BlockControls = BlockControls(), retrieval: RetrievalTask | None = None,
                 retrieval_rate: float = 0.0):
        self.store = store
        self.block_size = block_size
        self.seed = seed
        self.controls = controls
        self.limit = len(store) if unique_tokens is None else int(unique_tokens)  # blocks read tokens [0, limit)
        self.span = block_size + 1 - controls.natural_length_offset           # natural tokens per block
        if self.limit > len(store):
            raise UserError(f"data.max_unique_tokens={self.limit} exceeds the {len(store)} tokens of the "
                            f"training split")
        if self.limit < self.span:
            what = "data.max_unique_tokens" if unique_tokens is not None else "the training split"
            raise UserError(f"{what} has {self.limit} tokens, fewer than one block of block_size + 1 = "
                            f"{block_size + 1}; use a larger corpus or a smaller block_size")
        self.retrieval, self.retrieval_rate = retrieval, retrieval_rate

    def retrieval_sample(self, index: int) -> Sample | None:
        """Sample `index` when it is a retrieval sample (block_size + 1 tokens, filler from the tokens training reads;
        the other controls are not applied to it), else None."""
        if self.retrieval is None or self.retrieval_rate <= 0:
            return None
        rng = mix_rng(self.seed, index)
        if rng.random() >= self.retrieval_rate:
            return None
        return self.retrieval.sample(rng, self.block_size + 1, TokenRun(self.store, self.limit))

    def offset(self, index: int) -> int:
        """Start of sample `index` in the training split (uniform over [0, limit - span])."""
        return int(sample_rng(self.seed, index).integers(self.limit - self.span + 1))

    def __getitem__(self, index: int) -> torch.Tensor:
        mixed = self.retrieval_sample(index)
        if mixed is not None:
            return torch.from_numpy(mixed.tokens)  # (block_size + 1,)
        rng = sample_rng(self.seed, index)
        start = int(rng.integers(self.limit - self.span + 1))
        block = self.controls.apply(self.store.read(start, self.span), rng)  # (block_size + 1,)
        return torch.from_numpy(block)


class StepBatchSampler(Sampler):
    """Endless batches of sample indices: micro-step m on rank r is [m*B*W + r*B + j for j < B]."""

    def __init__(self, batch_size: int, start_step: int = 0, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside a world of {world_size}")
        self.batch_size, self.start_step, self.rank, self.world_size = batch_size, start_step, rank, world_size

    def __iter__(self):
        step, B = self.start_step, self.batch_size
        while True:
            first = step * B * self.world_size + self.rank * B
            yield list(range(first, first + B))
            step += 1


class StepLoader:
    """The training loader both data modules share: endless, each rank's share of every step's batches, starting at
    the trainer's global step (a resume continues the sample stream). A data module provides `train_dataset()`,
    `batch_size`, `num_workers` and `trainer` (a LightningDataModule's)."""

    pin_memory = False

    def train_dataset(self) -> Dataset:
        raise NotImplementedError

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
        return DataLoader(self.train_dataset(), batch_sampler=sampler, num_workers=self.num_workers,
                          pin_memory=self.pin_memory)


class ValBlocks(Dataset):
    """`num_blocks` fixed (block_size + 1)-token blocks of the validation split; rank r takes r::world. With
    `bos_id` (data.bos) a block is that id and then block_size natural tokens, as every training block is (the text
    shifted by one, not overwritten; the offsets stay those of the plain blocks), so that the validation loss is
    measured on the distribution the model trains on."""

    def __init__(self, store: TokenStore, block_size: int, num_blocks: int, rank: int = 0, world_size: int = 1,
                 bos_id: int | None = None):
        if len(store) < block_size + 1:
            raise UserError(f"the validation split has {len(store)} tokens, fewer than one block of block_size + 1 = "
                            f"{block_size + 1}; raise data.val_fraction or lower block_size")
        usable = num_blocks - num_blocks % world_size  # every rank gets the same number of blocks
        self.store, self.length, self.bos_id = store, block_size + 1, bos_id
        self.offsets = evenly_spaced(len(store), self.length, num_blocks)[:usable][rank::world_size]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        if self.bos_id is None:
            return torch.from_numpy(self.store.read(start, self.length))  # (block_size + 1,)
        return torch.from_numpy(np.concatenate([[self.bos_id], self.store.read(start, self.length - 1)]))


class RetrievalSamples(Dataset):
    """`num_samples` held-out retrieval samples of block_size + 1 tokens (make_samples at the seed VAL_SEED, filler
    from the validation split); rank r takes r::world. Item i: (tokens LongTensor (L,), answer BoolTensor (L,))."""

    def __init__(self, task: RetrievalTask, store: TokenStore, block_size: int, num_samples: int, rank: int = 0,
                 world_size: int = 1):
        usable = num_samples - num_samples % world_size  # every rank gets the same number of samples
        self.samples = make_samples(task, usable, block_size + 1, VAL_SEED, store)[rank::world_size]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self.samples[index]
        return torch.from_numpy(sample.tokens), torch.from_numpy(sample.answer)


def probe_set(store: TokenStore, num_seqs: int, seq_len: int) -> np.ndarray:
    """int64 (num_seqs, seq_len): natural held-out text at evenly spaced offsets of the validation split."""
    if len(store) < seq_len:
        raise UserError(f"the validation split has {len(store)} tokens, fewer than data.probe_seq_len={seq_len}")
    offsets = evenly_spaced(len(store), seq_len, num_seqs)
    return np.stack([store.read(int(o), seq_len) for o in offsets])
