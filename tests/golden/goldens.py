"""What the goldens compare, computed by today's code, and how far each number is from its recorded value.

Shared by tests/golden/test_golden.py, tests/golden/test_legacy_checkpoint.py and scripts/golden_spread.py (which measures how far
these numbers move between kernel sets and thread counts, and so sets the tests' tolerances):

- `components(option, **change)`: the initial parameters' sums and 3 AdamW losses of one model/ option
  (record_components.py), optionally with a config change (the tightness tests' small real changes);
- `token_losses(option, **change)`: the initial model's loss at each position of the fixed tokens;
- `legacy_logits(**change)`: the logits of the sinklab 0.1 checkpoint (tests/golden) on its recorded input;
- `training_metrics(name, out, *extra)`: metrics.csv of a recorded training run (RUNS), trained in process.

The deviations are plain numbers per compared quantity, so that a tolerance is one comparison with one bound.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
LEGACY_CKPT = HERE / "ckpt_v0_1_sigmoid_kv_headwise.ckpt"
LEGACY_LOGITS = HERE / "ckpt_v0_1_logits.pt"


def recorded_components() -> dict:
    return json.loads((HERE / "components.json").read_text())


def components(option: str, **change) -> dict:
    """{"params": [[name, sum, abs sum], ...], "losses": [3 floats]} of the recorded config of `option`, with
    `change` applied to its model config."""
    from tests.golden.record_components import run

    from sinklab.model import ModelConfig, Transformer

    return run(lambda c: Transformer(ModelConfig(**c)), {**recorded_components()[option]["config"], **change})


def recorded_token_losses() -> dict:
    return json.loads((HERE / "token_losses.json").read_text())


def token_losses(option: str, **change) -> list[float]:
    """The initial model's loss at each position of the fixed tokens (record_components.token_losses)."""
    from tests.golden.record_components import token_losses as measure

    from sinklab.model import ModelConfig, Transformer

    return measure(lambda c: Transformer(ModelConfig(**c)), {**recorded_components()[option]["config"], **change})


def legacy_logits(**change) -> torch.Tensor:
    """Logits (2, 16, 320) of the sinklab 0.1 checkpoint on its recorded input; `change` edits its model config."""
    import sinklab

    model = sinklab.load_model(LEGACY_CKPT)
    if change:
        from sinklab.model import ModelConfig

        state = model.state_dict()
        cfg = ModelConfig.from_dict({**model.cfg.to_dict(), **change})
        model = cfg.build().eval()
        model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.load(LEGACY_LOGITS)["idx"])


# the default run of sinklab 0.1, when the goldens were recorded (today's default is scale=quick, conf/scale/quick.yaml)
V01_DEFAULTS = ["~scale", "data.vocab_size=4096", "data.bos=false", "data.probe_bos=false"]
FAST = V01_DEFAULTS + ["trainer.max_steps=40", "trainer.val_check_interval=20", "callbacks.sink.every_n_steps=20",
                       "callbacks.checkpoint.every_n_train_steps=20", "trainer.enable_progress_bar=false",
                       "trainer.enable_model_summary=false", "seed=0"]
ABLATION = ["model/bias=kv", "model/attn=sigmoid_norm", "model/pos=alibi"]
RUNS = {"fast_plain": FAST, "fast_abl": FAST + ABLATION,
        "steps200_plain": V01_DEFAULTS + ["trainer.max_steps=200", "trainer.enable_progress_bar=false", "seed=0"],
        "steps200_abl": V01_DEFAULTS + ["trainer.max_steps=200", "trainer.enable_progress_bar=false", "seed=0"]
        + ABLATION}


def recorded_metrics(name: str) -> pd.DataFrame:
    return pd.read_csv(HERE / f"{name}.csv")


def training_metrics(name: str, out: Path, *extra: str) -> pd.DataFrame:
    """metrics.csv of the recorded run `name` (plus `extra` overrides), trained in this process by `train(cfg)`."""
    from tests.helpers import train

    train(out, *extra, recipe=RUNS[name], job=False)
    return pd.read_csv(out / "metrics.csv")


# ---------------------------------------------------------------------------------------------------------------
# deviations from the recorded numbers

def param_deviation(got: dict, want: dict) -> float:
    """Greatest difference of a parameter's sum or absolute sum (float64 sums of its float32 values), relative to
    its recorded absolute sum (a sum near zero has no scale of its own); inf when the parameter names differ."""
    from sinklab.model.legacy import upgrade_key

    g = {n: v for n, *v in got["params"]}
    w = {upgrade_key(n): v for n, *v in want["params"]}
    if set(g) != set(w):
        return float("inf")
    return max((abs(a - b) / max(w[n][1], 1e-30) for n in w for a, b in zip(g[n], w[n])), default=0.0)


def loss_deviation(got: dict, want: dict) -> list[float]:
    """Relative difference of the loss after each AdamW step."""
    return [abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)]


def token_loss_deviation(got: list[float], want: list[float]) -> float:
    """Greatest absolute difference of the per-position losses."""
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def logits_deviation(got: torch.Tensor, want: torch.Tensor) -> float:
    """Greatest absolute difference of two logit tensors."""
    return float((got.double() - want.double()).abs().max())


# columns that are indices of a maximum (the channel / token of the largest activation): they flip on a near tie
# between kernel sets, so they are not compared; the maximum itself (massive_top, massive_ratio) is
INDEX_COLUMNS = re.compile(r"massive_(channel|token)$")


def compared(column: str) -> bool:
    """Whether a recorded metrics.csv column is compared: not the step, the timings (perf/) or the indices."""
    return column != "step" and not column.startswith("perf/") and not INDEX_COLUMNS.search(column)


def metric_deviation(got: pd.DataFrame, want: pd.DataFrame) -> pd.DataFrame:
    """Per compared recorded column and logged step: |got - want| / max(|want|, FLOOR), where FLOOR keeps
    values near zero (a cosine of 1e-4) from reading as large relative changes; NaN where neither logged a value,
    inf where only one did. Rows are the recorded rows, in order (metrics.csv is written in logging order)."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} rows logged, {len(want)} recorded")
    if not np.array_equal(got["step"].to_numpy(), want["step"].to_numpy()):
        raise AssertionError(f"logged at steps {got['step'].tolist()}, recorded at {want['step'].tolist()}")
    columns = [c for c in want.columns if compared(c)]
    missing = sorted(set(columns) - set(got.columns))
    if missing:
        raise AssertionError(f"recorded columns no longer logged: {missing}")
    g, w = got[columns].to_numpy(float), want[columns].to_numpy(float)
    with np.errstate(invalid="ignore"):
        dev = np.abs(g - w) / np.maximum(np.abs(w), FLOOR)
    dev[np.isnan(g) != np.isnan(w)] = np.inf
    out = pd.DataFrame(dev, columns=columns)
    out.insert(0, "step", want["step"].to_numpy())
    return out


FLOOR = 1e-2  # metrics are O(0.01..10): below 0.01 a difference is measured in absolute terms
