"""The induction metric (sinklab/metrics/induction.py): its own seeded input of repeated random tokens, the scores of
planted heads, and TransformerLens's diagonal stripes on a model's whole maps."""
from __future__ import annotations

import pytest
import torch

from sinklab.metrics import METRICS, Context, SinklabRecorder, attention_maps, measure_all
from sinklab.metrics.induction import repeated_tokens
from tests.helpers import small_model, token_ids


def test_its_input_is_the_probe_input_s_first_token_then_a_seeded_random_half_repeated():
    probe = token_ids(B=5, T=24, seed=3)
    ids = repeated_tokens(probe)
    assert ids.shape == (8, 23) and torch.equal(ids, repeated_tokens(probe))  # L = (24 - 1) // 2 = 11
    assert torch.equal(ids[:, 1:12], ids[:, 12:])
    assert torch.equal(ids[:, 0], probe[torch.arange(8) % 5, 0])
    assert set(ids[:, 1:].flatten().tolist()) <= set(probe[:, 1:].flatten().tolist())
    assert not torch.equal(ids, repeated_tokens(probe, seed=1))


def test_planted_previous_token_and_induction_heads_score_one():
    L = 5
    T = 2 * L + 1
    prev = torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    induction = torch.eye(T)  # the first half on itself, the second repeat on the token after its earlier copy
    induction[L + 1:] = 0.0
    induction[torch.arange(L + 1, T), torch.arange(2, L + 2)] = 1.0
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    metric = METRICS.build(Context(n_layer=1, n_head=3), ["induction"])[0]
    metric.repeat = L  # as own_input sets it for an input of 2L + 1 tokens
    maps = torch.stack([prev, induction, uniform])[None]  # (1, 3, T, T)
    for r0 in range(0, T, 4):
        rows = torch.arange(r0, min(T, r0 + 4))
        metric.update_maps(0, rows, maps[:, :, rows])
    metric.end_batch()
    res = metric.result()
    assert res["by_head"]["prev_token"][0] == pytest.approx([1.0, 0.0, sum(1 / (i + 1) for i in range(1, T)) / (T - 1)])
    assert res["by_head"]["induction"][0] == pytest.approx([0.0, 1.0, sum(1 / (i + 1) for i in range(L + 1, T)) / L])
    logs = metric.log(res)
    assert logs["act/induction_score"] == logs["act/layer0/induction_score"] == pytest.approx(1.0)


def test_the_scores_equal_transformer_lens_s_stripes_on_whole_maps():
    model, probe = small_model(), token_ids(B=5, T=24, seed=2)
    target = SinklabRecorder(model, chunk=7)
    (metric,) = METRICS.build(target.context(), ["induction"])
    measure_all(target, probe, [metric], batch_size=5)
    res = metric.result()
    ids = repeated_tokens(probe)
    L = (ids.shape[1] - 1) // 2
    for layer, a in enumerate(attention_maps(model, ids)):  # (8, H, 2L + 1, 2L + 1)
        prev = a.diagonal(-1, dim1=-2, dim2=-1).mean(-1).mean(0)  # (H,)
        induction = a.diagonal(-(L - 1), dim1=-2, dim2=-1)[..., -L:].mean(-1).mean(0)  # the second repeat's rows
        assert res["by_head"]["prev_token"][layer] == pytest.approx(prev.tolist(), rel=1e-5)
        assert res["by_head"]["induction"][layer] == pytest.approx(induction.tolist(), rel=1e-5)
    assert res["num_seqs"] == 8 and res["seq_len"] == 2 * L + 1
