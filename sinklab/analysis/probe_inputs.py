"""What a measurement (`sinklab measure`, `sinklab trajectory`) runs on: random or repeated token ids, a .npy file of
ids, or natural text (a run's own probe set, or text through a transformers model's tokenizer: `Target.natural_tokens`),
named by an `InputSpec`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from sinklab.errors import UserError
from sinklab.targets.interface import DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, no_natural_input

INPUTS = ("natural", "random", "repeat")


def make_tokens(kind: str, num_seqs: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """random: uniform ids in [0, vocab); repeat: one uniform id per sequence repeated seq_len times. (N, T) long."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(0, vocab_size, (num_seqs, seq_len), generator=g)
    if kind == "repeat":
        return torch.randint(0, vocab_size, (num_seqs, 1), generator=g).expand(num_seqs, seq_len).contiguous()
    raise ValueError(f"unknown input kind {kind!r}")


def load_tokens(path: str, vocab_size: int, flat: bool = False) -> torch.Tensor:
    """An integer .npy of shape (N, T) with ids in [0, vocab_size) -> LongTensor; one-line errors otherwise. flat: one
    text of shape (N,) instead (N >= 2: a token and the next one to predict)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--tokens {path}: no such file")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as err:
        raise UserError(f"--tokens {path}: not a readable .npy file ({type(err).__name__})") from None
    if not isinstance(arr, np.ndarray):
        raise UserError(f"--tokens {path}: holds an archive, not one array; save one (N, T) array with np.save")
    if arr.dtype.kind not in "iu":
        raise UserError(f"--tokens {path}: dtype {arr.dtype} is not an integer type; save token ids as int64")
    if flat and (arr.ndim != 1 or arr.shape[0] < 2):
        raise UserError(f"--tokens {path}: shape {tuple(arr.shape)} is not one text (N,) with N >= 2 tokens")
    if not flat and (arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1):
        raise UserError(f"--tokens {path}: shape {tuple(arr.shape)} is not (N, T) with N, T >= 1")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise UserError(f"--tokens {path}: token ids span [{lo}, {hi}], the model's vocabulary is "
                        f"[0, {vocab_size - 1}]")
    return torch.from_numpy(arr.astype(np.int64))


def positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} {value} must be a positive integer")


@dataclass(frozen=True)
class InputSpec:
    """What to measure on: `kind` natural | random | repeat (None: the model's own probe set where it has one),
    `tokens_file` exactly the sequences of an integer .npy (N, T), `seq_len` T and `num_seqs` N (None: the defaults,
    DEFAULT_SEQ_LEN within the model context and DEFAULT_NUM_SEQS), `seed` of the random / repeat ids, `texts`
    the text files a transformers model reads through its tokenizer for natural input."""

    kind: Optional[str] = None
    tokens_file: Optional[str] = None
    seq_len: Optional[int] = None
    num_seqs: Optional[int] = None
    seed: int = 0
    texts: Optional[tuple[str, ...]] = None
    past_context: bool = False  # --seq-len may exceed the model context (Target.past_context lets the forward run)

    def check(self) -> None:
        """--seq-len and --num-seqs positive, the kind known; one-line errors."""
        for name, value in (("--seq-len", self.seq_len), ("--num-seqs", self.num_seqs)):
            positive(name, value)
        if self.kind is not None and self.kind not in INPUTS:
            raise UserError(f"--input {self.kind}: allowed: {', '.join(INPUTS)}")


def check_thresholds(eps: Sequence[float], k: int) -> None:
    """Every --eps a finite threshold >= 0, --k >= 1; one-line errors."""
    for e in eps:
        if not math.isfinite(e) or e < 0:
            raise UserError(f"--eps {e:g} must be a finite threshold >= 0")
    if k < 1:
        raise UserError(f"--k {k} must be a positive integer")


def choose_tokens(spec: InputSpec, target) -> tuple[torch.Tensor, str, Optional[str]]:
    """The (N, T) token ids to measure `target` (a `sinklab.targets.Target`) on, the input's name, and where
    natural text came from (None for other inputs)."""
    vocab_size, context = target.meta.vocab_size, target.meta.context
    if spec.past_context:
        if spec.tokens_file is None and (spec.seq_len is None or context is None or spec.seq_len <= context):
            raise UserError(f"--past-context needs --seq-len above the model context {context} (got "
                            f"{spec.seq_len}) or --tokens; without it, measure within the context")
        context = None  # no length check below: Target.past_context decides whether the model can
    if spec.tokens_file is not None:
        for flag, value in (("--seq-len", spec.seq_len), ("--num-seqs", spec.num_seqs)):
            if value is not None:
                raise UserError(f"{flag} does not apply with --tokens (the file's shape (N, T) is measured as is)")
        tokens = load_tokens(spec.tokens_file, vocab_size)
        if context is not None and tokens.shape[1] > context:
            raise UserError(f"--tokens {spec.tokens_file}: sequence length {tokens.shape[1]} exceeds the model context "
                            f"{context}")
        return tokens, "tokens", None
    kind = spec.kind
    if kind is None:
        missing = target.no_probe_set()
        if missing is not None:
            raise no_natural_input(None, missing)
        kind = "natural"
    if context is not None and spec.seq_len is not None and spec.seq_len > context:
        raise UserError(f"--seq-len {spec.seq_len} exceeds the model context {context}; allowed: up to {context}, or "
                        "--past-context (a length-extrapolation measurement)")
    if kind == "natural":
        tokens, where = target.natural_tokens(spec.num_seqs, spec.seq_len, spec.texts)
        if context is not None and tokens.shape[1] > context:
            raise UserError(f"--seq-len {tokens.shape[1]} (the probe set's) exceeds the model context {context}")
        if int(tokens.max()) >= vocab_size:
            raise UserError(f"--input natural: the probe set has token id {int(tokens.max())}, the model's "
                            f"vocabulary is [0, {vocab_size - 1}] (was the model trained on this data?)")
        return tokens, kind, where
    seq_len = spec.seq_len if spec.seq_len is not None else \
        (min(DEFAULT_SEQ_LEN, context) if context is not None else DEFAULT_SEQ_LEN)
    num_seqs = spec.num_seqs if spec.num_seqs is not None else DEFAULT_NUM_SEQS
    return make_tokens(kind, num_seqs, seq_len, vocab_size, spec.seed), kind, None
