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
from and lives in blocks.TrainBlocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

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
    def from_config(cls, *, random_positions=None, fixed_token=None, bos: bool = False,
                    block_size: int) -> "BlockControls":
        """Validate the config values (before any data is loaded)."""
        if isinstance(random_positions, (str, bytes)) or not isinstance(random_positions or (), Sequence):
            raise UserError(f"data.random_positions={random_positions!r} must be a list of positions, e.g. [1, 2]")
        positions = tuple(int(p) for p in (random_positions or ()))
        if len(set(positions)) != len(positions):
            raise UserError(f"data.random_positions={list(positions)} repeats a position")
        for p in positions:
            if not 1 <= p <= block_size:
                raise UserError(f"data.random_positions: position {p} is outside 1..block_size={block_size}")
        fixed_position = fixed_id = None
        if fixed_token is not None:
            if not isinstance(fixed_token, Mapping):
                raise UserError(f"data.fixed_token={fixed_token!r} must be null or {{position: p, token_id: id|null}}")
            unknown = set(fixed_token) - {"position", "token_id"}
            if unknown:
                raise UserError(f"data.fixed_token has unknown key(s) {sorted(unknown)} (allowed: position, token_id)")
            if fixed_token.get("position") is not None:
                fixed_position = int(fixed_token["position"])
                if not 1 <= fixed_position <= block_size:
                    raise UserError(f"data.fixed_token.position={fixed_position} is outside 1..block_size={block_size}")
                if fixed_token.get("token_id") is not None:
                    fixed_id = int(fixed_token["token_id"])
            elif fixed_token.get("token_id") is not None:
                raise UserError("data.fixed_token.token_id is set but data.fixed_token.position is null")
        if fixed_position is not None and fixed_position in positions:
            raise UserError(f"data.fixed_token.position={fixed_position} is also in data.random_positions")
        if bos and 1 in positions:
            raise UserError("data.bos=true puts BOS at position 1, which data.random_positions also resamples")
        if bos and fixed_position == 1:
            raise UserError("data.bos=true puts BOS at position 1, where data.fixed_token also goes")
        return cls(random_positions=positions, fixed_position=fixed_position, fixed_token_id=fixed_id, bos=bool(bos))

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
