"""Local files as a corpus (`data.corpus=local`, `data.files=[...]`), read through `datasets`.

.txt/.md: one document per file. .jsonl/.json: one document per record, text in `data.text_field`.
.parquet: one document per row, text in column `data.text_field`. Files are checked before any heavy
work: missing, empty, unsupported type, missing text field, and bytes that are not UTF-8 all raise an
error naming the file. Non-UTF-8 input is refused by default; `data.encoding_errors=replace` decodes it
with U+FFFD replacement characters instead (with a warning). `data.files` also stands in for a hub data set
(`data.corpus=hub`) with the same schema.
"""

from __future__ import annotations

import codecs
import json
import warnings
from pathlib import Path
from typing import Sequence

import pyarrow.parquet as pq

from .config import DataConfig
from .documents import Corpus, quiet_datasets
from .errors import DataFileNotFoundError, UserError
from .fsutil import hash_strings, sha256_file

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)


def file_kind(path: Path) -> str | None:
    """'text', 'json' or 'parquet' (the `datasets` loader of the file), None for an unsupported file."""
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


def _check_utf8(path: Path, encoding_errors: str) -> None:
    bad = _first_invalid_utf8(path)
    if bad is not None and encoding_errors == "strict":
        raise UserError(f"data.files: {path} is not valid UTF-8 (byte 0x{bad[1]:02x} at offset {bad[0]}); "
                        f"fix the file, or set data.encoding_errors=replace to decode it with U+FFFD")
    if bad is not None:
        warnings.warn(f"data.files: {path} is not valid UTF-8 (first bad byte at offset {bad[0]}); "
                      f"invalid bytes become U+FFFD (data.encoding_errors=replace)")


def _check_jsonl(path: Path, text_field: str) -> None:
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


def _check_parquet(path: Path, text_field: str) -> None:
    try:
        meta = pq.read_metadata(path)
    except Exception as e:
        raise UserError(f"data.files: {path} is not a readable parquet file ({e})") from e
    names = meta.schema.to_arrow_schema().names
    if text_field not in names:
        raise UserError(f"data.files: {path} has no column '{text_field}' (found {names}); set data.text_field")
    if meta.num_rows == 0:
        raise UserError(f"data.files: {path} has no rows")


def validate_files(files: Sequence[str], text_field: str, encoding_errors: str) -> list[tuple[Path, str]]:
    """Check every local file before any heavy work; returns [(path, kind)] in the given order."""
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
            _check_utf8(path, encoding_errors)
        if kind == "text" and _only_whitespace(path):
            raise UserError(f"data.files: {path} contains only whitespace")
        if kind == "json" and path.name.endswith(".jsonl"):
            _check_jsonl(path, text_field)
        if kind == "parquet":
            _check_parquet(path, text_field)
        checked.append((path, kind))
    return checked


def load_files(checked: list[tuple[Path, str]], text_field: str, group_field: str | None, encoding_errors: str,
               cache_dir: Path, streaming: bool):
    """Load validated local files with `datasets`, in order, as columns text (+ group_field)."""
    import datasets

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


def open_files(config: DataConfig, cache_dir: Path, streaming: bool, settings: Sequence[str]) -> Corpus:
    """The documents of `config.files`, not yet split; `settings` (how they are read and split) join the files'
    contents in the fingerprint."""
    checked = validate_files(config.files, config.text_field, config.encoding_errors)
    ds = load_files(checked, config.text_field, config.group_field, config.encoding_errors, cache_dir, streaming)
    fingerprint = hash_strings("files", *(f"{kind}:{sha256_file(p)}" for p, kind in checked), *settings)
    name = "files" if len(checked) > 1 else checked[0][0].name.split(".")[0] or "files"
    paths = [str(p) for p, _ in checked]
    source = ", ".join(paths) if len(paths) <= 3 else f"{len(paths)} files: {paths[0]}, ..., {paths[-1]}"
    return Corpus(name, fingerprint, source, "as given by the files' owner", ds)
