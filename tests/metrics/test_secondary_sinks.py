"""The secondary_sinks metric (sinklab/metrics/secondary_sinks.py): sinks found at any position with enough queries,
on planted maps and against a brute-force computation from a model's whole maps."""
from __future__ import annotations

import pytest
import torch

from sinklab.metrics import METRICS, Context, SinklabRecorder, attention_maps, measure_all
from sinklab.metrics.secondary_sinks import scored_positions
from tests.helpers import small_model, token_ids


def run_maps(maps_by_layer: list[torch.Tensor], eps: float = 0.3, chunk: int = 5):
    """Feed planted maps (B, H, T, T) layer by layer, in chunks of query rows, to the metric; its result."""
    B, H, T, _ = maps_by_layer[0].shape
    metric = METRICS.build(Context(n_layer=len(maps_by_layer), n_head=H, eps=[eps]), ["secondary_sinks"])[0]
    for layer, a in enumerate(maps_by_layer):
        for r0 in range(0, T, chunk):
            rows = torch.arange(r0, min(T, r0 + chunk))
            metric.update_maps(layer, rows, a[:, :, rows])
    metric.end_batch()
    return metric


def test_positions_are_scored_only_where_enough_queries_see_them():
    assert [scored_positions(T) for T in (64, 24, 16, 10, 1)] == [49, 9, 1, 1, 1]


def test_a_planted_secondary_sink_is_found_and_a_diagonal_head_is_not_one():
    T = 24
    first = torch.zeros(T, T)
    first[:, 0] = 1.0  # every query on token 1
    second = torch.eye(T)  # self-attention only: alpha_k = 1 / (T - k + 1), 1 at k = T
    second[6:, 5] = 1.0  # queries 7.. on token 6 (1-indexed): a secondary sink
    second[6:, torch.arange(6, T)] = 0.0
    diagonal = torch.eye(T)
    maps = [torch.stack([first, diagonal])[None], torch.stack([first, second])[None]]  # 2 layers of 2 heads
    metric = run_maps(maps)
    res = metric.result()
    assert res["by_head"] == [[0.0, 0.0], [0.0, 100.0]]
    assert res["first_layer"] == res["last_layer"] == 1
    assert res["positions"][0] == {"1": {"share": 50.0, "alpha": 1.0}}
    assert res["positions"][1]["6"] == {"share": 50.0, "alpha": 1.0}  # queries 6..24 all on it
    assert set(res["positions"][1]) == {"1", "6"}  # not 24: the diagonal's alpha_24 = 1 has one query only
    logs = metric.log(res)
    assert logs["act/layer1/secondary_sink_heads"] == 50.0 and logs["act/layer0/secondary_sink_heads"] == 0.0
    assert logs["act/layer1/sink_positions"] == 2.0 and logs["act/sink_positions"] == 2.0
    assert logs["act/secondary_sink_first_layer"] == logs["act/secondary_sink_last_layer"] == 1.0
    # without any secondary sink there is no depth range to log
    assert "act/secondary_sink_first_layer" not in run_maps([maps[0]]).log(run_maps([maps[0]]).result())


@pytest.mark.parametrize("switch", [{}, dict(attn_bias="kv", n_sink_tokens=1), dict(attn_op="sigmoid")])
def test_the_metric_equals_brute_force_on_whole_maps(switch):
    model, tokens, eps = small_model(**switch), token_ids(B=5, T=24, seed=2), 0.08
    target = SinklabRecorder(model, chunk=7)
    (metric,) = METRICS.build(target.context(eps=[eps]), ["secondary_sinks"])
    measure_all(target, tokens, [metric], batch_size=2)
    res = metric.result()
    S, n_extra = model.cfg.n_sink_tokens, model.cfg.n_slots + model.cfg.n_sink_tokens
    T, P = tokens.shape[1], scored_positions(tokens.shape[1])
    shares, counts = [], []
    for a in attention_maps(model, tokens):  # (B, H, S + T, n_extra + T)
        a = a[:, :, S:].double()
        if not model.cfg.row_normalised:
            a = a.abs() / a.abs().sum(-1, keepdim=True)
        a = a[..., n_extra:]  # (B, H, T, T): real queries and keys
        alpha = torch.stack([a[:, :, k:, k].sum(-1) / (T - k) for k in range(P)], -1)  # (B, H, P)
        sink = alpha > eps
        shares.append(100.0 * sink[..., 1:].any(-1).double().mean().item())
        counts.append(sink.any(1).double().sum(-1).mean().item())
    assert res["by_layer"]["secondary_sink_heads"] == pytest.approx(shares)
    assert res["by_layer"]["sink_positions"] == pytest.approx(counts)
    assert 0 < sum(shares)  # the check is not vacuous
    assert all(int(k) <= P for layer in res["positions"] for k in layer)
