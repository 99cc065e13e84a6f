"""optim=muon (sinklab/train/muon.py): which parameters Muon takes, the combined optimizer against torch's Muon and
AdamW stepped by hand, its state dict, the schema's refusals, and one short training run resumed from its checkpoint."""
import copy

import pytest
import torch

from sinklab.train.module import optimizer_config
from sinklab.train.muon import MuonWithAdamW, hidden_matrices, muon
from tests.helpers import rows, small, small_model, token_ids, train, write_corpus

KW = dict(lr=2e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, exclude_norm_and_embedding=False, warmup_steps=0,
          schedule="constant", min_lr_ratio=0.1, momentum=0.95, nesterov=True, ns_steps=5,
          adjust_lr_fn="match_rms_adamw")


def loss_of(m, idx):
    return torch.nn.functional.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def step(m, opt, idx):
    def closure():
        opt.zero_grad()
        loss = loss_of(m, idx)
        loss.backward()
        return loss
    return opt.step(closure)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    m = small_model(gate="elementwise", attn_op="differential")
    names = {n for n, _ in hidden_matrices(m)}
    assert names == {f"blocks.{i}.{mod}.weight" for i in range(2) for mod in (
        "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "attn.gate_proj", "ffn.w1", "ffn.w2", "ffn.w3")}
    opt = muon(m, 10, **KW)["optimizer"]
    muon_ids = {id(p) for g in opt.parts["muon"].param_groups for p in g["params"]}
    adamw = {n for n, p in m.named_parameters() if id(p) not in muon_ids}
    assert {"tok_emb.weight", "lm_head.weight", "norm.weight", "blocks.0.norm1.weight", "blocks.0.attn.op.lambda_q1",
            "blocks.1.attn.op.subln.weight"} <= adamw
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(m.parameters())) == len(muon_ids) + len(adamw)


def test_one_optimizer_steps_as_torch_muon_and_adamw_stepped_by_hand():
    """Two steps of MuonWithAdamW through a closure (as Lightning calls it) equal torch.optim.Muon on the hidden
    matrices and torch.optim.AdamW on the rest, stepped by hand; the lr scheduler's warmup reaches both parts."""
    idx = token_ids(B=4, T=25)
    mine, ref = small_model(), small_model()
    built = muon(mine, 10, **{**KW, "warmup_steps": 4})
    opt, sched = built["optimizer"], built["lr_scheduler"]["scheduler"]
    hidden = {n for n, _ in hidden_matrices(ref)}
    params = dict(ref.named_parameters())
    by_hand = [torch.optim.Muon([params[n] for n in hidden], lr=2e-2, weight_decay=0.1,
                                adjust_lr_fn="match_rms_adamw"),
               torch.optim.AdamW([p for n, p in params.items() if n not in hidden], lr=2e-2, betas=(0.9, 0.95),
                                 weight_decay=0.1)]
    for i in range(2):
        step(mine, opt, idx)
        sched.step()
        for o in by_hand:
            for g in o.param_groups:
                g["lr"] = 2e-2 * (i + 1) / 4  # the warmup's factor of step i
            o.zero_grad()
        loss_of(ref, idx).backward()
        for o in by_hand:
            o.step()
    assert all(g["lr"] == pytest.approx(2e-2 * 3 / 4) for part in opt.parts.values() for g in part.param_groups)
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    moved = mine.blocks[0].attn.q_proj.weight - small_model().blocks[0].attn.q_proj.weight
    assert moved.abs().max() > 1e-4


def test_state_dict_round_trip_continues_the_same_steps():
    idx = token_ids(B=4, T=25)
    a = small_model()
    opt_a = muon(a, 10, **KW)["optimizer"]
    step(a, opt_a, idx)
    b = small_model()
    b.load_state_dict(a.state_dict())
    opt_b = muon(b, 10, **KW)["optimizer"]
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # (a state dict holds the state's own tensors)
    step(a, opt_a, idx)
    step(b, opt_b, idx)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    with pytest.raises(Exception, match="optim=muon needs"):
        opt_b.load_state_dict(torch.optim.AdamW(b.parameters()).state_dict())
    assert isinstance(opt_b, torch.optim.Optimizer) and isinstance(opt_b, MuonWithAdamW)


@pytest.mark.parametrize("key,value,words", [("momentum", 1.0, "optim.momentum=1.0 is not allowed"),
                                             ("ns_steps", 0, "optim.ns_steps=0 is not allowed"),
                                             ("lr", -1.0, "optim.lr=-1.0 is not allowed")])
def test_the_schema_refuses_bad_values_in_one_line(key, value, words):
    with pytest.raises(Exception, match=words):
        optimizer_config({"_target_": "sinklab.train.muon.muon", key: value})


@pytest.mark.slow
@pytest.mark.ci
def test_a_muon_run_trains_resumes_and_refuses_an_unknown_adjustment(tmp_path):
    corpus = write_corpus(tmp_path)
    out = tmp_path / "run"
    train(out, *small(corpus, "optim=muon"))
    first = [float(r["train/loss"]) for r in rows(out / "metrics.csv") if r.get("train/loss")]
    assert first[-1] < first[0]
    train(out, *small(corpus, "optim=muon", "trainer.max_steps=12", "ckpt_path=last"))
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 12 and set(ckpt["optimizer_states"][0]) == {"muon", "adamw"}
    bad = train(tmp_path / "bad", *small(corpus, "optim=muon", "optim.adjust_lr_fn=moonshot"), check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "optim.adjust_lr_fn" in bad.stderr and "match_rms_adamw" in bad.stderr
