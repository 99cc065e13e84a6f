"""Numbers must not change across refactors: the model's initial parameters and a few training steps for every
option of every model/ config group, and whole training runs, equal what sinklab 0.1 recorded (tests/golden/)."""
import json
from pathlib import Path

import pytest
import torch

from sinklab.model import ModelConfig, Transformer
from sinklab.model.legacy import upgrade_key

GOLDEN = Path(__file__).parent / "golden"
RECORDED = json.loads((GOLDEN / "components.json").read_text())


def test_every_recorded_model_option_still_exists():
    """Every option of sinklab 0.1 is still here (options added since have no 0.1 numbers to equal)."""
    from tests.golden.record_components import options

    assert set(RECORDED) <= set(options())


@pytest.mark.parametrize("option", sorted(RECORDED))
def test_initialisation_and_training_steps_are_bit_identical(option):
    from tests.golden.record_components import run

    want = RECORDED[option]
    got = run(lambda c: Transformer(ModelConfig(**c)), want["config"])
    # the same parameters (under today's names) with the same values; a parameter that is never drawn (a learned
    # sink logit starts at zero) may sit elsewhere in the order
    assert {n: tuple(v) for n, *v in got["params"]} == {upgrade_key(n): tuple(v) for n, *v in want["params"]}
    assert got["losses"] == want["losses"]


# the default run of sinklab 0.1, when the goldens were recorded (today's default is scale=quick, conf/scale/quick.yaml)
V01_DEFAULTS = ["~scale", "data.vocab_size=4096", "data.bos=false", "data.probe_bos=false"]
FAST = V01_DEFAULTS + ["trainer.max_steps=40", "trainer.val_check_interval=20", "callbacks.sink.every_n_steps=20",
        "callbacks.checkpoint.every_n_train_steps=20", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "seed=0"]
ABLATION = ["model/bias=kv", "model/attn=sigmoid_norm", "model/pos=alibi"]
RUNS = {"fast_plain": FAST, "fast_abl": FAST + ABLATION,
        "steps200_plain": V01_DEFAULTS + ["trainer.max_steps=200", "seed=0"],
        "steps200_abl": V01_DEFAULTS + ["trainer.max_steps=200", "seed=0"] + ABLATION}


def train_metrics(tmp_path: Path, overrides: list[str]):
    """metrics.csv of a sinklab-train run with 2 torch threads (as recorded), without the timing columns."""
    import os
    import subprocess
    import sys

    import pandas as pd

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "sinklab.train.entry", *overrides, f"paths.output_dir={out}"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return pd.read_csv(out / "metrics.csv")


def drop_timing(df):
    return df[[c for c in df.columns if not c.startswith("perf/")]]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("steps200") else n
                                  for n in RUNS])
def test_training_runs_are_bit_identical(tmp_path, name):
    """Every logged value (losses, learning rate, sink metric, activation statistics) equals sinklab 0.1's, exactly;
    only the timing columns (perf/tokens_per_sec, perf/mfu) may differ. Metrics added since (issue 15's act/
    statistics) have no 0.1 numbers: every recorded column is still logged, and only those are compared."""
    import pandas as pd

    want = pd.read_csv(GOLDEN / f"{name}.csv")
    got = train_metrics(tmp_path, RUNS[name])
    assert set(want.columns) <= set(got.columns), sorted(set(want.columns) - set(got.columns))
    pd.testing.assert_frame_equal(drop_timing(got[want.columns]), drop_timing(want), check_exact=True)
