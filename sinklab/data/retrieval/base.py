"""The retrieval tasks' shared part: the registry (`TASKS`), `RetrievalConfig` (data.retrieval), the `RetrievalTask`
base class, samples and fillers, and building a data config's task (the package's docstring says what the tasks
are)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from sinklab.config.schema import Schema, integer, not_allowed, number, rule, show
from sinklab.registries import NameRegistry

from ..errors import UserError

VAL_SEED = 0           # the held-out retrieval samples: the same for every run of a task on the same data
MIX_STREAM = 0x52455452  # tags the generator of training sample i's mixing (["RETR"]), apart from its block's
DIGITS = tuple("0123456789")


class Sample(NamedTuple):
    tokens: np.ndarray  # int64 (L,)
    answer: np.ndarray  # bool (L,): answer[i] is predicted from tokens[:i]
    ask: int            # index of the first token of the question


class Filler(Protocol):
    """Where filler tokens are read from: a TokenStore (sinklab/data/token_store.py) or `TokenRun`."""

    def __len__(self) -> int: ...

    def read(self, start: int, n: int) -> np.ndarray: ...


class TokenRun:
    """The first `limit` tokens (all with None) of an int array or a token store, as a Filler."""

    def __init__(self, source: Union[np.ndarray, Filler], limit: Optional[int] = None):
        self.source = np.asarray(source, dtype=np.int64) if isinstance(source, (np.ndarray, list, tuple)) else source
        self.limit = len(self.source) if limit is None else min(int(limit), len(self.source))

    def __len__(self) -> int:
        return self.limit

    def read(self, start: int, n: int) -> np.ndarray:
        if isinstance(self.source, np.ndarray):
            return self.source[start:start + n].copy()
        return np.asarray(self.source.read(start, n), dtype=np.int64)


class TaskRegistry(NameRegistry[type]):
    """name -> retrieval task class (data.retrieval.task), in registration order."""

    what = "data.retrieval.task"
    unknown = UserError


TASKS: TaskRegistry = TaskRegistry()


def _task_name(v: Any) -> Optional[str]:
    return None if v is None or v in TASKS else "null or one of " + ", ".join(TASKS.names())


@dataclass
class RetrievalConfig(Schema):
    """data.retrieval: the task mixed into training blocks at `rate` and validated apart (null task: off). The knobs
    of one task are ignored by the other."""

    KEY = "data.retrieval"
    task: Optional[str] = rule(None, _task_name)              # passkey | passkey_text | mqar | null (off)
    rate: float = rule(0.0, number(ge=0, le=1))               # share of training blocks replaced by a sample
    val_num_samples: int = rule(64, integer(1))               # held-out samples validated (val/retrieval/*)
    key_len: int = rule(4, integer(1))                        # passkey: digits of the key
    depth: Optional[float] = rule(None, number(ge=0, le=1, optional=True))  # passkey: KEY's place; null: uniform
    query_at: Optional[float] = rule(1.0, number(ge=0, le=1, optional=True))  # passkey: QUERY's place; null: uniform
    n_pairs: int = rule(8, integer(1))                        # mqar: key-value pairs (every key asked once)
    power_a: float = rule(0.01, number(gt=0))                 # mqar: query gaps p(i) ~ i^(power_a - 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task is None and self.rate > 0:
            raise UserError(f"data.retrieval.rate={show(self.rate)} needs data.retrieval.task: one of "
                            f"{', '.join(TASKS.names())}")

    def check_length(self, length: int, bos: bool) -> None:
        """A one-line error when the task's sample does not fit `length` tokens (a block: block_size + 1)."""
        if self.task is not None:
            message = TASKS.get(self.task).too_long(self, length, bos)
            if message:
                raise UserError(message)


def mix_rng(seed: int, index: int) -> np.random.Generator:
    """The generator that decides whether training sample `index` is a retrieval sample, and makes it."""
    return np.random.default_rng([seed, index, MIX_STREAM])


def digit_ids(tokenizer, where: str) -> tuple[int, ...]:
    """The ids of the tokenizer's single-character tokens "0".."9"; one line naming the tokenizer without them."""
    ids = [tokenizer.token_to_id(d) for d in DIGITS]
    missing = [d for d, i in zip(DIGITS, ids) if i is None]
    if missing:
        raise UserError(f"data.retrieval.task=passkey needs the single-character tokens '0'..'9' in the tokenizer, "
                        f"{where} has no {', '.join(repr(d) for d in missing)}; use a byte-level BPE "
                        f"(data.tokenizer=bpe) or data.retrieval.task=mqar")
    return tuple(int(i) for i in ids)


class RetrievalTask:
    """A retrieval task on a vocabulary: ordinary ids [0, vocab), `bos_id` first in every sample (the data's BOS,
    None without one), `reserved` ids never drawn (the document separator). Knobs: the class's KNOBS, with
    RetrievalConfig's defaults and rules."""

    name: ClassVar[str] = ""
    KNOBS: ClassVar[tuple[str, ...]] = ()
    EXTRA_IDS: ClassVar[int] = 0  # dedicated new ids after the vocabulary

    def __init__(self, vocab: int, bos_id: Optional[int] = None, reserved: Sequence[int] = (), **knobs: Any):
        unknown = sorted(set(knobs) - set(self.KNOBS))
        if unknown:
            raise UserError(f"data.retrieval.task={self.name} has no knob(s) {unknown}; its knobs: "
                            f"{', '.join(self.KNOBS)}")
        config = RetrievalConfig(task=self.name, **knobs)  # defaults and one-line checks
        self.knobs = {k: getattr(config, k) for k in self.KNOBS}
        for k, v in self.knobs.items():
            setattr(self, k, v)
        self.vocab, self.bos_id = int(vocab), bos_id
        self.reserved = tuple(int(r) for r in reserved) + ((int(bos_id),) if bos_id is not None else ())
        self.ordinary = np.setdiff1d(np.arange(self.vocab, dtype=np.int64), self.reserved)  # random filler's ids

    # --- what a task defines
    @classmethod
    def too_long(cls, config: RetrievalConfig, length: int, bos: bool) -> Optional[str]:
        """The one-line refusal when a sample of `length` tokens cannot hold the task with these knobs, else None."""
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, length: int, filler: Optional[Filler]) -> Sample:
        raise NotImplementedError

    def chance(self) -> float:
        """The accuracy of guessing: one answer span right by chance."""
        raise NotImplementedError

    @classmethod
    def for_data(cls, config: RetrievalConfig, tokenizer, where: str, vocab: int, eos_id: int,
                 bos_id: Optional[int], new_id: int) -> "RetrievalTask":
        """The task of a data config: the tokenizer's `vocab` ids, its separator `eos_id` reserved, `new_id` the first
        id free for dedicated tokens."""
        return cls(vocab, bos_id, (eos_id,), **{k: getattr(config, k) for k in cls.KNOBS})

    # --- shared
    @property
    def n_ids(self) -> int:
        """Ids the task writes: its vocabulary and its dedicated ids."""
        return self.vocab + self.EXTRA_IDS

    def check(self, length: int) -> None:
        config = RetrievalConfig(task=self.name, **self.knobs)
        config.check_length(length, self.bos_id is not None)

    def body(self, length: int) -> int:
        """Tokens after the BOS."""
        return length - (self.bos_id is not None)

    def filler(self, rng: np.random.Generator, n: int, source: Optional[Filler]) -> np.ndarray:
        """n filler tokens: a contiguous run of `source` at a random offset, or uniform random ordinary ids."""
        if source is None:
            return rng.choice(self.ordinary, size=n)
        if len(source) < n:
            raise UserError(f"data.retrieval.task={self.name}: the filler has {len(source)} tokens, fewer than the "
                            f"{n} a sample needs")
        return TokenRun(source).read(int(rng.integers(len(source) - n + 1)), n)

    def finish(self, body: np.ndarray, answer: np.ndarray, ask: int) -> Sample:
        """Prepend the BOS (when the data has one) to a sample's body."""
        if self.bos_id is None:
            return Sample(body.astype(np.int64), answer, int(ask))
        return Sample(np.concatenate([[self.bos_id], body]).astype(np.int64), np.concatenate([[False], answer]),
                      int(ask) + 1)

    def describe(self) -> dict:
        return {"task": self.name, **self.knobs, "chance": self.chance()}


def build_task(task: str, **kwargs: Any) -> RetrievalTask:
    """The task `task` (a name of TASKS) built with its vocabulary arguments and knobs (`Passkey(vocab, digit_ids,
    ...)`, `MQAR(vocab, ...)`)."""
    return TASKS.get(task)(**kwargs)


def make_samples(task: Union[str, RetrievalTask], n: int, length: int, seed: int,
                 filler: Union[np.ndarray, Filler, None] = None, **knobs: Any) -> list[Sample]:
    """`n` samples of `length` tokens of `task` (a RetrievalTask, or a name built with `build_task(task, **knobs)`,
    knobs then holding its vocabulary arguments too). Sample i is made by `default_rng([seed, i])` from `filler`
    (corpus tokens; None: random ordinary ids): the same for the same arguments, and the first m of n samples are
    those of n = m."""
    if isinstance(task, str):
        task = build_task(task, **knobs)
    elif knobs:
        raise UserError(f"make_samples: knobs {sorted(knobs)} are given with a built task; build it with them")
    task.check(length)
    source = None if filler is None else TokenRun(filler) if isinstance(filler, (np.ndarray, list, tuple)) else filler
    return [task.sample(np.random.default_rng([seed, i]), length, source) for i in range(n)]


def task_for_data(config: Optional[RetrievalConfig], tokenizer, where: str, vocab: int, eos_id: int,
                  bos_id: Optional[int], new_id: int) -> Optional[RetrievalTask]:
    """The task data.retrieval asks for on this data (None when off): see RetrievalTask.for_data."""
    if config is None or config.task is None:
        return None
    return TASKS.get(config.task).for_data(config, tokenizer, where, vocab, eos_id, bos_id, new_id)
