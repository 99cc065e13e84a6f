"""QK-norm (`model.qk_norm=rms`) beyond the contract tests: it is Qwen3's (transformers' Qwen3ForCausalLM gives the
same logits from the same weights), it makes the logits independent of the scale of the q / k projections, export-hf
refuses it, and off it costs nothing."""
import pytest
import torch

from sinklab.export.llama import llama_config, llama_state_dict
from tests.helpers import small_model, token_ids


def test_qk_norm_is_qwen3s_per_head_rmsnorm_before_rope():
    transformers = pytest.importorskip("transformers")
    m = small_model(qk_norm="rms", n_kv_head=2)
    with torch.no_grad():  # learned scales away from their initial ones, so that a swapped q / k scale shows
        for block in m.blocks:
            block.attn.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
            block.attn.qk_norm.k_norm.weight.uniform_(0.5, 1.5)
    state = m.state_dict()
    norms = {k: v for k, v in state.items() if ".qk_norm." in k}
    hf_state = llama_state_dict({k: v for k, v in state.items() if k not in norms}, m.cfg.n_layer)
    for key, value in norms.items():  # blocks.{i}.attn.qk_norm.q_norm.weight -> model.layers.{i}.self_attn.q_norm...
        layer, which = key.split(".")[1], key.split(".")[4]
        hf_state[f"model.layers.{layer}.self_attn.{which}.weight"] = value
    llama = llama_config(m.cfg, transformers, torch.float32).to_dict()
    cfg = transformers.Qwen3Config(**{k: v for k, v in llama.items() if k not in ("architectures", "model_type")})
    qwen = transformers.Qwen3ForCausalLM(cfg).eval()
    missing, unexpected = qwen.load_state_dict(hf_state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    idx = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(qwen(idx).logits, m(idx), atol=2e-5, rtol=1e-5)
        m.blocks[0].attn.qk_norm.k_norm.weight.mul_(1.1)  # a real change of the key scale shows
        assert (qwen(idx).logits - m(idx)).abs().max() > 1e-4


def test_the_logits_do_not_depend_on_the_scale_of_the_query_and_key_projections():
    idx = token_ids()
    for qk_norm, same in (("rms", True), ("none", False)):
        m = small_model(qk_norm=qk_norm, norm_eps=1e-12)  # an eps that the small init's rms would notice: off
        before = m(idx)
        with torch.no_grad():
            for block in m.blocks:
                block.attn.q_proj.weight.mul_(8.0)
                block.attn.k_proj.weight.mul_(0.25)
        after = m(idx)
        assert torch.allclose(before, after, atol=1e-5) == same, qk_norm


def test_export_hf_refuses_qk_norm_and_off_it_costs_nothing():
    from sinklab.model import ModelConfig

    m = small_model(qk_norm="rms")
    assert "model.qk_norm=rms (LLaMA needs none)" in m.cfg.llama_mismatches()
    assert ModelConfig(vocab_size=97, qk_norm="none").llama_compatible
    plain, off = small_model(), small_model(qk_norm="none")
    idx = token_ids()
    assert torch.equal(plain(idx), off(idx))
    assert not any(".qk_norm." in k for k in off.state_dict())
