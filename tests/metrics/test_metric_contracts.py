"""The contract every registered metric passes (sinklab/metrics/base.py), without new test code for a new metric:
- every value it logs has physical bounds and lies within them, on random models (SWITCHES: one per component that
  changes what a metric is given, and per mask) and on a trained one;
- the hooked, streamed value (batches of 2 sequences, maps in chunks of 7 query rows, one layer at a time) equals
  the direct computation (every sequence at once, every layer's whole explicit map from one forward);
- a sinklab model exported to Hugging Face gives the same values through the Hugging Face path (`HFRecorder`) as
  through the sinklab one, for every metric that does not read the sinklab model's own weights;
- its JSON part is strict JSON, under its own key;
- `sinklab measure`'s text shows it: its own lines (`Metric.text`), from that JSON, on every switch.
The checks live in sinklab/contracts/metrics.py, where `sinklab check-component` runs them on a user's module."""
from __future__ import annotations

import json

import pytest
import torch

from sinklab.analysis.measurement import format_tables, measure_target
from sinklab.analysis.probe_inputs import InputSpec
from sinklab.cli.base import finite
from sinklab.contracts import metrics as contract
from sinklab.contracts.metrics import SWITCHES, applicable, assert_within_bounds, logged
from sinklab.metrics import METRICS
from sinklab.targets.native import SinklabTarget
from tests.helpers import small_model, token_ids

NAMES = METRICS.names()


@pytest.mark.parametrize("switch", SWITCHES)
def test_every_metric_is_within_its_bounds_on_a_random_model(switch):
    contract.within_bounds_on_a_random_model(switch)


def test_every_metric_is_within_its_bounds_on_a_trained_model(trained_run):
    from sinklab import load_model

    model = load_model(trained_run)
    for name, logs in logged(model, token_ids(B=6, T=64, seed=1, vocab=model.cfg.vocab_size)).items():
        assert_within_bounds(logs, f"{name} on the trained run")


@pytest.mark.parametrize("switch", SWITCHES)
def test_the_streamed_value_equals_the_direct_computation(switch):
    contract.streamed_equals_direct(switch)


@pytest.mark.parametrize("name", NAMES)
def test_a_metric_records_only_what_it_declares_and_writes_strict_json(name):
    contract.records_only_what_it_declares_and_writes_strict_json(name)


@pytest.mark.parametrize("switch", SWITCHES)
def test_every_measured_metric_shows_in_the_measure_text(switch):
    """The text has, after the header, each measured metric's own block from the strict JSON the command prints,
    in the registry's order, a blank line before each; only a metric whose text is empty (gates without a gate)
    is left out."""
    model = small_model(**SWITCHES[switch])
    target = SinklabTarget.of_model(model, switch)
    res = measure_target(target, InputSpec("random", seq_len=24, num_seqs=3), eps=(0.3, 0.5), k=3, batch_size=2)
    res = json.loads(json.dumps(finite(res), allow_nan=False))
    blocks = [(cls.name, cls.text(cls.part(res), res)) for cls in METRICS if cls.part(res) is not None]
    measured = applicable(switch)  # every metric applies to a sinklab model, `sparse` where its mask is sparse
    assert [name for name, _ in blocks] == [name for name in NAMES if name in measured]
    assert ("sparse" in measured) == model.cfg.sparse_attention  # a window, a sparsity or a sparse op (nsa, dsa)
    gated = SWITCHES[switch].get("gate", "none") != "none"
    assert {name for name, block in blocks if not block} == (set() if gated else {"gates"})
    shown = [block for _, block in blocks if block]
    expected = [f"sinklab model {switch}", f"input random: 3 sequences x 24 tokens; rows "
                f"{'sum to 1' if res['row_normalised'] else 'do not sum to 1 (Sink* on |A| / sum |A|)'}"]
    for block in shown:
        assert all(isinstance(line, str) and "\n" not in line for line in block)
        expected += ["", *block]
    assert format_tables(res).splitlines() == expected


def test_an_exported_model_gives_the_same_values_through_the_hugging_face_path(tmp_path):
    pytest.importorskip("transformers")
    from sinklab.targets import transformers_lm as hf
    from sinklab.export.llama import export
    from tests.helpers import save_ckpt

    torch.manual_seed(0)
    m = small_model(vocab_size=97)
    ckpt = save_ckpt(m, tmp_path / "m.ckpt")
    export(str(ckpt), str(tmp_path / "hf"), with_tokenizer=False, log=lambda *a: None)
    model = hf.load_hf_model(tmp_path / "hf")
    tokens = token_ids(B=4, T=24, seed=5)
    names = [n for n in NAMES if not METRICS.get(n).needs_model]
    via_hf = logged(model, tokens, names, target_cls=lambda model, chunk: hf.HFRecorder(model))
    via_sinklab = logged(m, tokens, names)
    for name in via_hf:
        assert via_hf[name].keys() <= via_sinklab[name].keys(), name
        for key, value in via_hf[name].items():
            assert value == pytest.approx(via_sinklab[name][key], rel=1e-3, abs=1e-4), (name, key)
    assert {"sink", "first_token_attn", "massive", "norms", "outliers", "entropy"} <= set(via_hf)
    assert via_hf["norms"].keys() == via_sinklab["norms"].keys()  # LLaMA's q / k / v are reproduced
