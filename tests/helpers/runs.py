"""Training runs for tests: one helper, `train`, that trains a recipe (a list of overrides: FAST here, a test's own
elsewhere) through `sinklab-train` in this process or in a subprocess, or through the training function alone; small
local corpora and run dirs, and reading metrics.csv."""
import csv
import warnings as _warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np

from .cli import run_cli
from .text import VERSE

# a fast real training run (tests/train/test_train.py and the runs the evaluation tests train): 2 layers, d 64
FAST = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=16",
        "trainer.val_check_interval=20", "trainer.limit_val_batches=4", "callbacks.sink.every_n_steps=20",
        "callbacks.checkpoint.every_n_train_steps=20", "optim.warmup_steps=5", "trainer.enable_progress_bar=false"]


def train(out: Path, *overrides: str, recipe: Sequence[str] = FAST, check: bool = True,
          warnings: Optional[str] = "ignore", process: bool = False, job: bool = True,
          threads: Optional[int] = None) -> SimpleNamespace:
    """Train `recipe` + `overrides` into `out` (paths.output_dir): a run dir and what the run gave.

    - `sinklab-train` in this process (the default; `sinklab.train.entry.main`, stdout and stderr captured), or with
      `process=True` in a subprocess as a user runs it, for what only a process shows (the warnings a user sees);
      `warnings` is the warnings filter (PYTHONWARNINGS there). With `check`, a non-zero exit fails the test.
    - `job=False`: the training function alone on the composed config (`sinklab.train.entry.train(compose(...))`),
      without Hydra's job around it (no .hydra/, no exit code: an error raises); its final metrics in `final`, and
      the warnings it gave, recorded under the filter `warnings`, in `warned` (messages). `threads`: torch's
      threads while it trains (a tiny model is fastest on one), restored afterwards.

    Returns (dir, returncode, stdout, stderr, final, warned)."""
    args = [f"paths.output_dir={out}", *recipe, *overrides]
    if job:
        ran = run_cli("sinklab-train", *args, process=process, warnings=warnings, check=check)
        return SimpleNamespace(dir=Path(out), returncode=ran.returncode, stdout=ran.stdout, stderr=ran.stderr,
                               final=None, warned=[])
    import torch

    from sinklab.config import compose
    from sinklab.train.entry import train as train_config

    assert not process, "process=True runs sinklab-train: a Hydra job"
    before = torch.get_num_threads()
    try:
        with _warnings.catch_warnings(record=True) as caught:
            if warnings is not None:
                _warnings.simplefilter(warnings)
            torch.set_num_threads(threads or before)
            final = train_config(compose(args))
    finally:
        torch.set_num_threads(before)
    return SimpleNamespace(dir=Path(out), returncode=0, stdout="", stderr="", final=final,
                           warned=[str(w.message) for w in caught])


def natural_run(base: Path, name: str = "run") -> tuple[Path, object]:
    """A training-run dir whose .hydra/config.yaml has a data section (a small local corpus, BPE of 300)."""
    corpus = base / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        rng = np.random.default_rng(0)
        words = ("the quick brown fox jumps over a lazy dog while seven wise kings sing of silver rivers and "
                 "golden hills").split()
        for i in range(20):
            (corpus / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(60)))
    data = {"_target_": "sinklab.data.LMDataModule", "corpus": "local",
            "files": [str(p) for p in sorted(corpus.glob("*.txt"))], "tokenizer": "bpe", "vocab_size": 300,
            "cache_dir": str(base / "cache"), "block_size": 32, "batch_size": 4, "val_num_blocks": 2,
            "probe_num_seqs": 10, "probe_seq_len": 16}
    run = base / name
    return run, data_only_run(run, data)


def data_only_run(run: Path, data: dict):
    """`run`, a run dir holding only a data config (.hydra/config.yaml: `data`, the LMDataModule's settings, and seed
    0; an empty checkpoints/, no training): what `--data RUN_DIR` reads. Returns its data module, prepared."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    OmegaConf.save(OmegaConf.create({"data": data, "seed": 0}), run / ".hydra" / "config.yaml")
    dm = instantiate(OmegaConf.create(data), _recursive_=False)
    dm.prepare()
    return dm


def write_corpus(root: Path) -> SimpleNamespace:
    """Six small text documents under `root` and a token cache dir (the BPE is trained by the first run that needs
    it): (root, files, cache)."""
    import random

    files = []
    for d in range(6):
        rng = random.Random(d)
        lines = [" ".join(rng.choice(VERSE) for _ in range(12)).capitalize() + "." for _ in range(150)]
        path = root / f"doc{d}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(str(path))
    return SimpleNamespace(root=root, files=files, cache=str(root / "cache"))


def data_args(files, cache) -> list[str]:
    return ["data=local", "data.files=[" + ",".join(f"'{f}'" for f in files) + "]", f"data.cache_dir='{cache}'",
            "data.vocab_size=300", "data.batch_size=4", "data.val_num_blocks=4", "data.probe_num_seqs=8",
            "data.probe_seq_len=16"]


def small(corpus, *extra: str) -> list[str]:
    return [*data_args(corpus.files, corpus.cache),
            "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=32",
            "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "callbacks.sink.every_n_steps=4", "callbacks.sink.heatmap=false",
            "callbacks.checkpoint.every_n_train_steps=4", "optim.warmup_steps=2", "seed=3", *extra]


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def series(path: Path, key: str) -> dict[int, str]:
    """{step: value as written} of one metric; every step at most once."""
    out: dict[int, str] = {}
    for r in rows(path):
        if r.get(key) not in (None, ""):
            step = int(float(r["step"]))
            assert step not in out, f"{key} logged twice at step {step} in {path}"
            out[step] = r[key]
    return out


def git_checkout(repo: Path, revision: str, dest: Path) -> Path:
    """The files of `revision` of the git repository `repo` in `dest`, through git itself (`git archive`), not
    through sinklab's reader of local revisions."""
    import io
    import subprocess
    import tarfile

    tar = subprocess.run(["git", "-C", str(repo), "archive", revision], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
    return dest
