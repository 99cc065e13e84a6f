"""`sinklab eval intervene` per layer and per head: a `LayerMask` (a mask some layers / query heads obey) and the
first token's value set to 0 act where they say and nowhere else, on every attention path, in the maps the metrics
read, and alike in sinklab's model and in transformers'; --layers, --per-layer and --per-head end to end."""
from __future__ import annotations

import pytest
import torch

from sinklab.errors import UserError
from sinklab.evals.interventions import drop_first_key
from sinklab.metrics import attention_maps
from sinklab.metrics.record import measure_model
from sinklab.model.masks import LayerMask
from sinklab.targets import SinklabTarget
from tests.helpers import layer_records, small_model, token_ids


@pytest.mark.parametrize("case", [{}, {"attn_backend": "explicit"}, {"n_sink_tokens": 1, "attn_bias": "kv"},
                                  {"attn_op": "sigmoid"}, {"window": 5}],
                         ids=["sdpa", "explicit", "sinks_kv_bias", "sigmoid", "window"])
def test_a_layer_mask_of_every_layer_and_head_is_the_plain_mask(case):
    m = small_model(**case)
    idx = token_ids(B=2, T=12)
    mask = drop_first_key(m.cfg.n_sink_tokens)
    with torch.no_grad():
        plain = m(idx, extra_mask=mask)
        everywhere = m(idx, extra_mask=LayerMask(mask))
        named = m(idx, extra_mask=LayerMask(mask, layers=range(m.cfg.n_layer), heads=range(m.cfg.n_head)))
        unchanged = m(idx)
    torch.testing.assert_close(everywhere, plain, atol=0, rtol=0)
    torch.testing.assert_close(named, plain, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(plain, unchanged, atol=1e-3)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "explicit"])
@pytest.mark.parametrize("sinks", [0, 1], ids=["no_sink_token", "sink_token"])
def test_a_mask_in_one_layer_changes_its_map_and_nothing_upstream(backend, sinks):
    """In layer 1 of 3 (every head, then head 2 alone): layer 0's residual stream and map are those of the unchanged
    model, layer 1's masked heads lose the first token's column for every later query and its other heads keep
    their map; the fused kernel gives the explicit path's output."""
    m = small_model(n_layer=3, attn_backend=backend, n_sink_tokens=sinks)
    idx, S = token_ids(B=2, T=12), sinks
    with torch.no_grad():
        before = [r["h"] for r in layer_records(m, idx)]
        maps_before = attention_maps(m, idx)
        for heads in (None, [2]):
            mask = LayerMask(drop_first_key(S), [1], heads)
            after = [r["h"] for r in layer_records(m, idx, extra_mask=mask)]
            explicit = [r["h"] for r in layer_records(m, idx, explicit=True, extra_mask=mask)]
            maps = attention_maps(m, idx, extra_mask=mask)
            torch.testing.assert_close(after[2], explicit[2], atol=2e-5, rtol=1e-5)
            assert torch.equal(after[0], before[0]) and torch.equal(maps[0], maps_before[0])
            assert not torch.allclose(after[1], before[1], atol=1e-4)
            for head in range(m.cfg.n_head):
                a, b = maps[1][:, head], maps_before[1][:, head]  # (B, S + T, n_keys)
                if heads is None or head in heads:
                    assert (a[:, S + 1:, S] == 0).all() and (b[:, S + 1:, S] > 0).all() and (a[:, S, S] > 0).all()
                else:
                    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_metrics_read_the_maps_of_a_mask_in_one_layer_and_head():
    """The sink metric under a mask of head 2 in layer 1: that head's alpha_1 is query 1's own 1 / T, the other heads
    of layers 0 and 1 keep theirs, layer 2 (downstream) changes; the sparse metric's visible_1 of that head is 1 / T
    (only query 1 sees token 1), every other head's as without the mask."""
    m, probe, T = small_model(n_layer=3), token_ids(B=3, T=16), 16
    target = SinklabTarget.of_model(m)
    mask = LayerMask(drop_first_key(0), [1], [2])
    with torch.no_grad():
        (plain,) = target.measure(probe, ["sink"], k=1)
        with target.masked(mask):
            (masked,) = target.measure(probe, ["sink"], k=1)
    a, b = masked.scores().alpha[..., 0], plain.scores().alpha[..., 0]  # (N, L, H)
    torch.testing.assert_close(a[:, 1, 2], torch.full_like(a[:, 1, 2], 1 / T))
    assert (b[:, 1, 2] > 1.5 / T).all()
    kept = torch.ones(3, 4, dtype=torch.bool)
    kept[1, 2] = kept[2] = False
    torch.testing.assert_close(a[:, kept], b[:, kept], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 2], b[:, 2], atol=1e-4)

    windowed = small_model(n_layer=3, window=5)
    (sparse,) = measure_model(windowed, probe, ["sparse"], k=2, extra_mask=mask)
    (sparse_plain,) = measure_model(windowed, probe, ["sparse"], k=2)
    vis, vis_plain = sparse.result()["visible"][..., 0], sparse_plain.result()["visible"][..., 0]  # (N, L, H)
    assert torch.equal(vis[:, 1, 2], torch.full_like(vis[:, 1, 2], 1 / T))
    assert torch.equal(vis[:, kept], vis_plain[:, kept]) and (vis_plain[:, 1, 2] > 1 / T).all()


def test_a_recurrent_layer_refuses_a_mask_in_one_line():
    m = small_model(attn_op="gated_deltanet")
    idx = token_ids(B=1, T=8)
    for mask in (LayerMask(drop_first_key(0), [1]), LayerMask(drop_first_key(0), [0], [1])):
        with pytest.raises(UserError) as err:
            m(idx, extra_mask=mask)
        assert "a mask of an intervention (a key dropped) does not apply to it" in str(err.value)
        assert "\n" not in str(err.value)
