"""Gate statistics (sinklab.metrics.gates) wired into the sink callback (act/gate_*) and `sinklab measure`: a short
real training run with a gate logs them within bounds, measure --json returns what `gate_stats` computes on the
same probe set, and a run without a gate logs none."""
import csv
import json
import math
from pathlib import Path

import pytest
import torch

from sinklab.runs.checkpoints import load_model
from sinklab.metrics.base import bounds
from sinklab.metrics import activation_stats, flatten_activation_stats, gate_stats, record_gates
from sinklab.metrics.gates import GATE_KEYS
from sinklab.runs.run_data import probe_tokens
from tests.helpers import run_cli, small_model, token_ids, train

STEPS = 4
TINY = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=8", f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "callbacks.sink.every_n_steps=2",
        f"callbacks.checkpoint.every_n_train_steps={STEPS}", "trainer.enable_progress_bar=false"]


def measured_rows(run: Path) -> list[dict]:
    """The metrics.csv rows of the sink callback's measurements."""
    with open(run / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("sink/sink1") not in (None, "")]


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    return train(tmp_path_factory.mktemp("gated") / "run", "model/gate=elementwise", recipe=TINY).dir


@pytest.fixture(scope="module")
def ungated(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ungated") / "run", "model/gate=none", recipe=TINY).dir


GATE_NAMES = [f"act/{prefix}{key}" for prefix in ("", "layer0/", "layer1/") for key in GATE_KEYS]


def test_a_gated_run_logs_the_gate_statistics_within_bounds(gated):
    rows = measured_rows(gated)
    assert [int(r["step"]) for r in rows] == [2, 4]
    for row in rows:
        for name in GATE_NAMES:
            value = float(row[name])
            assert math.isfinite(value) and bounds(name) is not None, name
            lo, hi = bounds(name)
            assert lo <= value <= hi, (name, value)
            assert 0.0 <= value <= 1.0, (name, value)  # sigmoid scores and shares
        assert "act/layer2/gate_mean" not in row  # one entry per layer of the 2-layer model
        # every score weighted alike, and every layer has as many: the overall mean is the layers' mean
        assert float(row["act/gate_mean"]) == pytest.approx(
            (float(row["act/layer0/gate_mean"]) + float(row["act/layer1/gate_mean"])) / 2, rel=1e-6)


def test_measure_json_returns_gate_stats_of_the_probe_set(gated, capsys):
    res = json.loads(run_cli("sinklab", "measure", str(gated), "--json", capsys=capsys, check=True).stdout)
    model = load_model(gated / "checkpoints" / "last.ckpt").eval()
    probe = probe_tokens(gated, None, None)
    assert res["model"]["gate"] == "elementwise" and (res["num_seqs"], res["seq_len"]) == tuple(probe.shape)
    with torch.no_grad(), record_gates(model) as values:
        model(probe)  # the whole probe set in one forward; measure runs it in batches of 25
    direct = gate_stats(values)
    assert len(values) == 2 and values[0][0].shape == (*probe.shape, model.cfg.d_model)
    g = res["gates"]
    for key in GATE_KEYS:
        short = key.removeprefix("gate_")
        assert g[short] == pytest.approx(direct[key], rel=1e-5, abs=1e-7), key
        assert g["by_layer"][short] == pytest.approx([direct[f"layer{i}/{key}"] for i in range(2)], rel=1e-5,
                                                     abs=1e-7), key
    # the callback's measurement at the last step is of the same weights and the same probe set
    last = measured_rows(gated)[-1]
    assert int(last["step"]) == STEPS
    for key in GATE_KEYS:
        assert float(last[f"act/{key}"]) == pytest.approx(direct[key], rel=1e-5, abs=1e-7), key
    lines = run_cli("sinklab", "measure", str(gated), capsys=capsys, check=True).stdout.splitlines()
    gates = lines.index("gate scores act(X W_theta) per layer (model.gate=elementwise, gate_act=sigmoid; real tokens)")
    all_row = next(line for line in lines[gates:] if line.split()[:1] == ["all"])  # over all layers
    assert all_row.split() == ["all", f"{direct['gate_mean']:.4f}", f"{100 * direct['gate_low_share']:.1f}",
                               f"{direct['gate_first_token']:.4f}"]


def test_a_run_without_a_gate_logs_and_measures_no_gate_statistics(ungated, capsys):
    rows = measured_rows(ungated)
    assert rows and not [name for name in rows[0] if "gate" in name]
    assert float(rows[-1]["act/massive_ratio"]) > 0  # the activation statistics of the same forward are there
    res = json.loads(run_cli("sinklab", "measure", str(ungated), "--json", capsys=capsys, check=True).stdout)
    assert res["gates"] == {} and res["model"]["gate"] == "none"
    assert "gate scores" not in run_cli("sinklab", "measure", str(ungated), capsys=capsys, check=True).stdout


@pytest.mark.parametrize("act", ["sigmoid", "silu", "scaled_sigmoid"])
def test_activation_stats_add_the_gate_scores_of_every_batch(act):
    """Batches of 2 of 5 sequences (the last one short) give what one forward of all of them gives; the hooks are
    gone afterwards and no batch's scores are kept."""
    m = small_model(gate="headwise", gate_act=act, n_sink_tokens=1)
    tokens = token_ids(5, 24, seed=3)
    stats = activation_stats(m, tokens, batch_size=2)
    with torch.no_grad(), record_gates(m) as values:
        m(tokens)
    direct = gate_stats(values)
    assert set(stats["gates"]) == set(direct) and len(direct) == 3 * 3
    for key, value in direct.items():
        assert stats["gates"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert not any(a._forward_hooks for b in m.blocks for a in b.attn.gate_proj.modules())
    flat = flatten_activation_stats(stats)
    for key in direct:
        assert flat[key] == stats["gates"][key]
        lo, hi = bounds("act/" + key)
        assert lo <= flat[key] <= hi, key
    if act == "silu":  # scores below zero exist: a [0, 1] bound would be wrong for SiLU
        assert min(g.min().item() for layer in values for g in layer) < 0
    assert "gates" not in activation_stats(small_model(), tokens, batch_size=2)
