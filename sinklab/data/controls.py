"""Training-block controls for the attention-sink ablations (issue 5).

They change *training* blocks only; validation blocks and the probe set stay natural text.

  random_positions   1-indexed input positions whose token is resampled uniformly from the tokenizer's
                     vocabulary [0, tokenizer size) in every block, e.g. [1], [1, 2], [2].
  fixed_token        {position: p, token_id: id | null}: the same token at position p of every block.
                     token_id null gives a dedicated new id equal to the tokenizer size, so the model
                     vocabulary grows by one (LMDataModule.vocab_size accounts for it).
  bos                prepend the BOS/EOS id at position 1 of every block; the block then holds
                     block_size natural tokens after it (the natural text is shifted, not overwritten).

Positions count from 1 over the model input b[:, :-1]: position p is column p - 1 of a
(block_size + 1)-token block. The unique-token cap (max_unique_tokens) limits where blocks are read
from and lives in blocks.TrainBlocks. The settings and their rules are DataConfig's (sinklab/data/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .config import DataConfig
from .errors import UserError


@dataclass(frozen=True)
class BlockControls:
    random_positions: tuple[int, ...] = ()
    fixed_position: int | None = None
    fixed_token_id: int | None = None  # None with fixed_position set: a new id, given by resolve()
    bos: bool = False
    bos_id: int | None = None          # set by resolve()
    vocab: int = 0                     # random tokens are drawn from [0, vocab); set by resolve()

    @classmethod
    def from_config(cls, config: DataConfig) -> "BlockControls":
        """The controls a data config asks for (DataConfig has checked them against each other and block_size)."""
        fixed_id = config.fixed_token.token_id if config.fixed_token is not None else None
        return cls(random_positions=tuple(config.random_positions), fixed_position=config.fixed_position,
                   fixed_token_id=fixed_id, bos=config.bos)

    def resolve(self, tokenizer_vocab: int, eos_id: int) -> "BlockControls":
        """Fill in the ids that depend on the tokenizer; checks an explicit fixed token id."""
        fixed_id = self.fixed_token_id
        if self.fixed_position is not None and fixed_id is None:
            fixed_id = tokenizer_vocab
        elif fixed_id is not None and not 0 <= fixed_id < tokenizer_vocab:
            raise UserError(f"data.fixed_token.token_id={fixed_id} is outside the tokenizer's ids "
                            f"0..{tokenizer_vocab - 1} (null gives a dedicated new id)")
        return replace(self, fixed_token_id=fixed_id, bos_id=eos_id if self.bos else None, vocab=tokenizer_vocab)

    @property
    def extra_ids(self) -> int:
        """Ids beyond the tokenizer's that the model must embed (the dedicated fixed token)."""
        return int(self.fixed_position is not None and self.fixed_token_id is not None
                   and self.fixed_token_id >= self.vocab > 0)

    @property
    def natural_length_offset(self) -> int:
        """How many block columns are not read from the corpus (the prepended BOS)."""
        return 1 if self.bos else 0

    def apply(self, natural: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """(block_size + 1 - natural_length_offset,) natural tokens -> (block_size + 1,) training block."""
        if self.vocab == 0 and (self.bos or self.random_positions or self.fixed_position is not None):
            raise RuntimeError("BlockControls.apply before resolve(tokenizer_vocab, eos_id)")
        block = np.concatenate([[self.bos_id], natural]) if self.bos else natural
        if self.random_positions:
            block[np.asarray(self.random_positions) - 1] = rng.integers(0, self.vocab, size=len(self.random_positions))
        if self.fixed_position is not None:
            block[self.fixed_position - 1] = self.fixed_token_id
        return block

    def describe(self) -> dict:
        out = {}
        if self.random_positions:
            out["random_positions"] = list(self.random_positions)
        if self.fixed_position is not None:
            out["fixed_token"] = {"position": self.fixed_position, "token_id": self.fixed_token_id}
        if self.bos:
            out["bos_id"] = self.bos_id
        return out
