"""Every command checks the names it is given (files, flags that go together, metrics) before it loads a model: a
bad argument is one line, exit code 2, even where the checkpoint behind TARGET cannot be read at all. Each case has
a control beside it: the same command with that argument right reaches the checkpoint and is refused for it, so
the check under test is the one that came first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_cli

UNREADABLE = "is not a readable sinklab checkpoint"
NOT_A_MODEL = "the directory has no config.json"  # what loading --hf-model NOT_A_RUN says


@pytest.fixture
def broken(tmp_path):
    """Paths of the cases: a run dir (its .hydra/config.yaml) whose last.ckpt cannot be read, the same file bare
    (no run config beside it), a run dir of kept checkpoints that cannot be read, a token file, an empty dir."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "checkpoints" / "kept").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"not a checkpoint")
    kept = tmp_path / "kept_run"
    (kept / ".hydra").mkdir(parents=True)
    (kept / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (kept / "checkpoints" / "kept").mkdir(parents=True)
    (kept / "checkpoints" / "kept" / "step0000010-tokens640.ckpt").write_bytes(b"not a checkpoint")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "b.ckpt").write_bytes(b"not a checkpoint")
    np.save(tmp_path / "ids.npy", np.zeros((2, 8), dtype=np.int64))
    np.save(tmp_path / "text.npy", np.zeros(16, dtype=np.int64))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    return {"RUN": run, "KEPT_RUN": kept, "BARE": tmp_path / "bare" / "b.ckpt", "IDS": tmp_path / "ids.npy",
            "TEXT_IDS": tmp_path / "text.npy", "MISSING": tmp_path / "missing.npy", "NOT_A_RUN": tmp_path / "bare",
            "FULL": tmp_path / "full", "OUT": tmp_path / "out", "TXT": tmp_path / "missing.txt",
            "CSV": tmp_path / "t.csv", "PAGE": tmp_path / "atlas.html"}


def sinklab(capsys, paths: dict, *args: str) -> str:
    """`sinklab ARGS` (placeholders replaced by the fixture's paths): its one-line error, after exit code 2."""
    rc, out, err = run_cli("sinklab", *(str(paths.get(a, a)) for a in args))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (args, rc, err)
    return err


# (command and arguments, the error that must come first, the same command with the argument right)
CASES = [
    (["trajectory", "KEPT_RUN", "--metrics", "sink/sinkk1", "--csv", "CSV"],
     "--metrics sink/sinkk1: no registered metric logs it", "did you mean sink/sink1?",
     ["trajectory", "KEPT_RUN", "--metrics", "sink/sink1", "--csv", "CSV"]),
    (["trajectory", "KEPT_RUN", "--metrics", "sink/alpha", "--csv", "CSV"],
     "--metrics sink/alpha: no registered metric logs it", "did you mean sink/alpha1?",
     ["trajectory", "KEPT_RUN", "--metrics", "sink/alpha1", "--csv", "CSV"]),
    (["trajectory", "KEPT_RUN", "--tokens", "MISSING", "--csv", "CSV"], "--tokens", "no such file",
     ["trajectory", "KEPT_RUN", "--tokens", "IDS", "--csv", "CSV"]),
    (["measure", "RUN", "--tokens", "MISSING"], "--tokens", "no such file", ["measure", "RUN", "--tokens", "IDS"]),
    (["measure", "BARE"], "choose the input", "b.ckpt has no run config", ["measure", "BARE", "--input", "random"]),
    (["measure", "BARE", "--input", "random", "natural"], "--input natural:", "has no run config",
     ["measure", "BARE", "--input", "random", "repeat"]),
    (["measure", "--hf-model", "NOT_A_RUN", "--input", "natural", "--text", "TXT"], "--text", "no such file",
     ["measure", "--hf-model", "NOT_A_RUN", "--input", "random"]),
    (["quant", "RUN", "--tokens", "MISSING"], "--tokens", "no such file", ["quant", "RUN", "--tokens", "IDS"]),
    (["quant", "RUN", "--tokens", "IDS", "--calib-tokens", "MISSING"], "--calib-tokens", "no such file",
     ["quant", "RUN", "--tokens", "IDS", "--calib-tokens", "IDS"]),
    (["quant", "RUN", "--calib-tokens", "IDS"], "--calib-tokens goes with --tokens", "",
     ["quant", "RUN", "--tokens", "IDS", "--calib-tokens", "IDS"]),
    (["quant", "RUN", "--data", "RUN", "--tokens", "IDS"], "pass either --data RUN_DIR or --tokens FILE.npy", "",
     ["quant", "RUN", "--data", "RUN"]),
    (["quant", "RUN", "--data", "NOT_A_RUN"], "--data", "not a run dir", ["quant", "RUN", "--data", "RUN"]),
    (["quant", "BARE"], "choose the data", "pass --data RUN_DIR or --tokens FILE.npy",
     ["quant", "BARE", "--tokens", "IDS"]),
    (["quant", "--hf-model", "NOT_A_RUN"], "choose the data: an HF model has no run config", "",
     ["quant", "--hf-model", "NOT_A_RUN", "--tokens", "IDS"]),
    (["eval", "streaming", "RUN", "--tokens", "MISSING"], "--tokens", "no such file",
     ["eval", "streaming", "RUN", "--tokens", "TEXT_IDS"]),
    (["eval", "streaming", "RUN", "--data", "RUN", "--tokens", "TEXT_IDS"], "pass either --data", "not both",
     ["eval", "streaming", "RUN", "--data", "RUN"]),
    (["eval", "streaming", "BARE"], "choose the data", "pass --data RUN_DIR or --tokens FILE.npy",
     ["eval", "streaming", "BARE", "--tokens", "TEXT_IDS"]),
    (["eval", "intervene", "RUN", "--tokens", "MISSING"], "--tokens", "no such file",
     ["eval", "intervene", "RUN", "--tokens", "IDS"]),
    (["eval", "intervene", "RUN", "--data", "NOT_A_RUN"], "--data", "not a run dir",
     ["eval", "intervene", "RUN", "--data", "RUN"]),
    (["eval", "intervene", "BARE"], "choose the data", "b.ckpt has no run config",
     ["eval", "intervene", "BARE", "--tokens", "IDS"]),
    (["atlas", "KEPT_RUN", "--metric", "attention", "--out", "PAGE"], "--metric attention: no registered metric",
     "", ["atlas", "KEPT_RUN", "--out", "PAGE"]),
    (["atlas", "--hf-model", "NOT_A_RUN", "--text", "TXT", "--out", "PAGE"], "--text", "no such file",
     ["atlas", "--hf-model", "NOT_A_RUN", "--input", "random", "--out", "PAGE"]),
    (["export-hf", "RUN", "FULL"], "OUT_DIR", "exists and is not an empty directory", ["export-hf", "RUN", "OUT"]),
    (["export-hf", "RUN", "OUT", "--tokenizer", "TXT"], "--tokenizer", "no tokenizer.json there",
     ["export-hf", "RUN", "OUT"]),
    (["export-hf", "RUN", "FULL", "--revisions"], "OUT_DIR", "exists and is not an empty directory",
     ["export-hf", "RUN", "OUT", "--revisions"]),
    (["export-hf", "RUN", "OUT", "--revisions", "--tokenizer", "TXT"], "--tokenizer", "no tokenizer.json there",
     ["export-hf", "RUN", "OUT", "--revisions"]),
]


@pytest.mark.parametrize("args,first,then,control", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_argument_is_refused_before_the_model_is_loaded(capsys, broken, args, first, then, control):
    err = sinklab(capsys, broken, *args)
    assert first in err and then in err, err
    assert UNREADABLE not in err and NOT_A_MODEL not in err, err
    reached = sinklab(capsys, broken, *control)  # the argument right: the model is loaded, and cannot be
    assert UNREADABLE in reached or NOT_A_MODEL in reached, reached
    assert not broken["CSV"].exists() and not broken["OUT"].exists() and not broken["PAGE"].exists()
