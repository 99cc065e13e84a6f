"""Per-layer patterns (`model.layer_pattern`) beyond the contract tests: the pattern repeats over the depth, local
layers see only the window and global ones every key, local layers run fused (SDPA with the window mask), a layer
gets its own op (a hybrid), the presets compose, bad settings are refused in one line, export-hf refuses a pattern,
and no pattern (the default) is the model as before."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sinklab.metrics.record import attention_maps
from sinklab.model import ConfigError, ModelConfig
from sinklab.model.ops.kernel import KernelAttention
from sinklab.model.ops.softmax import LearnedSinkLogitSoftmax, Softmax
from tests.helpers import SMALL, assert_one_line_error, small_model, token_ids


def test_the_pattern_repeats_over_the_depth_and_is_cut_at_n_layer():
    m = small_model(n_layer=5, layer_pattern="LLG", window=4)
    assert [b.attn.local for b in m.blocks] == [True, True, False, True, True]
    hybrid = small_model(n_layer=4, attn_op="kernel", layer_pattern="GGGS", pattern_ops="S:softmax")
    assert [type(b.attn.op) for b in hybrid.blocks][3] is Softmax
    assert all(isinstance(b.attn.op, KernelAttention) for b in hybrid.blocks[:3])


def test_local_layers_see_the_window_and_global_layers_every_key():
    m = small_model(n_layer=3, layer_pattern="LG", window=4)  # L G L
    maps = attention_maps(m, token_ids())  # (B, H, T, T) per layer
    far = torch.ones(24, 24, dtype=torch.bool).tril(-4)  # keys 4 or more positions back
    for layer, a in enumerate(maps):
        if layer % 2 == 0:
            assert torch.all(a[..., far] == 0), layer
        else:
            assert a[..., far].abs().min() > 0, layer
    uniform = small_model(n_layer=3, window=4)  # model.window without a pattern: every layer local
    assert all(torch.all(a[..., far] == 0) for a in attention_maps(uniform, token_ids()))


def sdpa_calls(m, idx) -> int:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        m(idx)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")


def test_local_layers_run_fused_with_the_window_mask():
    idx = token_ids()
    m = small_model(n_layer=4, layer_pattern="LLLG", window=5)
    assert sdpa_calls(m, idx) == 4  # every layer through SDPA, the local ones with the window's mask
    with torch.no_grad():
        fused = m(idx)
        for b in m.blocks:
            b.attn.use_fused = False
        torch.testing.assert_close(fused, m(idx), atol=2e-5, rtol=1e-5)  # the explicit maps agree
    hybrid = small_model(n_layer=4, attn_op="kernel", layer_pattern="GGGS", pattern_ops="S:softmax")
    assert sdpa_calls(hybrid, idx) == 1  # the softmax layer only


def test_an_all_local_pattern_is_the_windowed_model_and_no_pattern_is_the_plain_model():
    idx = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(small_model(layer_pattern="L", window=6)(idx), small_model(window=6)(idx),
                                   atol=0, rtol=0)
        torch.testing.assert_close(small_model(layer_pattern="G")(idx), small_model()(idx), atol=0, rtol=0)
        assert not torch.allclose(small_model(layer_pattern="LG", window=6)(idx), small_model(window=6)(idx))


def test_the_ops_of_a_pattern_own_their_knobs():
    m = small_model(attn_op="kernel", kernel_map="mlp", layer_pattern="GS", pattern_ops="S:softmax",
                    sink_logit="learned")
    assert isinstance(m.blocks[1].attn.op, LearnedSinkLogitSoftmax)
    assert type(m.blocks[0].attn.op).__name__ == "MLPKernel"
    assert not m.cfg.row_normalised  # the kernel layer's rows do not sum to one: the metric adds Sink*
    assert small_model(layer_pattern="LG", window=4).cfg.row_normalised


@pytest.mark.parametrize("overrides,message", [
    (dict(layer_pattern="LxG", window=4), "model.layer_pattern='LxG' must be capital letters"),
    (dict(layer_pattern="LLG", window=4), "model.layer_pattern=LLG has 3 letters, more than model.n_layer=2"),
    (dict(layer_pattern="LG"), "model.layer_pattern=LG has local layers (L) but model.window is null"),
    (dict(layer_pattern="GG", window=4), "model.window=4 is used by no layer of model.layer_pattern=GG"),
    (dict(layer_pattern="GS"), "model.layer_pattern=GS: letter S is not defined"),
    (dict(layer_pattern="GG", pattern_ops="S:softmax"),
     "model.pattern_ops defines S, which model.layer_pattern=GG never uses"),
    (dict(pattern_ops="S:softmax"), "model.layer_pattern is null"),
    (dict(layer_pattern="GS", pattern_ops="S:soft"),
     "model.pattern_ops='S:soft': 'soft' is not an attention op; allowed: "),
    (dict(layer_pattern="GL", pattern_ops="L:kernel", window=4), "'L:kernel' must be LETTER:op"),
    (dict(layer_pattern="GK", pattern_ops="K:kernel", pos="alibi"),
     "layer kind K of model.layer_pattern=GK: model.attn_op=kernel has no logits to add a model.pos=alibi bias to"),
    (dict(kernel_map="mlp", layer_pattern="GG"), "model.kernel_map=mlp applies to model.attn_op=kernel only"),
])
def test_bad_patterns_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**SMALL, **overrides})
    assert_one_line_error(err, message)


def test_export_hf_refuses_a_pattern():
    cfg = ModelConfig(**{**SMALL, "layer_pattern": "LG", "window": 4})
    assert "model.layer_pattern=LG (LLaMA needs null)" in cfg.llama_mismatches()


@pytest.mark.parametrize("option,pattern,sink", [("alternating", "LG", "none"), ("gpt_oss", "LG", "learned"),
                                                 ("gemma3", "LLLLLG", "none"), ("hybrid", "GGS", "none")])
def test_the_presets_compose_and_build(option, pattern, sink):
    from omegaconf import OmegaConf

    from sinklab.config import compose

    model = OmegaConf.to_container(compose([f"model/layers={option}", "model.n_layer=6"]).model)
    assert (model["layer_pattern"], model["sink_logit"]) == (pattern, sink)
    m = ModelConfig(**{**model, "vocab_size": 97}).build()
    assert [b.attn.local for b in m.blocks] == [pattern[i % len(pattern)] == "L" for i in range(6)]
