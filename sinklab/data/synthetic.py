"""Synthetic data where an attention sink emerges within a few hundred steps: the bigram-backcopy task.

Bigram-backcopy (Guo et al. 2024, "Active-dormant attention heads: mechanistically demystifying
extreme-token phenomena in LLMs", arXiv:2410.13835): every sequence starts with a fixed BOS token;
the next token follows a fixed random bigram (Markov) table, except after one of a few *trigger*
tokens, where it copies the token just before the trigger. Predicting the next token needs attention
only at trigger positions (to look one token back); everywhere else the past beyond the current token
is useless, so most heads are "dormant" most of the time and park their attention on the BOS token:
the attention sink. A softmax model of 1-4 layers shows it within a few hundred steps; attention
without row normalisation (sigmoid) can switch heads off without one.

Same API as `sinklab.data.LMDataModule` (what `sinklab-train` and the sink callback use):

    dm = SyntheticDataModule(...).prepare()
    dm.vocab_size          # padded; ids 0..n_tokens-1 are ordinary tokens, n_tokens is BOS
    dm.train_dataloader()  # endless (B, T + 1) LongTensor batches; sample i depends on (seed, i) only;
                           # starts at trainer.global_step, so a resumed run sees the same samples
    dm.val_dataloader()    # fixed held-out sequences (independent of seed)
    dm.probe_tokens()      # (probe_num_seqs, probe_seq_len) held-out sequences, BOS at position 1
    dm.describe()

The task itself (bigram table, triggers) depends on `task_seed` only, so runs with different training
seeds learn the same task and are probed on the same sequences. Hydra: conf/data/bigram_backcopy.yaml.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from .blocks import StepBatchSampler, sample_rng
from .errors import UserError

# sample-index offsets of the held-out streams (training uses indices 0, 1, 2, ... of `seed`)
_VAL_STREAM = 1_000_003
_PROBE_STREAM = 2_000_003


def _check_int(key: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UserError(f"data.{key}={value!r} must be an integer >= {minimum}")


class BigramBackcopy:
    """The generator: a bigram table over `n_tokens` ordinary tokens, `n_triggers` trigger tokens, BOS = n_tokens."""

    def __init__(self, n_tokens: int = 64, n_triggers: int = 4, concentration: float = 0.1, task_seed: int = 0):
        rng = np.random.default_rng([task_seed, 7919])
        self.n_tokens, self.bos_id = n_tokens, n_tokens
        self.triggers = np.sort(rng.choice(n_tokens, size=n_triggers, replace=False))
        self.is_trigger = np.zeros(n_tokens, dtype=bool)
        self.is_trigger[self.triggers] = True
        probs = rng.dirichlet(np.full(n_tokens, concentration), size=n_tokens)  # (n_tokens, n_tokens) rows sum to 1
        self.cdf = np.cumsum(probs, axis=1)
        self.cdf[:, -1] = 1.0

    def sequence(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """int64 (length,): BOS, a uniform first token, then bigram steps / back-copies after triggers."""
        u = rng.random(length)
        x = np.empty(length, dtype=np.int64)
        x[0] = self.bos_id
        if length > 1:
            x[1] = min(int(u[1] * self.n_tokens), self.n_tokens - 1)
        for t in range(2, length):
            prev = x[t - 1]
            if self.is_trigger[prev] and t >= 3:
                x[t] = x[t - 2]  # copy the token before the trigger
            else:
                x[t] = int(np.searchsorted(self.cdf[prev], u[t], side="right"))
        return x


class _Stream(Dataset):
    """Map-style: item i is sequence i of stream (seed, offset + i)."""

    def __init__(self, task: BigramBackcopy, length: int, seed: int, offset: int = 0, count: int | None = None):
        self.task, self.length, self.seed, self.offset, self.count = task, length, seed, offset, count

    def __len__(self) -> int:
        if self.count is None:
            raise TypeError("the training stream is endless")
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.task.sequence(sample_rng(self.seed, self.offset + int(index)), self.length))


class SyntheticDataModule(L.LightningDataModule):
    """Bigram-backcopy sequences with a fixed BOS at position 1 (see the module docstring)."""

    def __init__(
        self,
        task: str = "bigram_backcopy",
        n_tokens: int = 64,          # ordinary tokens; BOS is one more id
        n_triggers: int = 4,         # tokens after which the next token copies the one before the trigger
        concentration: float = 0.1,  # Dirichlet concentration of the bigram rows (small: peaked transitions)
        task_seed: int = 0,          # the task (bigram table, triggers) and the held-out sequences
        block_size: int = 64,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,               # training samples depend on (seed, sample index) only
        val_num_blocks: int = 64,
        probe_num_seqs: int = 100,
        probe_seq_len: int = 64,
        pad_vocab_to_multiple_of: int = 64,
        vocab_size: int | None = None,  # ignored: the vocabulary follows from n_tokens (kept so that
                                        # configs interpolating ${data.vocab_size} still compose)
    ):
        super().__init__()
        self.save_hyperparameters()
        if task != "bigram_backcopy":
            raise UserError(f"data.task={task!r}: only 'bigram_backcopy' is available")
        for key, value, minimum in [("n_tokens", n_tokens, 2), ("n_triggers", n_triggers, 0), ("task_seed", task_seed, 0),
                                    ("block_size", block_size, 1), ("batch_size", batch_size, 1),
                                    ("num_workers", num_workers, 0), ("seed", seed, 0),
                                    ("val_num_blocks", val_num_blocks, 1), ("probe_num_seqs", probe_num_seqs, 1),
                                    ("probe_seq_len", probe_seq_len, 2),
                                    ("pad_vocab_to_multiple_of", pad_vocab_to_multiple_of, 1)]:
            _check_int(key, value, minimum)
        if n_triggers >= n_tokens:
            raise UserError(f"data.n_triggers={n_triggers} must be below data.n_tokens={n_tokens}")
        if not float(concentration) > 0:
            raise UserError(f"data.concentration={concentration!r} must be > 0")
        self.block_size, self.batch_size, self.num_workers, self.seed = block_size, batch_size, num_workers, seed
        self._task: BigramBackcopy | None = None
        self._probe: np.ndarray | None = None

    # ------------------------------------------------------------------ preparation
    def prepare(self) -> "SyntheticDataModule":
        if self._task is None:
            hp = self.hparams
            self._task = BigramBackcopy(hp.n_tokens, hp.n_triggers, float(hp.concentration), hp.task_seed)
            probe = _Stream(self._task, hp.probe_seq_len, hp.task_seed, _PROBE_STREAM, hp.probe_num_seqs)
            self._probe = np.stack([probe[i].numpy() for i in range(hp.probe_num_seqs)])
        return self

    def prepare_data(self) -> None:
        self.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    @property
    def task(self) -> BigramBackcopy:
        return self.prepare()._task

    # ------------------------------------------------------------------ public API
    @property
    def vocab_size(self) -> int:
        """n_tokens + 1 (BOS), padded to a multiple of pad_vocab_to_multiple_of."""
        m = self.hparams.pad_vocab_to_multiple_of
        return -(-(self.hparams.n_tokens + 1) // m) * m

    @property
    def bos_id(self) -> int:
        return self.hparams.n_tokens

    eos_id = bos_id  # LMDataModule's name for the BOS id

    def _distributed(self) -> tuple[int, int, int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_step, trainer.global_rank, trainer.world_size, trainer.accumulate_grad_batches
        if dist.is_available() and dist.is_initialized():
            return 0, dist.get_rank(), dist.get_world_size(), 1
        return 0, 0, 1, 1

    def make_train_loader(self, step: int = 0, rank: int = 0, world_size: int = 1, accumulate: int = 1) -> DataLoader:
        """Endless loader of this rank's training batches from optimizer step `step` on."""
        sampler = StepBatchSampler(self.batch_size, start_step=step * accumulate, rank=rank, world_size=world_size)
        return DataLoader(_Stream(self.task, self.block_size + 1, self.seed), batch_sampler=sampler,
                          num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        step, rank, world, accumulate = self._distributed()
        return self.make_train_loader(step, rank, world, accumulate)

    def val_dataloader(self) -> DataLoader:
        _, rank, world, _ = self._distributed()
        n = self.hparams.val_num_blocks - self.hparams.val_num_blocks % world
        stream = _Stream(self.task, self.block_size + 1, self.hparams.task_seed, _VAL_STREAM, n)
        idx = list(range(rank, n, world))
        return DataLoader(torch.utils.data.Subset(stream, idx), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def probe_tokens(self) -> torch.Tensor:
        """LongTensor (probe_num_seqs, probe_seq_len): held-out sequences (BOS first), the same for every seed."""
        self.prepare()
        return torch.from_numpy(self._probe.copy())

    def describe(self) -> dict:
        hp, task = self.hparams, self.task
        return {"source": "synthetic", "task": hp.task, "n_tokens": hp.n_tokens, "bos_id": self.bos_id,
                "triggers": task.triggers.tolist(), "concentration": float(hp.concentration),
                "task_seed": hp.task_seed, "vocab_size": self.vocab_size, "block_size": self.block_size}
