"""Synthetic data with a BOS token at position 1, where an attention sink emerges within seconds on a CPU.

Two tasks (`task=`):

seen_flag (default)
    BOS, then uniform random tokens, except that the token after any token that already occurred in the
    sequence is a flag token R. One attention head solves it by matching the current token against the
    earlier ones; when nothing matches (most positions early in a sequence) it has nowhere useful to look, and a
    softmax head parks its attention on BOS. In sinklab runs a 1-layer, 1-head softmax model (d 64, lr 1e-2,
    20 warmup steps, cosine over 400-600 steps) reaches Sink_1 = 99-100% by step 400 for seeds 0, 1, 2 (alpha_1
    0.45-0.58 at step 600); sigmoid attention without normalisation shows Sink*_1 of 16 / 0 / 0% at step 400.
    It is fragile beyond that setting: at lr 3e-3 the same model solves the task without a sink (Sink_1 0% at
    step 600, alpha_1 ~0.2), and models with 2 heads or 2 layers mostly do too. A pipeline check, not a model
    of LLM sinks.
bigram_backcopy
    Guo et al. 2024 ("Active-dormant attention heads", arXiv:2410.13835): a fixed random bigram (Markov) chain,
    except that after one of a few trigger tokens the next token copies the token before the trigger. Here a
    1-layer, 1-head model (d 64, constant lr 1e-2) learns the copy within ~300 steps, but its head parked on BOS
    only at step ~2,250 (Sink_1 99%, 54% at step 2,500; one seed): too slow for a test.

Same API as `sinklab.data.LMDataModule` (what `sinklab-train` and the sink callback use):

    dm = SyntheticDataModule(...).prepare()
    dm.vocab_size          # task ids (ordinary tokens, the flag for seen_flag, BOS last) padded to a multiple of 64
    dm.train_dataloader()  # endless (B, T + 1) LongTensor batches; sample i depends on (seed, i) only;
                           # starts at trainer.global_step, so a resumed run sees the same samples
    dm.val_dataloader()    # fixed held-out sequences (independent of seed)
    dm.probe_tokens()      # (probe_num_seqs, probe_seq_len) held-out sequences, BOS at position 1
    dm.describe()

The task (bigram table, triggers) and the validation / probe sequences depend on `task_seed` only, so runs with
different training seeds learn the same task and are probed on the same sequences. Hydra: conf/data/synthetic.yaml;
test: tests/integration/test_sink_emergence.py.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .blocks import StepLoader, sample_rng
from .config import SyntheticDataConfig, from_settings, settings_dict

# sample-index offsets of the held-out streams (training uses indices 0, 1, 2, ... of `seed`)
_VAL_STREAM = 1_000_003
_PROBE_STREAM = 2_000_003


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


class SeenFlag:
    """Repeat flag: after a token that already occurred earlier in the sequence comes the flag token R;
    after any other token (a first occurrence, or R) comes a uniformly random ordinary token.

    Ids: 0..n_tokens-1 ordinary tokens, R = n_tokens, BOS = n_tokens + 1. One attention head solves it by
    matching the current token against earlier ones; when nothing matches (most positions early in a sequence)
    the head has nothing to look at. At lr 1e-2 a 1-layer 1-head softmax model parks it on BOS (Sink_1 100%);
    at lr 3e-3 it reaches the same loss with attention spread out (alpha_1 ~0.2), so the sink is one solution
    that training finds, not one the task forces (experiments/cpu/search/README.md)."""

    def __init__(self, n_tokens: int = 64, task_seed: int = 0):
        self.n_tokens, self.flag_id, self.bos_id = n_tokens, n_tokens, n_tokens + 1
        self.triggers = np.zeros(0, dtype=np.int64)

    def sequence(self, rng: np.random.Generator, length: int) -> np.ndarray:
        draws = rng.integers(0, self.n_tokens, size=length)
        x = np.empty(length, dtype=np.int64)
        x[0] = self.bos_id
        seen = np.zeros(self.n_tokens + 2, dtype=bool)
        for t in range(1, length):
            prev = x[t - 1]
            x[t] = self.flag_id if (prev < self.n_tokens and seen[prev]) else draws[t]
            seen[prev] = True
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


class SyntheticDataModule(StepLoader, L.LightningDataModule):
    """seen_flag / bigram_backcopy sequences with a fixed BOS at position 1 (see the module docstring)."""

    def __init__(self, **settings: Any):
        """The settings are the fields of SyntheticDataConfig (sinklab/data/config.py: defaults and rules)."""
        super().__init__()
        self.config: SyntheticDataConfig = from_settings(SyntheticDataConfig, settings)
        self.save_hyperparameters(settings_dict(self.config))
        cfg = self.config
        self.block_size, self.batch_size, self.num_workers, self.seed = cfg.block_size, cfg.batch_size, \
            cfg.num_workers, cfg.seed
        self._task: BigramBackcopy | None = None
        self._probe: np.ndarray | None = None

    # ------------------------------------------------------------------ preparation
    def prepare(self) -> "SyntheticDataModule":
        if self._task is None:
            cfg = self.config
            if cfg.task == "seen_flag":
                self._task = SeenFlag(cfg.n_tokens, cfg.task_seed)
            else:
                self._task = BigramBackcopy(cfg.n_tokens, cfg.n_triggers, float(cfg.concentration), cfg.task_seed)
            probe = _Stream(self._task, cfg.probe_seq_len, cfg.task_seed, _PROBE_STREAM, cfg.probe_num_seqs)
            self._probe = np.stack([probe[i].numpy() for i in range(cfg.probe_num_seqs)])
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
        """The task's ids (n_tokens, + the flag token for seen_flag, + BOS), padded to pad_vocab_to_multiple_of."""
        m = self.config.pad_vocab_to_multiple_of
        return -(-(self.task.bos_id + 1) // m) * m

    @property
    def bos_id(self) -> int:
        return self.task.bos_id

    eos_id = bos_id  # LMDataModule's name for the BOS id

    def train_dataset(self) -> Dataset:
        return _Stream(self.task, self.block_size + 1, self.seed)

    def train_dataloader(self) -> DataLoader:
        step, rank, world, accumulate = self._distributed()
        return self.make_train_loader(step, rank, world, accumulate)

    def val_dataloader(self) -> DataLoader:
        _, rank, world, _ = self._distributed()
        n = self.config.val_num_blocks - self.config.val_num_blocks % world
        stream = _Stream(self.task, self.block_size + 1, self.config.task_seed, _VAL_STREAM, n)
        idx = list(range(rank, n, world))
        return DataLoader(torch.utils.data.Subset(stream, idx), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def probe_tokens(self) -> torch.Tensor:
        """LongTensor (probe_num_seqs, probe_seq_len): held-out sequences (BOS first), the same for every seed."""
        self.prepare()
        return torch.from_numpy(self._probe.copy())

    first_probe_token = "the task's BOS token"  # what token 1 of every probe sequence is, in words

    def describe(self) -> dict:
        cfg, task = self.config, self.task
        return {"source": "synthetic", "task": cfg.task, "n_tokens": cfg.n_tokens, "bos_id": self.bos_id,
                "triggers": task.triggers.tolist(), "concentration": float(cfg.concentration),
                "task_seed": cfg.task_seed, "vocab_size": self.vocab_size, "block_size": self.block_size}
