"""A retrofit (sinklab/model/retrofit.py): `init_from=` a trained model with a config that adds a component. Every
component a retrofit can add is built into a small model, saved as a checkpoint, and warm-started through what
`init_from=` runs (`warm_start_checkpoint`, then `copy_weights` into a model of this config drawn from another seed):
where the component says it starts as the identity, the logits equal the checkpoint model's at step 0: bit for bit
through the same kernels (every layer's explicit path), and to TOL through the default ones (a component computed on
the explicit path against the checkpoint model's fused softmax); where it says not, they differ by more. What is not
an addition (another size, a gate of another kind, a component removed) is refused in one line."""
from pathlib import Path

import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import ModelConfig, Transformer
from sinklab.model.registry import ATTENTION_OPS, ATTN_BIASES, GATES, SPARSITIES
from sinklab.model.retrofit import plan
from sinklab.runs.checkpoints import copy_weights, warm_start_checkpoint
from tests.helpers import SMALL, case_id, component_cases, covering, explicit_logits, save_ckpt, small_model, token_ids

TOL = 1e-5  # float32 rounding of logits of size ~1 through different kernels (measured: 1.1e-6)


def retrofit_cases() -> list[dict]:
    """The additions to SMALL (the checkpoint's model) that a retrofit takes: every registered component's contract
    cases that `plan` reads as additions only, each value of their knobs (covering), the base fields, and settings
    on either side of each component's identity condition."""
    def only_additions(case: dict) -> bool:
        added, other = plan(ModelConfig(**SMALL), ModelConfig(**{**SMALL, **case}))
        return bool(added) and not other

    return covering([c for c in component_cases() if only_additions(c)]) + [
        {"window": 24}, {"window": 8}, {"n_sink_tokens": 2}, {"rope_heads": 4}, {"nope_every": 2},
        {"sparsity": "topk", "topk_k": 24}, {"sparsity": "moba", "moba_topk": 3},
        {"sparsity": "ashape", "ashape_window": 20, "ashape_first": 4},
        {"sparsity": "bigbird", "bigbird_block": 4}, {"attn_op": "dsa", "dsa_warmup_steps": 0, "dsa_topk": 24},
        {"attn_op": "nsa", "nsa_window": 24, "nsa_slc_topn": 3},
        {"gate": "elementwise", "gate_position": "G5", "gate_act": "scaled_sigmoid"}]


CASES = retrofit_cases()


def retrofitted(src: dict, added: dict, path: Path) -> tuple[Transformer, Transformer, list]:
    """The checkpoint's model (SMALL + src, seed 0) and this config's (+ added), warm-started from its checkpoint into
    a model drawn from seed 1 (so every weight it keeps from its own draw shows); both in eval mode."""
    base = small_model(**src)
    ckpt = save_ckpt(base, path / "src.ckpt")
    cfg = ModelConfig(**{**SMALL, **src, **added})
    warm = warm_start_checkpoint(ckpt, cfg.to_dict())
    torch.manual_seed(1)
    model = Transformer(cfg)
    copy_weights(model, warm, ckpt)
    return base, model.eval(), warm.additions


def max_diff(a: Transformer, b: Transformer, explicit: bool = False) -> float:
    idx = token_ids()
    with torch.no_grad():
        if explicit:
            return (explicit_logits(a, idx) - explicit_logits(b, idx)).abs().max().item()
        return (a(idx) - b(idx)).abs().max().item()


def test_every_gate_bias_and_sparsity_says_how_a_retrofit_starts_it():
    """sinklab's own gates, attention biases and sparsities (families whose default is "none") can each be added to a
    trained model, and say how they start; so do the ops a retrofit adds to softmax."""
    for registry in (GATES, ATTN_BIASES, SPARSITIES):
        assert all(cls.retrofit for cls in registry if cls.name != "none"), registry.key
    assert all(ATTENTION_OPS.selected(ModelConfig(**{**SMALL, **c})).retrofit for c in (
        {"attn_op": "dsa"}, {"attn_op": "nsa", "nsa_slc_topn": 3}, {"sink_logit": "learned"}, {"sink_logit": "zero"}))
    assert {c.get("gate") for c in CASES} >= {"headwise", "elementwise", "vga"}


@pytest.mark.parametrize("added", CASES, ids=case_id)
def test_a_retrofit_starts_as_its_component_says(added, tmp_path):
    base, model, additions = retrofitted({}, added, tmp_path)
    assert additions and all(a.how for a in additions)
    diff = max_diff(base, model)
    if all(a.identity for a in additions):
        assert diff <= TOL and max_diff(base, model, explicit=True) == 0, (additions, diff)
    else:
        assert diff > 100 * TOL, (additions, diff)


@pytest.mark.parametrize("added", [{"gate": "headwise", "gate_act": "scaled_sigmoid"},
                                   {"gate": "elementwise", "gate_position": "G2", "gate_act": "scaled_sigmoid"},
                                   {"attn_bias": "v"}], ids=case_id)
def test_a_gate_and_a_v_bias_start_as_the_identity_exactly(added, tmp_path):
    """Scores 2 sigmoid(0) = 1, a zero V bias: the same logits, every bit, through the default kernels too."""
    base, model, (addition,) = retrofitted({}, added, tmp_path)
    assert "exactly" in addition.how and max_diff(base, model) == 0


def test_the_sink_logit_starts_at_minus_30(tmp_path):
    _, model, (added,) = retrofitted({}, {"sink_logit": "learned"}, tmp_path)
    assert added.identity and "-30" in added.how
    assert all(bool((b.attn.op.sink_logit == -30.0).all()) for b in model.blocks)


def test_dsa_is_the_identity_in_its_warm_up_and_sparse_after_it(tmp_path):
    """DSA (the paper's own retrofit): dense while step < dsa_warmup_steps, the checkpoint's logits; from the first
    sparse step on, the top-k of a fresh indexer, not them."""
    base, model, (added,) = retrofitted({}, {"attn_op": "dsa", "dsa_warmup_steps": 5, "dsa_topk": 8}, tmp_path)
    assert added.identity and max_diff(base, model) <= TOL
    model.set_step(5)
    assert max_diff(base, model) > 100 * TOL


def test_nsa_starts_from_the_layers_own_keys(tmp_path):
    """NSA's start: gates 1/2 (zero weights), compressed values zero, the window's projections the layer's; with a
    QK-norm the window branch's keys are not the layer's, so it is not the identity even where every key is seen."""
    _, model, _ = retrofitted({}, {"attn_op": "nsa", "nsa_slc_topn": 2, "nsa_force_local": 1}, tmp_path)
    attn = model.blocks[0].attn
    assert torch.equal(attn.op.k_win_proj.weight, attn.k_proj.weight)
    assert torch.equal(attn.op.v_win_proj.weight, attn.v_proj.weight)
    assert not attn.op.gate_proj.weight.any() and not attn.op.compress_v.mlp[-1].weight.any()
    base, model, (added,) = retrofitted({"qk_norm": "rms"}, {"attn_op": "nsa", "nsa_window": 24, "nsa_slc_topn": 3},
                                        tmp_path)
    assert not added.identity and max_diff(base, model) > 100 * TOL


def test_a_component_without_an_identity_keeps_its_fresh_init(tmp_path):
    """A K bias slot cannot start as the identity: it keeps the draw of this run's seed (N(0, bias_init_std)), and
    every weight of the checkpoint is copied."""
    base, model, (added,) = retrofitted({}, {"attn_bias": "k"}, tmp_path)
    assert not added.identity and added.key == "attn_bias"
    torch.manual_seed(1)
    fresh = Transformer(ModelConfig(**{**SMALL, "attn_bias": "k"}))
    assert torch.equal(model.blocks[1].attn.attn_bias.k_bias, fresh.blocks[1].attn.attn_bias.k_bias)
    for name, value in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("src,added,shown", [
    ({}, {"n_layer": 3}, "model.n_layer=2 there, 3 here"),
    ({}, {"d_model": 64}, "model.d_model=32 there, 64 here"),
    ({"gate": "elementwise"}, {"gate": "headwise"}, "model.gate='elementwise' there, 'headwise' here"),
    ({"sink_logit": "learned"}, {"sink_logit": "none"}, "model.sink_logit='learned' there, 'none' here"),
    ({"window": 8}, {"window": 16}, "model.window=8 there, 16 here"),
    ({}, {"attn_op": "sigmoid"}, "model.attn_op='softmax' there, 'sigmoid' here"),
    ({}, {"gate": "headwise", "n_head": 2}, "(model.n_head=4 there, 2 here)"),
], ids=["n_layer", "d_model", "another_gate", "removed", "other_window", "other_op", "added_and_other"])
def test_another_architecture_is_refused_in_one_line(src, added, shown, tmp_path):
    ckpt = save_ckpt(small_model(**src), tmp_path / "src.ckpt")
    with pytest.raises(UserError) as err:
        warm_start_checkpoint(ckpt, ModelConfig(**{**SMALL, **src, **added}).to_dict())
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"init_from={ckpt}: its model differs from this run's")
    assert shown in message and "it may add components" in message


def test_a_dsa_checkpoint_warm_starts_without_its_step(tmp_path):
    """A DSA model's state holds its step (extra state, not a tensor): a warm start into the same architecture copies
    the weights and leaves the step to the new run (it starts dense again)."""
    base = small_model(attn_op="dsa", dsa_topk=8)
    base.set_step(500)
    ckpt = save_ckpt(base, tmp_path / "dsa.ckpt")
    warm = warm_start_checkpoint(ckpt, base.cfg.to_dict())
    assert warm.additions == [] and warm.new_params == []
    model = Transformer(base.cfg)
    copy_weights(model, warm, ckpt)
    assert model.blocks[0].attn.op.step == 0
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))


def test_the_new_parameters_are_named_before_the_model_is_built(tmp_path):
    ckpt = save_ckpt(small_model(), tmp_path / "src.ckpt")
    warm = warm_start_checkpoint(ckpt, ModelConfig(**{**SMALL, "gate": "headwise", "sink_logit": "learned"}).to_dict())
    assert warm.new_params == [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("gate_proj.weight", "op.sink_logit")]
    assert [a.key for a in warm.additions] == ["sink_logit", "gate"]
