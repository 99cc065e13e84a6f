"""Tokenizers: a byte-level BPE trained on the corpus, or any `tokenizer.json` / hub tokenizer.

data.tokenizer:
  bpe        train a byte-level BPE of `data.vocab_size` tokens (with `<|endoftext|>` as id 0) on the
             *training* split only, cached as <cache>/tokenizers/bpe<V>-<key>/tokenizer.json where the
             key is (corpus fingerprint, vocab size); later runs on the same data reuse it.
  <path>     a tokenizer.json, or a directory holding one (e.g. a saved GPT-NeoX tokenizer).
  <hub id>   e.g. `EleutherAI/gpt-neox-20b`, through `tokenizers.Tokenizer.from_pretrained` (needs the
             network or the Hugging Face cache).
Every loaded tokenizer is checked to be non-empty: offline loaders can return an empty tokenizer
without an error. The model's embedding size is `padded_vocab_size`: the tokenizer's size (+1 for a
dedicated fixed token) rounded up to `data.pad_vocab_to_multiple_of` (GPT-NeoX's 50277 -> 50304 with
128, 50432 with 256 as in the reference).
`text_bytes` counts the UTF-8 bytes of the text token ids decode to (bits per byte divide by it).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import warnings
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .errors import DataFileNotFoundError, UserError
from .fsutil import atomic_write_text, hash_strings, locked

log = logging.getLogger(__name__)

BPE = "bpe"
EOS_TOKEN = "<|endoftext|>"
BPE_TRAIN_MAX_CHARS = 200_000_000  # BPE statistics from at most this much training text
MIN_BPE_VOCAB = 257 + 1            # 256 byte symbols + the end-of-text token + at least one merge


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """A GPT-2 style byte-level BPE with `eos_token` as id 0."""
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE (need >= {MIN_BPE_VOCAB})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (max id + 1, special tokens included)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def decode_each(tok, ids: Sequence[int]) -> list[str]:
    """Each id decoded alone, special tokens included (`<|endoftext|>` as BOS): what a label shows of a token. `tok`
    is a `tokenizers.Tokenizer` or a transformers tokenizer (both decode with skip_special_tokens); None (data
    without a tokenizer: the synthetic tasks) gives the ids themselves."""
    if tok is None:
        return [str(int(i)) for i in ids]
    return [tok.decode([int(i)], skip_special_tokens=False) for i in ids]


def check_tokenizer(tok: Tokenizer, where: str) -> Tokenizer:
    """Refuse empty tokenizers (what offline `from_pretrained` loaders may silently return)."""
    n = tokenizer_size(tok)
    if n == 0 or not tok.encode("The quick brown fox.").ids:
        raise UserError(f"tokenizer {where} is empty (vocab size {n}); offline loaders can return an empty "
                        f"tokenizer: point data.tokenizer at a real tokenizer.json")
    return tok


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: two tokenizers with equal fingerprints encode alike."""
    canonical = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def eos_token_id(tok: Tokenizer, eos_token: str, where: str) -> int:
    """Id of the document separator; an error naming the tokenizer if it has none."""
    idx = tok.token_to_id(eos_token)
    if idx is None:
        raise UserError(f"tokenizer {where} has no token {eos_token!r}; set data.eos_token to its "
                        f"end-of-text / separator token (e.g. '</s>')")
    return idx


def byte_symbols() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode, tokenizers' ByteLevel): the character that stands for each
    byte in a byte-level token. Printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    symbols, shifted = {}, 0
    for b in range(256):
        if b in printable:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + shifted)] = b
            shifted += 1
    return symbols


def token_bytes(tok: Tokenizer) -> list[bytes]:
    """A byte-level tokenizer's bytes of every id, as its ByteLevel decoder joins them before it makes text of them:
    a token made of byte symbols stands for those bytes, any other (an added token) for its own UTF-8; a special
    token (a BOS or document separator) for none, as `decode` skips it."""
    symbols = byte_symbols()
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    table = [b""] * tokenizer_size(tok)
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i not in special:
            table[i] = bytes(symbols[c] for c in token) if all(c in symbols for c in token) else token.encode()
    return table


def utf8_error(data: bytes) -> Optional[int]:
    """The offset of the first byte of `data` that is not UTF-8, None if there is none: `data` is a window of a
    longer text, so a character cut at either end (up to 3 continuation bytes first, an unfinished one last) is not
    an error."""
    start = 0
    while start < min(3, len(data)) and 0x80 <= data[start] < 0xC0:
        start += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data[start:], final=False)
    except UnicodeDecodeError as err:
        return start + err.start
    return None


def text_bytes(tok: Tokenizer, rows: Sequence[Sequence[int]], where: str, what: str) -> list[int]:
    """The UTF-8 bytes of the text each row of token ids decodes to, as `tok.decode(row)` decodes it: special tokens
    (a BOS, the document separator) decode to no text. `where` names the tokenizer and `what` the rows in the error.

    A byte-level tokenizer (a ByteLevel decoder: sinklab's BPE, GPT-2's, GPT-NeoX's) is counted in the bytes its
    tokens stand for (`token_bytes`), which its decoder turns into text: a row is a window of a longer text, and a
    character cut at its edge counts the bytes of the row's part of it, where decoding would put a U+FFFD (3 bytes).
    Inside a row those bytes must be UTF-8, else one line naming the tokenizer: its tokens do not decode to the
    text they encode (e.g. a ByteLevel decoder over tokens that are not byte-level symbols). Any other tokenizer
    decodes to text (UTF-8 by construction), whose bytes are counted."""
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return [len(text.encode("utf-8")) for text in tok.decode_batch([list(r) for r in rows])]
    table, counts = token_bytes(tok), []
    for n, row in enumerate(rows):
        data = b"".join(table[i] for i in row)
        bad = utf8_error(data)
        if bad is not None:
            raise UserError(f"bits per byte: the tokenizer {where} decodes {what} to invalid UTF-8 (byte "
                            f"0x{data[bad]:02x} at offset {bad} of row {n}): its tokens do not decode to the text "
                            "they encode; use a tokenizer whose decoder matches its tokens (a byte-level BPE with a "
                            "ByteLevel decoder, or data.tokenizer=bpe)")
        counts.append(len(data))
    return counts


def padded_vocab_size(n: int, multiple: int | None) -> int:
    """Round n up to a multiple (for matmul-friendly embedding sizes)."""
    if not multiple or multiple <= 1:
        return n
    return -(-n // multiple) * multiple


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from a tokenizer.json, a directory holding one, or a hub id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataFileNotFoundError(f"data.tokenizer: {path} does not exist")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.endswith(".json")
    if path.is_file():
        try:
            return check_tokenizer(Tokenizer.from_file(str(path)), str(path))
        except Exception as e:
            if isinstance(e, UserError):
                raise
            raise UserError(f"data.tokenizer: {path} is not a valid tokenizer.json ({e})") from e
    if looks_like_path:
        raise DataFileNotFoundError(f"data.tokenizer: {path} does not exist")
    try:
        tok = Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise UserError(f"data.tokenizer: could not load {spec!r} from the Hugging Face hub "
                           f"({type(e).__name__}: {str(e)[:200]}). Offline? Save its tokenizer.json and set "
                           f"data.tokenizer=/path/to/tokenizer.json") from e
    return check_tokenizer(tok, spec)


def resolve_tokenizer(spec: str, *, vocab_size: int, corpus, cache_dir: Path,
                      eos_token: str = EOS_TOKEN) -> Tokenizer:
    """The configured tokenizer; `bpe` trains on `corpus`'s training split once and caches the result."""
    if spec != BPE:
        return load_tokenizer(spec)
    key = hash_strings(corpus.fingerprint, str(vocab_size), eos_token, str(BPE_TRAIN_MAX_CHARS))[:16]
    path = cache_dir / "tokenizers" / f"bpe{vocab_size}-{key}" / "tokenizer.json"
    with locked(path):
        if path.is_file():
            return check_tokenizer(Tokenizer.from_file(str(path)), str(path))
        log.info("training a %d-token byte-level BPE on the training split of %s", vocab_size, corpus.name)
        tok = train_bpe(corpus.train_texts(BPE_TRAIN_MAX_CHARS), vocab_size, eos_token)
        got = tokenizer_size(tok)
        if got < vocab_size:
            warnings.warn(f"the training text only supports {got} BPE tokens, fewer than data.vocab_size={vocab_size}")
        atomic_write_text(path, tok.to_str())
    return check_tokenizer(tok, str(path))
