"""The contract every registered metric passes (sinklab/metrics/base.py), without new test code for a new metric:
- every value it logs has physical bounds and lies within them, on random models of several switches and on a
  trained one;
- the hooked, streamed value (batches of 2 sequences, maps in chunks of 7 query rows, one layer at a time) equals
  the direct computation (every sequence at once, every layer's whole explicit map from one forward);
- a sinklab model exported to Hugging Face gives the same values through the Hugging Face path (`HFTarget`) as
  through the sinklab one, for every metric that does not read the sinklab model's own weights;
- its JSON part is strict JSON, under its own key."""
from __future__ import annotations

import json
import math

import pytest
import torch

from sinklab.keys import bounds
from sinklab.metrics import METRICS, SinklabTarget, attention_maps, measure_all
from tests.conftest import small_model, token_ids

SWITCHES = {"softmax": {}, "kv_bias_sink_token": dict(attn_bias="kv", n_sink_tokens=1),
            "sigmoid": dict(attn_op="sigmoid"), "gated": dict(gate="elementwise"), "alibi_window": dict(pos="alibi",
                                                                                                   window=6)}
NAMES = METRICS.names()


def logged(model, tokens, names=None, batch_size=2, chunk=7, target_cls=SinklabTarget) -> dict[str, dict]:
    target = target_cls(model, chunk)
    metrics = METRICS.build(target.context(eps=[0.3, 0.5], k=3), names)
    measure_all(target, tokens, metrics, batch_size=batch_size)
    return {m.name: m.log(m.result()) for m in metrics}


class DirectTarget(SinklabTarget):
    """Every recorded tensor of the whole input at once, and each layer's whole map from `attention_maps` (one
    forward through the explicit maps): what the streamed route must equal."""

    def run(self, idx, metrics):
        S, n_slots = self.model.cfg.n_sink_tokens, self.model.cfg.n_slots
        layers: dict[int, dict] = {}
        names = set().union(*(m.records for m in metrics)) - {"maps"}
        with self.hooks(names, lambda i, rec: layers.__setitem__(i, rec)):
            self.model(idx)
        maps = attention_maps(self.model, idx)
        for i in sorted(layers):
            for m in metrics:
                m.update(i, {n: layers[i][n] for n in m.records if n in layers[i]})
            rows = torch.arange(idx.shape[1])
            whole = maps[i][:, :, S:]  # (B, H, T, n_slots + S + T): the real queries, every key
            assert whole.shape[-1] == n_slots + S + idx.shape[1]
            for m in metrics:
                if "maps" in m.records:
                    m.update_maps(i, rows, whole)


def assert_within_bounds(values: dict[str, float], where: str) -> None:
    for name, value in values.items():
        limits = bounds(name)
        assert limits is not None, f"{where}: {name} has no bounds (declare them in its metric's `bounds`)"
        assert math.isfinite(value) and limits[0] - 1e-9 <= value <= limits[1] + 1e-9, (where, name, value, limits)


@pytest.mark.parametrize("switch", SWITCHES)
def test_every_metric_is_within_its_bounds_on_a_random_model(switch):
    values = logged(small_model(**SWITCHES[switch]), token_ids(B=5, T=24, seed=2))
    assert set(values) == {n for n in NAMES if METRICS.get(n).applies(SinklabTarget(small_model(
        **SWITCHES[switch])).context())}
    for name, logs in values.items():
        assert_within_bounds(logs, f"{name} on {switch}")
        assert logs or name == "gates" and switch != "gated", f"{name} logged nothing"


def test_every_metric_is_within_its_bounds_on_a_trained_model(trained_run):
    from sinklab import load_model

    model = load_model(trained_run)
    for name, logs in logged(model, token_ids(B=6, T=64, seed=1, vocab=model.cfg.vocab_size)).items():
        assert_within_bounds(logs, f"{name} on the trained run")


@pytest.mark.parametrize("switch", SWITCHES)
def test_the_streamed_value_equals_the_direct_computation(switch):
    m = small_model(**SWITCHES[switch])
    tokens = token_ids(B=5, T=24, seed=3)
    streamed = logged(m, tokens, batch_size=2, chunk=7)
    direct = logged(m, tokens, batch_size=5, target_cls=DirectTarget)
    assert streamed.keys() == direct.keys()
    for name in streamed:
        assert streamed[name].keys() == direct[name].keys(), name
        for key, value in direct[name].items():
            assert streamed[name][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.parametrize("name", NAMES)
def test_a_metric_records_only_what_it_declares_and_writes_strict_json(name):
    cls = METRICS.get(name)
    m = small_model(gate="elementwise", attn_bias="k")
    target = SinklabTarget(m)
    (metric,) = METRICS.build(target.context(), [name])
    seen: list[set] = []
    update = metric.update
    metric.update = lambda layer, rec: (seen.append(set(rec)), update(layer, rec))[1]
    measure_all(target, token_ids(B=3, T=24), [metric], batch_size=2)
    assert all(s <= set(cls.records) - {"maps"} for s in seen)
    part = metric.json(metric.result())
    json.dumps(part, allow_nan=False)
    assert cls.json_key is None or cls.json_key not in ("target", "source", "model", "input", "seconds")


def test_an_exported_model_gives_the_same_values_through_the_hugging_face_path(tmp_path):
    pytest.importorskip("transformers")
    from sinklab import hf
    from sinklab.export_hf import export
    from tests.test_measure import save_ckpt

    torch.manual_seed(0)
    m = small_model(vocab_size=97)
    ckpt = save_ckpt(m, tmp_path / "m.ckpt")
    export(str(ckpt), str(tmp_path / "hf"), with_tokenizer=False, log=lambda *a: None)
    model = hf.load_hf_model(tmp_path / "hf")
    tokens = token_ids(B=4, T=24, seed=5)
    names = [n for n in NAMES if not METRICS.get(n).needs_model]
    via_hf = logged(model, tokens, names, target_cls=lambda model, chunk: hf.HFTarget(model))
    via_sinklab = logged(m, tokens, names)
    for name in via_hf:
        assert via_hf[name].keys() <= via_sinklab[name].keys(), name
        for key, value in via_hf[name].items():
            assert value == pytest.approx(via_sinklab[name][key], rel=1e-3, abs=1e-4), (name, key)
    assert {"sink", "first_token_attn", "massive", "norms", "outliers", "entropy"} <= set(via_hf)
    assert via_hf["norms"].keys() == via_sinklab["norms"].keys()  # LLaMA's q / k / v are reproduced
