"""The recurrence metric (sinklab/metrics/recurrence.py) and the sink metric on a hybrid: the decay statistics equal
the ones computed from the layer's own gates; the softmax layers have no entry; the sink metric scores every layer,
the recurrent ones through their effective attention, with Sink* beside Sink (their rows are not normalised)."""
from __future__ import annotations

import math

import torch

from sinklab.metrics.record import attention_maps, measure_model
from sinklab.model import ModelConfig, Transformer


def hybrid(**over) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, n_layer=4, n_head=4, d_model=32, d_ff=64, block_size=32, layer_pattern="GD",
               pattern_ops="D:gated_deltanet", n_sink_tokens=1)
    return Transformer(ModelConfig(**{**cfg, **over})).eval()


def test_decay_statistics_equal_the_layers_gates():
    m = hybrid()
    idx = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    gates = {}
    hooks = [m.blocks[i].attn.hook_extra.register_forward_hook(lambda _m, _i, out, i=i: gates.__setitem__(i, out))
             for i in (1, 3)]
    with torch.no_grad():
        m(idx)
    for h in hooks:
        h.remove()
    (metric,) = measure_model(m, idx, ["recurrence"], batch_size=2)
    res = metric.result()
    assert res["by_layer"]["alpha"][0] is None and res["by_head"]["alpha"][2] == [None] * 4  # softmax layers
    for layer in (1, 3):
        log_alpha = gates[layer]["decay"][:, :, 1:, 0].double()  # the real tokens (the sink token left out)
        alpha = log_alpha.exp().mean(-1).mean(0)  # (H,)
        beta = gates[layer]["beta"][:, :, 1:, 0].double().mean(-1).mean(0)
        torch.testing.assert_close(torch.tensor(res["by_head"]["alpha"][layer]), alpha.float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(res["by_head"]["beta"][layer]), beta.float(), rtol=0, atol=1e-6)
        want = math.log(2) / (-log_alpha.mean(-1).mean(0)[0].item())
        assert math.isclose(res["by_head"]["half_life"][layer][0], want, rel_tol=1e-6)
        assert 0 < res["by_layer"]["alpha"][layer] < 1
    logs = metric.log(res)
    assert {"recur/alpha", "recur/beta", "recur/half_life", "recur/layer1/alpha"} <= set(logs)
    assert "recur/layer0/alpha" not in logs


def test_gated_linear_has_no_beta():
    m = hybrid(pattern_ops="D:gated_linear")
    (metric,) = measure_model(m, torch.randint(0, 97, (2, 16)), ["recurrence"])
    res = metric.result()
    assert res["beta"] is None and res["alpha"] is not None and "recur/beta" not in metric.log(res)


def test_the_sink_metric_scores_every_layer_of_a_hybrid():
    """alpha_1 of a recurrent layer is its effective attention's mean on token 1 (column 0 of the real keys, after
    the learned sink token), Sink* is reported, and every layer has its Sink_1 row."""
    m = hybrid(n_sink_tokens=0)
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    (sink,) = measure_model(m, idx, ["sink"])
    part = sink.json(sink.result())
    assert part["row_normalised"] is False and "alpha_star" in part and len(part["sink1_by_layer"]) == 4
    maps = attention_maps(m, idx)
    for layer in range(4):
        want = maps[layer][:, :, :, 0].mean(-1).mean(0)  # (H,): each head's alpha_1
        torch.testing.assert_close(torch.tensor(part["alpha"][layer]), want.float(), atol=1e-5, rtol=1e-5)
    assert maps[1].triu(1).abs().max() == 0 and maps[1].abs().max() > 0  # the recurrent layer's map: causal
