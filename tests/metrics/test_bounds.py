"""Every logged number is within its physical bounds (sinklab.metrics.base.all_bounds), in a real training run: shares in
[0, 100] %, cosines in [-1, 1], norms and losses >= 0, MFU in (0, 1], SiLU gate scores >= their minimum -0.278. A
utilisation above 1 is never logged."""
import math

import pandas as pd
import pytest

from sinklab.metrics.base import all_bounds, bounds
from tests.helpers import train

# 10 steps: the validation and sink measurements twice (steps 5 and 10), the training values every 2 steps
SHORT = ["trainer.max_steps=10", "trainer.val_check_interval=5", "callbacks.sink.every_n_steps=5",
         "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false", "data.batch_size=8"]


@pytest.mark.parametrize("switches", [[], pytest.param(["model/bias=kv", "model/attn=sigmoid"],
                                                      marks=[pytest.mark.slow, pytest.mark.ci]),
                                      pytest.param(["model/gate=elementwise_silu"], marks=[pytest.mark.slow, pytest.mark.ci])],
                         ids=["softmax", "kv_sigmoid", "silu_gate"])  # the two switched runs in CI's ci tier
def test_every_logged_metric_is_within_its_bounds(tmp_path, switches):
    metrics = pd.read_csv(train(tmp_path / "run", *switches, recipe=SHORT, job=False).dir / "metrics.csv")
    families = {"sink/sink1", "sink/alpha1", "act/cos_q_k1", "act/massive_ratio", "train/loss", "val/loss",
                "perf/tokens_per_sec", "lr-AdamW", "act/resid_inf_norm", "act/attn_kurtosis", "act/attn_top_median",
                "act/layer1/resid_sink_ratio", "act/resid_sink_channel_share", "act/layer0/ffn_norm_min",
                "act/final_norm_min", "act/norm_min", "act/first_token_attn", "act/layer1/first_token_attn"}
    gated = any(s.startswith("model/gate=") for s in switches)
    gate_families = {"act/gate_mean", "act/gate_low_share", "act/gate_first_token", "act/layer1/gate_mean"}
    assert families <= set(metrics.columns)
    assert (gate_families <= set(metrics.columns)) if gated else not gate_families & set(metrics.columns)
    for name in metrics.columns:
        limits = bounds(name)
        assert limits is not None, f"{name} has no bounds (its metric's `bounds`, or sinklab.keys)"
        values = metrics[name].dropna()
        assert len(values) and values.map(math.isfinite).all(), name
        assert values.between(*limits).all(), (name, limits, values[~values.between(*limits)].tolist())
    if "perf/mfu" in metrics:
        assert (metrics["perf/mfu"].dropna() > 0).all()


def test_an_mfu_above_one_is_dropped_with_a_warning(tmp_path):
    run = train(tmp_path / "run", "peak_flops=1000.0", "callbacks.sink=null", recipe=SHORT, job=False,
                warnings="always")  # any step beats 1 kFLOP/s
    metrics, warned = pd.read_csv(run.dir / "metrics.csv"), "\n".join(run.warned)
    assert "perf/mfu" not in metrics.columns and metrics["perf/tokens_per_sec"].notna().any()
    assert "perf/mfu dropped" in warned and "peak_flops=1000.0" in warned


def test_bounds_cover_distinct_families():
    assert bounds("sink/layer3/sink1") == (0.0, 100.0) and bounds("act/layer0/cos_q_kj") == (-1.0, 1.0)
    assert bounds("val/loss") == (0.0, math.inf) and bounds("perf/mfu") == (0.0, 1.0)
    assert bounds("act/gate_low_share") == bounds("act/layer2/gate_low_share") == (0.0, 1.0)
    silu_min = min(x / 1000 / (1 + math.exp(-x / 1000)) for x in range(-3000, 0))  # x sigmoid(x), x < 0
    assert bounds("act/layer0/gate_mean") == bounds("act/gate_first_token") == (pytest.approx(silu_min), math.inf)
    assert bounds("act/attn_entropy") == bounds("act/layer1/attn_entropy") == (0.0, math.inf)
    patterns = [p for p, _ in all_bounds()]
    assert bounds("something/new") is None and len(set(patterns)) == len(patterns)
