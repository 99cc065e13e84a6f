"""Token store: a tokenised corpus as flat uint16/uint32 memmap shards plus a JSON manifest.

The data module's automatic cache (<cache>/tokens/<corpus>-<fp>/<tokenizer>-<fp>/) and the output of
`sinklab prepare` / scripts/prepare_data.py are the same kind of directory:

    manifest.json           what was built, from which corpus, with which tokenizer, how far
    tokenizer.json          the tokenizer the shards were encoded with
    train/shard_00000.bin   token ids of chunk 0's training documents, each document followed by EOS
    val/shard_00000.bin     token ids of chunk 0's validation documents
    train/shard_00001.bin   ...
    probe.npy               the probe set, int64 (probe_num_seqs, probe_seq_len) (added by the data module)

Chunk k is documents [k*D, (k+1)*D) of the corpus (D = docs_per_shard); it is written as the pair
train/shard_k, val/shard_k (either may be empty). Ids are uint16 when the tokenizer has at most 65536
ids, else uint32. Documents are tokenised with `datasets.Dataset.map(batched=True, num_proc=...)`.

Crash safety: a shard is written to a temporary file, fsynced and renamed (sinklab.io.atomic_write);
only then is the chunk recorded in manifest.json, which is itself replaced atomically. A killed build
therefore leaves only recorded chunks that are complete, and a re-run resumes after the last recorded
chunk, rewriting any later (partial or unrecorded) shard. Shard sizes are checked against the manifest
on every open; a truncated shard is reported (prepared directories) or rebuilt from that chunk on (the
automatic cache).

manifest.json keys: format, dtype, eos_id, docs_per_shard, tokenizer {fingerprint, vocab_size},
corpus {name, fingerprint, source, licence}, chunks [{index, docs, train {file, tokens, sha256}, val
{...}}], tokens {train, val}, exhausted (the corpus ran out), max_train_tokens, complete, command.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from sinklab.io import atomic_write, atomic_write_json, stale_temporaries

from .documents import quiet_datasets
from .errors import DataFileNotFoundError, StoreDamagedError, StoreMismatchError
from .fsutil import atomic_write_text, locked, read_json
from .tokenizer import tokenizer_fingerprint, tokenizer_size

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ----------------------------------------------------------------------------------------------
# Reading


class TokenStore:
    """One split's shards seen as a single flat token array, memory-mapped lazily (never read whole)."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype):
        kept = [(Path(f), int(c)) for f, c in zip(files, counts) if c > 0]  # empty files cannot be mapped
        self.files = [f for f, _ in kept]
        self.counts = [c for _, c in kept]
        self.dtype = np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])  # (num_shards + 1,)
        self._maps: list[np.memmap] | None = None
        self._pid = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self):  # DataLoader workers re-open their own maps
        state = self.__dict__.copy()
        state["_maps"], state["_pid"] = None, None
        return state

    def _shards(self) -> list[np.memmap]:
        if self._maps is None or self._pid != os.getpid():
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r", shape=(c,)) for f, c in zip(self.files, self.counts)]
            self._pid = os.getpid()
        return self._maps

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64 (length,), across shard boundaries if needed."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) out of range for a store of {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        shards, filled = self._shards(), 0
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            lo = start + filled - int(self.starts[i])
            take = min(length - filled, self.counts[i] - lo)
            out[filled:filled + take] = shards[i][lo:lo + take]
            filled += take
            i += 1
        return out


def open_store(root: str | Path, tokenizer_fp: str | None = None) -> tuple[dict, dict[str, TokenStore]]:
    """Open a finished token store; refuse another tokenizer's store, an unfinished or a damaged one."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise DataFileNotFoundError(f"{path} not found: {root} is not a prepared token directory "
                                    f"(build one with `sinklab prepare ... --out {root}`)")
    manifest = read_json(path)
    if manifest.get("format") != FORMAT:
        raise StoreDamagedError(f"{path} has format {manifest.get('format')}, this sinklab reads format {FORMAT}; "
                                f"rebuild it (`sinklab prepare ... --out {root} --overwrite`)")
    if tokenizer_fp is not None and manifest["tokenizer"]["fingerprint"] != tokenizer_fp:
        raise StoreMismatchError(
            f"{path} was built with another tokenizer (fingerprint {manifest['tokenizer']['fingerprint'][:12]}, "
            f"{manifest['tokenizer']['vocab_size']} ids) than this run's ({tokenizer_fp[:12]}); use that directory's "
            f"tokenizer.json (data.tokenizer={root / 'tokenizer.json'}), or rebuild it with this tokenizer: "
            f"`sinklab prepare ... --out {root} --overwrite`")
    if not manifest["complete"]:
        raise StoreDamagedError(f"{root} is not finished ({len(manifest['chunks'])} shards written); re-run the "
                                f"same command to resume it: {manifest.get('command') or 'sinklab prepare ...'}")
    bad = first_damaged_chunk(root, manifest)
    if bad is not None:
        index, file, want, got = bad
        raise StoreDamagedError(f"{root / file} is truncated or damaged ({got} bytes, the manifest says {want}); "
                                f"re-run the prepare command (it redoes damaged shards): "
                                f"{manifest.get('command') or f'sinklab prepare ... --out {root}'}")
    dtype = np.dtype(manifest["dtype"])
    stores = {split: TokenStore([root / c[split]["file"] for c in manifest["chunks"]],
                                [c[split]["tokens"] for c in manifest["chunks"]], dtype) for split in SPLITS}
    return manifest, stores


def first_damaged_chunk(root: Path, manifest: dict) -> tuple[int, str, int, int] | None:
    """(chunk index, file, expected bytes, actual bytes) of the first shard whose size is wrong."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for chunk in manifest["chunks"]:
        for split in SPLITS:
            entry = chunk[split]
            path = root / entry["file"]
            want = entry["tokens"] * itemsize
            got = path.stat().st_size if path.is_file() else -1
            if got != want:
                return chunk["index"], entry["file"], want, got
    return None


# ----------------------------------------------------------------------------------------------
# Building


def _encode_batch(batch: dict, tokenizer: Tokenizer, eos_id: int) -> dict:
    encodings = tokenizer.encode_batch(batch["text"])
    return {"ids": [np.asarray(e.ids + [eos_id], dtype=np.uint32) for e in encodings]}


def encode_chunk(docs: datasets.Dataset, tokenizer: Tokenizer, eos_id: int, dtype: np.dtype,
                 num_proc: int = 1, key: str = "") -> dict[str, np.ndarray]:
    """Token ids of each split of a chunk of documents: each document's ids followed by EOS, in order."""
    import datasets

    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("uint32")),
                                  "split": datasets.Value("string")})
    num_proc = max(1, min(num_proc, len(docs)))
    env = os.environ.get("TOKENIZERS_PARALLELISM")
    if num_proc > 1:  # worker processes each run one tokenizer thread
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with quiet_datasets():
            encoded = docs.map(_encode_batch, batched=True, batch_size=256, features=features, keep_in_memory=True,
                               num_proc=num_proc if num_proc > 1 else None, remove_columns=["text"],
                               fn_kwargs={"tokenizer": tokenizer, "eos_id": eos_id},
                               new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16])
    finally:
        if num_proc > 1:
            if env is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = env
    table = encoded.with_format("arrow")[:]
    out = {}
    for split in SPLITS:
        rows = table.filter(pc.equal(table["split"], split))
        out[split] = pc.list_flatten(rows["ids"]).to_numpy().astype(dtype)  # (tokens,)
    return out


def _write_shard(path: Path, tokens: np.ndarray) -> str:
    """Write a shard atomically (sinklab.io.atomic_write); returns its sha256."""
    data = tokens.tobytes()
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def _new_manifest(corpus, tokenizer: Tokenizer, eos_id: int, docs_per_shard: int, command: str | None) -> dict:
    vocab = tokenizer_size(tokenizer)
    return {
        "format": FORMAT,
        "dtype": dtype_for(vocab).name,
        "eos_id": eos_id,
        "docs_per_shard": docs_per_shard,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": vocab},
        "corpus": {"name": corpus.name, "fingerprint": corpus.fingerprint, "source": corpus.source,
                   "licence": corpus.licence},
        "chunks": [],
        "tokens": {"train": 0, "val": 0},
        "exhausted": False,
        "max_train_tokens": None,
        "complete": False,
        "command": command,
    }


def _is_done(manifest: dict, max_train_tokens: int | None) -> bool:
    return manifest["exhausted"] or (max_train_tokens is not None and manifest["tokens"]["train"] >= max_train_tokens)


def _mismatch(manifest: dict, fresh: dict) -> str | None:
    """Why an existing store cannot be resumed by this build, or None."""
    if manifest.get("format") != FORMAT:
        return f"it has format {manifest.get('format')}, not {FORMAT}"
    old, new = manifest["tokenizer"], fresh["tokenizer"]
    if old["fingerprint"] != new["fingerprint"]:
        return (f"it was built with another tokenizer (fingerprint {old['fingerprint'][:12]}, {old['vocab_size']} ids; "
                f"this one: {new['fingerprint'][:12]}, {new['vocab_size']} ids)")
    if manifest["corpus"]["fingerprint"] != fresh["corpus"]["fingerprint"]:
        return f"it was built from another corpus ({manifest['corpus']['source']})"
    return None


def _drop_damaged_chunks(root: Path, manifest: dict) -> None:
    """Forget the first chunk whose shards do not match the manifest, and every chunk after it."""
    bad = first_damaged_chunk(root, manifest)
    if bad is None:
        return
    index, file, want, got = bad
    log.warning("%s is truncated or missing (%d bytes, the manifest says %d); redoing shards %d and on",
                root / file, got, want, index)
    manifest["chunks"] = manifest["chunks"][:index]
    manifest["exhausted"] = manifest["complete"] = False
    for split in SPLITS:
        manifest["tokens"][split] = sum(c[split]["tokens"] for c in manifest["chunks"])


def build_store(corpus, tokenizer: Tokenizer, root: str | Path, *, eos_id: int, docs_per_shard: int = 50_000,
                num_proc: int = 1, max_train_tokens: int | None = None, overwrite: bool = False,
                rebuild: bool = False, progress: bool = True, command: str | None = None) -> dict:
    """Tokenise `corpus` into the store at `root`, resuming a previous build; returns the manifest.

    Idempotent: a finished store for the same corpus and tokenizer is left as it is. A store built
    from another tokenizer or corpus is refused unless `overwrite`; `rebuild` starts afresh in any
    case. Stops after the chunk that brings
    the training split to `max_train_tokens` (None: the whole corpus); a later call with a larger
    limit continues where this one stopped.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / MANIFEST
    with locked(path):
        fresh = _new_manifest(corpus, tokenizer, eos_id, docs_per_shard, command)
        manifest = read_json(path) if path.is_file() else None
        why = _mismatch(manifest, fresh) if manifest is not None else None
        if manifest is not None and rebuild:
            why, overwrite = "rebuild asked for", True
        if why and not overwrite:
            raise StoreMismatchError(f"{path}: {why}. Rebuild it with --overwrite (data.rebuild_cache=true), "
                                     f"delete {root}, or choose another output directory")
        if why:
            log.warning("%s: %s; overwriting it", path, why)
            for split in SPLITS:
                shutil.rmtree(root / split, ignore_errors=True)
            (root / "probe.npy").unlink(missing_ok=True)
            manifest = None
        if manifest is None:
            manifest = fresh
        elif manifest["chunks"] and manifest["docs_per_shard"] != docs_per_shard:
            log.warning("%s was started with docs_per_shard=%d; keeping it (asked for %d)", root,
                        manifest["docs_per_shard"], docs_per_shard)
        else:
            manifest["docs_per_shard"] = docs_per_shard
        docs_per_shard = manifest["docs_per_shard"]
        manifest["command"] = command or manifest["command"]
        if manifest is fresh or not (root / "tokenizer.json").is_file():
            atomic_write_text(root / "tokenizer.json", tokenizer.to_str())
        _drop_damaged_chunks(root, manifest)
        if _is_done(manifest, max_train_tokens):
            if not manifest["complete"] or manifest["max_train_tokens"] != max_train_tokens:
                manifest["complete"], manifest["max_train_tokens"] = True, max_train_tokens
                atomic_write_json(path, manifest)
            return manifest

        start = len(manifest["chunks"])
        for split in SPLITS:  # left by a killed build, redone below: partial shards' temporaries, unrecorded shards
            for partial in stale_temporaries(root / split / "shard_*.bin"):  # the temporaries of every shard_*.bin
                partial.unlink()
            for shard in (root / split).glob("shard_*.bin"):
                if int(shard.name[6:11]) >= start:
                    shard.unlink()
        manifest["complete"], manifest["max_train_tokens"] = False, max_train_tokens
        atomic_write_json(path, manifest)
        dtype = np.dtype(manifest["dtype"])
        n_docs = corpus.num_documents
        bar = tqdm(total=None if n_docs is None else -(-n_docs // docs_per_shard), initial=start, unit="shard",
                   desc=f"tokenising {corpus.name}", disable=not progress)
        exhausted = True
        for k, docs in enumerate(corpus.chunks(start, docs_per_shard), start=start):
            key = f"{corpus.fingerprint}:{manifest['tokenizer']['fingerprint']}:{k}"
            ids = encode_chunk(docs, tokenizer, eos_id, dtype, num_proc, key=key)
            entry = {"index": k, "docs": len(docs)}
            for split in SPLITS:
                file = f"{split}/shard_{k:05d}.bin"
                sha = _write_shard(root / file, ids[split])
                entry[split] = {"file": file, "tokens": int(len(ids[split])), "sha256": sha}
            manifest["chunks"].append(entry)  # recorded only once both shards are complete on disk
            for split in SPLITS:
                manifest["tokens"][split] += entry[split]["tokens"]
            atomic_write_json(path, manifest)
            bar.update(1)
            bar.set_postfix(train_tokens=manifest["tokens"]["train"], val_tokens=manifest["tokens"]["val"])
            if len(docs) < docs_per_shard:
                break
            if max_train_tokens is not None and manifest["tokens"]["train"] >= max_train_tokens:
                exhausted = False
                break
        bar.close()
        manifest["exhausted"], manifest["complete"] = exhausted, True
        atomic_write_json(path, manifest)
    return manifest
