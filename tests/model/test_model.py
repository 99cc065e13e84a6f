"""Foundation checks of the default LLaMA2-style model."""
import math

import pytest
import torch

from sinklab.metrics import attention_maps

from sinklab.model import PRESETS, ConfigError, ModelConfig, Transformer, preset
from tests.helpers import small_model


def test_shapes_and_default_architecture():
    m = small_model()
    idx = torch.randint(0, 97, (3, 24))
    assert m(idx).shape == (3, 24, 97)
    assert m(idx, return_hidden=True).shape == (3, 24, 32)
    # LLaMA2 style: RMSNorm, SwiGLU, RoPE, no linear biases, untied head
    assert type(m.blocks[0].norm1).__name__ == "RMSNorm" and m.blocks[0].norm1.eps == 1e-5
    assert m.blocks[0].ffn.gated and type(m.pos).__name__ == "Rotary"
    assert all(lin.bias is None for lin in m.modules() if isinstance(lin, torch.nn.Linear))
    assert m.lm_head.weight.data_ptr() != m.tok_emb.weight.data_ptr()


def test_init_std_matches_reference():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=4000, n_layer=1, n_head=4, d_model=256, d_ff=512))
    assert abs(m.tok_emb.weight.std().item() - math.sqrt(2 / (5 * 256))) < 2e-3
    assert abs(m.blocks[0].attn.q_proj.weight.std().item() - math.sqrt(2 / (5 * 256))) < 3e-3


def test_causality():
    m = small_model()
    idx = torch.randint(0, 97, (2, 24))
    ref = m(idx)
    changed = idx.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 97
    out = m(changed)
    torch.testing.assert_close(out[:, :15], ref[:, :15])
    assert (out[:, 15:] - ref[:, 15:]).abs().max() > 1e-4


def test_fused_and_explicit_paths_agree():
    m = small_model()
    idx = torch.randint(0, 97, (2, 24))
    fused = m(idx)
    explicit = small_model(attn_backend="explicit")(idx)
    probs = attention_maps(m, idx)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert len(probs) == 2 and probs[0].shape == (2, 4, 24, 24)
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2, 4, 24))


def test_size_presets():
    assert set(PRESETS) == {"tiny", "tiny3", "14m", "60m", "1b", "smollm2_135m"}
    assert (preset("tiny3").n_layer, preset("tiny3").n_head) == (3, 8)  # the default run's (scale=quick)
    cfg = preset("60m", vocab_size=50432)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model, cfg.d_ff, cfg.block_size) == (10, 8, 768, 1536, 2048)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert 55e6 < m.num_params() < 65e6  # ~60M without embeddings, as in the paper
    big = preset("1b")
    assert (big.n_layer, big.n_head, big.d_model, big.d_ff) == (22, 16, 2048, 5632)


@pytest.mark.parametrize("bad,match", [
    (dict(n_head=5), "n_head=5 does not divide"),
    (dict(window=100), "window=100 exceeds"),
    (dict(prefix_len=24), "prefix_len=24 must be smaller"),
    (dict(pos="rotary"), "model.pos='rotary' is not supported; allowed: nope, sinusoidal"),
    (dict(n_head=8, d_model=24), "needs an even head size"),
    (dict(attn_bias_fixed_value_scale=5.0, attn_bias="kv"), "applies to model.attn_bias=k only, got attn_bias=kv"),
    (dict(attn_bias_fixed_value_scale=-1.0, attn_bias="k"), "attn_bias_fixed_value_scale=-1.0 is the norm.*>= 0"),
    (dict(rope_base=0.0), "model.rope_base=0.0 must be > 0"),
    (dict(rope_base=-10000.0), "model.rope_base=-10000.0 must be > 0"),
    (dict(norm_eps=0.0), "model.norm_eps=0.0 must be > 0"),
    (dict(norm="layer", norm_eps=-1e-5), "model.norm_eps=-1e-05 must be > 0"),
    (dict(pos="relative", relative_max_distance=16), "relative_max_distance=16 must exceed the 16 exact.*> 16"),
    (dict(pos="relative", relative_buckets=2), "model.relative_buckets=2 must be an integer >= 4"),
    (dict(relative_buckets=2), "relative_buckets=2 applies to model.pos=relative only, got pos=rope"),
    (dict(sigmoid_bias=-2.0), "sigmoid_bias=-2.0 applies to model.attn_op=sigmoid only, got attn_op=softmax"),
    (dict(attn_op="elu", sigmoid_bias=1.0), "sigmoid_bias=1.0 applies to model.attn_op=sigmoid only"),
    (dict(attn_bias_shared=True), "attn_bias_shared=true applies to model.attn_bias=k, kv, v only, got attn_bias=none"),
    (dict(kernel_map="mlp"), "kernel_map=mlp applies to model.attn_op=kernel only, got attn_op=softmax"),
    (dict(attn_op="sigmoid", kernel_map="identity"), "kernel_map=identity applies to model.attn_op=kernel only"),
    (dict(attn_op="sigmoid", sink_logit="learned"), "sink_logit=learned applies to model.attn_op=softmax only, got attn_op=sigmoid"),
    (dict(attn_op="softpick", sink_logit="zero"), "sink_logit=zero applies to model.attn_op=softmax only, got attn_op=softpick"),
    (dict(attn_op="kernel", pos="alibi"), "attn_op=kernel has no logits to add a model.pos=alibi bias"),
    (dict(attn_op="kernel", pos="relative"), "attn_op=kernel has no logits to add a model.pos=relative bias"),
    (dict(attn_normalize=True), "attn_normalize=true applies to model.attn_op=.*sigmoid.* only, got attn_op=softmax"),
    (dict(attn_op="softpick", attn_normalize=True), "attn_normalize=true applies to .* only, got attn_op=softpick"),
    (dict(softmax_scale=0.0), "model.softmax_scale=0.0 must be > 0"),
    (dict(n_sink_tokens=-1), "model.n_sink_tokens=-1 must be >= 0"),
    (dict(n_kv_head=3), "model.n_kv_head=3 must divide model.n_head=4"),
    (dict(pos="sinusoidal", n_head=1, d_model=31), "pos=sinusoidal needs an even d_model, got 31"),
    (dict(vocab_size=0), "model.vocab_size=0 must be a positive integer"),
    (dict(window=0), "model.window=0 must be a positive integer or null"),
])
def test_impossible_configs_are_refused(bad, match):
    from tests.helpers import SMALL

    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**SMALL, **bad}).validate()


@pytest.mark.parametrize("ok", [
    dict(attn_bias="k", attn_bias_fixed_value_scale=0.0),  # the paper's zero value
    dict(attn_bias="v", attn_bias_shared=True), dict(attn_bias="k", attn_bias_shared=True),
    dict(attn_op="sigmoid", sigmoid_bias=-3.0), dict(attn_op="kernel", kernel_map="mlp"),
    dict(pos="relative", relative_buckets=32, relative_max_distance=17, prefix_len=4),
])
def test_neighbouring_valid_configs_are_accepted(ok):
    from tests.helpers import SMALL

    ModelConfig(**{**SMALL, **ok}).validate()


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="unknown model option.*model.n_layers"):
        ModelConfig.from_dict({"n_layers": 3})


def test_vocab_size_comes_from_the_data_unless_set():
    cfg = preset("tiny")
    assert cfg.vocab_size is None
    with pytest.raises(ConfigError, match="model.vocab_size is null"):
        Transformer(cfg)
