"""passkey and mqar (the package's docstring says how their samples are made)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from sinklab.config.schema import not_allowed

from ..errors import UserError
from .base import TASKS, Filler, RetrievalConfig, RetrievalTask, Sample, digit_ids


@TASKS.register("passkey")
class Passkey(RetrievalTask):
    """[BOS] filler KEY d1..dk filler QUERY d1..dk [filler]: the key's digits after QUERY are the answer."""

    KNOBS = ("key_len", "depth", "query_at")
    EXTRA_IDS = 2
    key_len: int
    depth: Optional[float]
    query_at: Optional[float]

    def __init__(self, vocab: int, digit_ids: Sequence[int], bos_id: Optional[int] = None, reserved: Sequence[int] = (),
                 marker_id: Optional[int] = None, **knobs: Any):
        super().__init__(vocab, bos_id, reserved, **knobs)
        if len(digit_ids) != 10:
            raise UserError(f"passkey needs 10 digit ids ('0'..'9'), got {len(digit_ids)}")
        self.digit_ids = np.asarray(digit_ids, dtype=np.int64)
        self.key_id = self.vocab if marker_id is None else int(marker_id)  # KEY marker; QUERY is the next id
        self.query_id = self.key_id + 1
        # what stands before the key, after it and before the answer (passkey_text: sentences instead of markers)
        self.key_text = np.asarray([self.key_id], dtype=np.int64)
        self.after_key = np.zeros(0, dtype=np.int64)
        self.query_text = np.asarray([self.query_id], dtype=np.int64)

    @property
    def n_ids(self) -> int:
        return self.query_id + 1

    @classmethod
    def for_data(cls, config, tokenizer, where, vocab, eos_id, bos_id, new_id) -> "Passkey":
        return cls(vocab, digit_ids(tokenizer, where), bos_id, (eos_id,), marker_id=new_id,
                   **{k: getattr(config, k) for k in cls.KNOBS})

    @classmethod
    def too_long(cls, config: RetrievalConfig, length: int, bos: bool) -> Optional[str]:
        need = int(bos) + 2 + 2 * config.key_len
        if need <= length:
            return None
        return not_allowed("data.retrieval.key_len", config.key_len,
                           f"an integer <= {(length - int(bos) - 2) // 2}",
                           f"(a passkey sample is {'BOS + ' if bos else ''}2 markers + the key twice = {need} tokens, "
                           f"more than a block's {length}: block_size + 1)")

    def sample(self, rng: np.random.Generator, length: int, filler: Optional[Filler]) -> Sample:
        k = self.key_len
        fixed = len(self.key_text) + len(self.after_key) + len(self.query_text) + 2 * k  # passkey: 2 + 2k
        n_fill = self.body(length) - fixed
        if n_fill < 0:
            self.check(length)
            raise UserError(f"data.retrieval.task={self.name}: a sample of {length} tokens cannot hold its {fixed} "
                            "tokens besides the filler; allowed: a longer sample or a shorter key_len")
        key = self.digit_ids[rng.integers(0, 10, size=k)]  # (k,)
        depth = rng.random() if self.depth is None else self.depth
        # (drawn after depth, and only when null: a sample with query_at=1 is the sample made before this knob)
        query_at = rng.random() if self.query_at is None else self.query_at
        before = int(np.floor(query_at * n_fill + 0.5))  # filler tokens before QUERY
        at = int(np.floor(depth * before + 0.5))  # KEY's place among them
        text = self.filler(rng, n_fill, filler)
        head = np.concatenate([text[:at], self.key_text, key, self.after_key, text[at:before]])
        body = np.concatenate([head, self.query_text, key, text[before:]])
        ask = len(head)  # QUERY's index (the question's first token)
        answer = np.zeros(len(body), dtype=bool)
        start = ask + len(self.query_text)
        answer[start:start + k] = True
        return self.finish(body, answer, ask)

    def chance(self) -> float:
        return 10.0 ** -self.key_len

    def describe(self) -> dict:
        return {**super().describe(), "key_id": self.key_id, "query_id": self.query_id}


@TASKS.register("mqar")
class MQAR(RetrievalTask):
    """[BOS] k1 v1 .. kn vn, then each key again (in slots drawn from a power law) followed by its value."""

    KNOBS = ("n_pairs", "power_a")
    n_pairs: int
    power_a: float

    def __init__(self, vocab: int, bos_id: Optional[int] = None, reserved: Sequence[int] = (), **knobs: Any):
        super().__init__(vocab, bos_id, reserved, **knobs)
        half = self.vocab // 2
        self.key_ids = np.setdiff1d(np.arange(half, dtype=np.int64), self.reserved)             # [0, V/2)
        self.value_ids = np.setdiff1d(np.arange(half, self.vocab, dtype=np.int64), self.reserved)  # [V/2, V)
        if min(len(self.key_ids), len(self.value_ids)) < self.n_pairs:
            raise UserError(f"data.retrieval.n_pairs={self.n_pairs} needs that many distinct keys and values; the "
                            f"vocabulary of {self.vocab} ids has {len(self.key_ids)} keys and "
                            f"{len(self.value_ids)} values")

    @classmethod
    def too_long(cls, config: RetrievalConfig, length: int, bos: bool) -> Optional[str]:
        body = length - int(bos)
        if 4 * config.n_pairs <= body:
            return None
        return not_allowed("data.retrieval.n_pairs", config.n_pairs, f"an integer <= {body // 4}",
                           f"(mqar needs 4 x n_pairs tokens, the pairs then a query slot per pair in the rest as "
                           f"in Zoology; a block has {body}: block_size + 1{' - BOS' if bos else ''})")

    def gap_probabilities(self, length: int) -> np.ndarray:
        """p(slot i) ~ (i + 1)^(power_a - 1) over the query region's (body - 2 n) // 2 slots (Zoology's)."""
        space = (self.body(length) - 2 * self.n_pairs) // 2
        p = self.power_a * np.arange(1, space + 1, dtype=np.float64) ** (self.power_a - 1)
        return p / p.sum()

    def sample(self, rng: np.random.Generator, length: int, filler: Optional[Filler]) -> Sample:
        n, k = self.body(length), self.n_pairs
        if 4 * k > n:
            self.check(length)
        keys = rng.choice(self.key_ids, size=k, replace=False)      # (k,)
        values = rng.choice(self.value_ids, size=k, replace=False)  # (k,)
        p = self.gap_probabilities(length)
        slots = rng.choice(len(p), size=k, replace=False, p=p)      # (k,) query slot of pair j
        body = np.full(n, -1, dtype=np.int64)
        body[0:2 * k:2], body[1:2 * k:2] = keys, values
        query = 2 * k + 2 * slots  # (k,) position of key j's query
        body[query], body[query + 1] = keys, values
        free = body < 0
        body[free] = self.filler(rng, int(free.sum()), filler)
        answer = np.zeros(n, dtype=bool)
        answer[query + 1] = True
        return self.finish(body, answer, int(query.min()))

    def chance(self) -> float:
        return 1.0 / len(self.value_ids)
