"""The noop metric (sinklab/metrics/noop.py): the value-drain ratio and the output norm of the queries that sink, on a
planted head and against a brute-force computation from a model's whole maps and values (also through the Hugging
Face path)."""
from __future__ import annotations

import pytest
import torch

from sinklab.metrics import METRICS, Context, SinklabRecorder, attention_maps, measure_all
from sinklab.metrics.secondary_sinks import scored_positions
from tests.helpers import save_ckpt, small_model, token_ids


def test_a_planted_no_op_head():
    """One head: queries 13..24 attend only to token 1, queries 1..12 to themselves; token 1's value has norm 0.1,
    the others 1. Token 1 is a sink (alpha_1 = 13/24), its value 0.1 of the median, and the 13 queries on it output
    0.1 against 1 for the 11 others."""
    T, hd = 24, 4
    a = torch.eye(T)
    a[12:] = 0.0
    a[12:, 0] = 1.0
    v = torch.nn.functional.one_hot(torch.arange(T) % hd, hd).float()
    v[0] *= 0.1
    metric = METRICS.build(Context(n_layer=1, n_head=1, eps=[0.3]), ["noop"])[0]
    metric.update(0, {"v": v[None, None]})
    chunks = [(torch.arange(r0, r0 + 8), a[None, None, r0:r0 + 8]) for r0 in range(0, T, 8)]
    for method in (metric.update_maps, metric.update_maps_again):
        for rows, chunk in chunks:
            method(0, rows, chunk)
    metric.end_batch()
    logs = metric.log(metric.result())
    assert logs["act/value_drain_ratio"] == pytest.approx(0.1)
    assert logs["act/sink_query_share"] == pytest.approx(13 / 24)
    assert logs["act/sink_output_ratio"] == pytest.approx(0.1)
    assert logs["act/layer0/sink_output_ratio"] == pytest.approx(0.1)


def brute_force(model, tokens, eps: float) -> dict[str, list[float]]:
    """Per layer from every layer's whole map and values: value_drain_ratio, sink_query_share, sink_output_ratio."""
    cfg = model.cfg
    S, n_extra = cfg.n_sink_tokens, cfg.n_slots + cfg.n_sink_tokens
    T, P = tokens.shape[1], scored_positions(tokens.shape[1])
    values, outputs = [], []
    hooks = [b.attn.hook_v.register_forward_hook(lambda _m, _i, out: values.append(out.double())) for b in model.blocks]
    hooks += [b.attn.register_forward_hook(lambda _m, _i, out: outputs.append(out.double())) for b in model.blocks]
    maps = attention_maps(model, tokens)
    for h in hooks:
        h.remove()
    res: dict[str, list[float]] = {"value_drain_ratio": [], "sink_query_share": [], "sink_output_ratio": []}
    for layer, (a, v) in enumerate(zip(maps, values)):
        a = a[:, :, S:].double()  # (B, H, T, n_extra + T): the real queries
        o = a @ v  # (B, H, T, hd): each head's output, over every key
        if cfg.gate == "none" and cfg.attn_bias != "v":  # the head outputs are what the module projects
            w = model.blocks[layer].attn.o_proj.weight.double()
            torch.testing.assert_close(o.transpose(1, 2).flatten(2) @ w.T, outputs[layer][:, S:], rtol=1e-5, atol=1e-6)
        scored = a.abs() / a.abs().sum(-1, keepdim=True) if not cfg.row_normalised else a
        real = scored[..., n_extra:]  # (B, H, T, T)
        alpha = torch.stack([real[:, :, k:, k].sum(-1) / (T - k) for k in range(P)], -1)
        sinks = torch.zeros(real.shape[:2] + (T,), dtype=torch.bool)
        sinks[..., :P] = alpha > eps
        v_norm = v[:, :, n_extra:].norm(dim=-1)  # (B, H, T)
        drain = v_norm / v_norm.median(-1, keepdim=True).values
        sinking = (real * sinks[:, :, None]).sum(-1) >= 0.5  # (B, H, T)
        norm = o.norm(dim=-1)
        res["value_drain_ratio"].append(drain[sinks].mean().item())
        res["sink_query_share"].append(sinking.double().mean().item())
        res["sink_output_ratio"].append((norm[sinking].mean() / norm[~sinking].mean()).item())
    return res


@pytest.mark.parametrize("switch", [{}, dict(attn_bias="kv", n_sink_tokens=1), dict(attn_op="sigmoid")])
def test_the_metric_equals_brute_force_on_whole_maps(switch):
    model, tokens, eps = small_model(**switch), token_ids(B=5, T=23, seed=2), 0.08  # T odd: one median value
    target = SinklabRecorder(model, chunk=7)
    (metric,) = METRICS.build(target.context(eps=[eps]), ["noop"])
    measure_all(target, tokens, [metric], batch_size=2)
    by_layer = metric.result()["by_layer"]
    for key, expected in brute_force(model, tokens, eps).items():
        assert by_layer[key] == pytest.approx(expected, rel=1e-6), key


def test_the_hugging_face_path_gives_the_sinklab_values(tmp_path):
    pytest.importorskip("transformers")
    from sinklab.targets import transformers_lm as hf
    from sinklab.export.llama import export

    model = small_model()
    export(str(save_ckpt(model, tmp_path / "m.ckpt")), str(tmp_path / "hf"), with_tokenizer=False,
           log=lambda *a: None)
    tokens = token_ids(B=4, T=24, seed=5)
    logs = []
    for target in (SinklabRecorder(model), hf.HFRecorder(hf.load_hf_model(tmp_path / "hf"))):
        metrics = METRICS.build(target.context(eps=[0.08]), ["secondary_sinks", "noop", "induction"])
        measure_all(target, tokens, metrics, batch_size=3)
        logs.append({k: v for m in metrics for k, v in m.log(m.result()).items()})
    # induction's split by head type (heads/<type>/...) reads the sinklab model's config: not on the HF path
    assert logs[1].keys() == {k for k in logs[0] if not k.startswith("heads/")}
    assert "act/layer1/sink_output_ratio" in logs[0] and "heads/rope/induction" in logs[0]
    for key, value in logs[1].items():
        assert value == pytest.approx(logs[0][key], rel=1e-4, abs=1e-5), key
