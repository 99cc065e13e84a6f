"""Training runs for tests: the FAST recipe, `sinklab-train` in this process or in a subprocess (as a user runs it,
for what only a process shows: exit codes, signals, warnings), small local corpora and run dirs, and reading
metrics.csv."""
import csv
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .text import VERSE

# a fast real training run (tests/train/test_train.py and the runs the evaluation tests train): 2 layers, d 64
FAST = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=16",
        "trainer.val_check_interval=20", "trainer.limit_val_batches=4", "callbacks.sink.every_n_steps=20",
        "callbacks.checkpoint.every_n_train_steps=20", "optim.warmup_steps=5", "trainer.enable_progress_bar=false"]


def train(out: Path, *overrides: str, check: bool = True, warnings: str = "ignore",
          process: bool = False) -> SimpleNamespace:
    """`sinklab-train paths.output_dir=OUT` with FAST and `overrides`: in this process (the console script's entry,
    its stdout and stderr captured), or with `process=True` in a subprocess as a user runs it, for what only a
    process shows (the warnings a user sees: `warnings` is the PYTHONWARNINGS filter). Returns (returncode, stdout,
    stderr)."""
    args = [f"paths.output_dir={out}", *FAST, *overrides]
    if process:
        proc = subprocess.run([sys.executable, "-m", "sinklab.train.entry", *args], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONWARNINGS": warnings})
        result = SimpleNamespace(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    else:
        import contextlib
        import io
        import warnings as _warnings

        stdout, stderr = io.StringIO(), io.StringIO()
        with _warnings.catch_warnings(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            _warnings.simplefilter(warnings)
            code = train_here(args)
        result = SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())
    if check and result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


def train_here(args: list[str]) -> int:
    """`sinklab-train ARGS` in this process (the console script's `sinklab.train.entry.main`); its exit code."""
    from sinklab.train.entry import main

    old = sys.argv
    sys.argv = ["sinklab-train", *args]
    try:
        main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old


def natural_run(base: Path, name: str = "run") -> tuple[Path, object]:
    """A training-run dir whose .hydra/config.yaml has a data section (a small local corpus, BPE of 300)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

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
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    OmegaConf.save(OmegaConf.create({"data": data, "seed": 0}), run / ".hydra" / "config.yaml")
    dm = instantiate(OmegaConf.create(data), _recursive_=False)
    dm.prepare()
    return run, dm


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
