"""A retrofit's training (sinklab/train/optim.py, module.py, entry.py): the parameters it added have their own
parameter groups and lr (`optim.new_lr_scale`), the copied ones can be frozen for the whole run or for the first N
steps (`optim.freeze_pretrained`, `optim.freeze_pretrained_steps`: DSA's two stages in one run), with AdamW and with
Muon; and a real `sinklab-train init_from=RUN` that adds a gate and freezes the rest trains the gate alone, which a
resume keeps so."""
import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import ModelConfig
from sinklab.train.module import LitLM, optimizer_config
from tests.helpers import SMALL, token_ids, train

GATED = {**SMALL, "gate": "headwise", "gate_act": "scaled_sigmoid"}
NEW = [f"blocks.{i}.attn.gate_proj.weight" for i in range(2)]


def built(optim: dict, new_params=NEW, max_steps: int = 10, **model) -> tuple[LitLM, dict]:
    torch.manual_seed(0)
    module = LitLM(ModelConfig(**{**GATED, **model}), {"warmup_steps": 0, "schedule": "constant", **optim}, max_steps,
                   new_params=new_params)
    return module, module.configure_optimizers()


def train_steps(module: LitLM, opt: dict, n: int) -> list[dict[str, torch.Tensor]]:
    """n steps of the next-token loss as Lightning runs them (closure, then the scheduler); the weights after each."""
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    idx = token_ids(B=4, T=25)
    after = []
    for _ in range(n):
        def closure():
            optimizer.zero_grad()
            loss = module.loss(idx)
            loss.backward()
            return loss
        optimizer.step(closure)
        scheduler.step()
        after.append({k: v.detach().clone() for k, v in module.net.named_parameters()})
    return after


def test_new_parameters_take_their_own_groups_and_lr():
    module, opt = built({"lr": 1e-3, "new_lr_scale": 10.0})
    groups = {g["name"]: g for g in opt["optimizer"].param_groups}
    assert set(groups) == {"pretrained", "new"}
    assert groups["new"]["lr"] == pytest.approx(1e-2) and groups["pretrained"]["lr"] == pytest.approx(1e-3)
    params = dict(module.net.named_parameters())
    assert {id(p) for p in groups["new"]["params"]} == {id(params[n]) for n in NEW}
    assert len(groups["pretrained"]["params"]) == len(params) - len(NEW)
    plain = LitLM(ModelConfig(**GATED), {}, 10).configure_optimizers()["optimizer"]  # no retrofit: one group, no name
    assert len(plain.param_groups) == 1 and "name" not in plain.param_groups[0]


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_freeze_pretrained_trains_only_the_new_parameters(optim):
    target = {"muon": {"_target_": "sinklab.train.muon.muon"}, "adamw": {}}[optim]
    module, opt = built({**target, "lr": 1e-2, "freeze_pretrained": True})
    before = {k: v.detach().clone() for k, v in module.net.named_parameters()}
    assert [n for n, p in module.net.named_parameters() if p.requires_grad] == NEW
    trained = {id(p) for g in opt["optimizer"].param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in module.net.named_parameters() if n in NEW}
    (after,) = train_steps(module, opt, 1)
    for name, value in after.items():
        assert torch.equal(value, before[name]) == (name not in NEW), name


def test_muon_without_a_hidden_matrix_to_train_is_adamw_alone():
    """A frozen model whose only new parameter is a sink logit: Muon has nothing to train, AdamW the sink logit."""
    module, opt = built({"_target_": "sinklab.train.muon.muon", "freeze_pretrained": True},
                        new_params=["blocks.0.attn.op.sink_logit", "blocks.1.attn.op.sink_logit"], gate="none",
                        gate_act="sigmoid", sink_logit="learned")
    assert list(opt["optimizer"].parts) == ["adamw"]
    (after,) = train_steps(module, opt, 1)
    assert not torch.equal(after["blocks.0.attn.op.sink_logit"], torch.zeros(4))


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_freeze_for_the_first_steps_then_train_on_a_schedule_of_their_own(optim):
    """freeze_pretrained_steps=2: the copied weights bit for bit through steps 0 and 1 (lr exactly 0), moving from
    step 2, where their own warmup starts; the new ones move from step 0 on the run's schedule."""
    target = {"muon": {"_target_": "sinklab.train.muon.muon"}, "adamw": {}}[optim]
    module, opt = built({**target, "lr": 1e-2, "freeze_pretrained": True, "freeze_pretrained_steps": 2,
                         "warmup_steps": 2})
    before = {k: v.detach().clone() for k, v in module.net.named_parameters()}
    lrs, after = [], []
    for _ in range(4):
        lrs.append({g["retrofit"]: g["lr"] for g in opt["optimizer"].param_groups})
        after += train_steps(module, opt, 1)
    assert [lr["pretrained"] for lr in lrs] == pytest.approx([0, 0, 5e-3, 1e-2])
    assert [lr["new"] for lr in lrs] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    copied = [n for n in before if n not in NEW]
    assert [all(torch.equal(w[n], before[n]) for n in copied) for w in after] == [True, True, False, False]
    assert not any(torch.equal(after[0][n], before[n]) for n in NEW)


def test_freeze_pretrained_steps_needs_freeze_pretrained():
    with pytest.raises(UserError, match=r"^optim.freeze_pretrained_steps=5 applies with optim.freeze_pretrained=true "
                                        r"only; allowed: freeze_pretrained=true, or freeze_pretrained_steps=null$"):
        optimizer_config({"freeze_pretrained_steps": 5})


def weights(run_dir) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def test_init_from_with_an_added_gate_and_frozen_weights_trains_the_gate_alone(tmp_path):
    """sinklab-train init_from=RUN model.gate=headwise model.gate_act=scaled_sigmoid optim.freeze_pretrained=true: the
    log names the addition and how it starts; after 3 steps every weight copied from RUN is RUN's, bit for bit, and
    the gate (started at zero) has moved; the checkpoint keeps the new parameters' names, so a resume trains the gate
    alone too."""
    base = train(tmp_path / "base", "trainer.max_steps=2").dir
    gate = ("model.gate=headwise", "model.gate_act=scaled_sigmoid", "optim.freeze_pretrained=true",
            "optim.new_lr_scale=10")
    warm = train(tmp_path / "gated", f"init_from={base}", *gate, "trainer.max_steps=3").dir
    log = (warm / "train.log").read_text()
    assert f"init_from={base}: a retrofit, this config adds model.gate=headwise (the identity at step 0; " in log, log
    assert "2 new parameter tensor(s), trained at 10 x optim.lr; the copied ones frozen (the whole run)" in log
    saved, now = weights(base), weights(warm)
    assert set(now) - set(saved) == set(NEW)
    assert all(torch.equal(now[k], v) for k, v in saved.items())
    assert all(now[k].abs().min() > 0 for k in NEW)
    hparams = torch.load(warm / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["hyper_parameters"]
    assert hparams["new_params"] == NEW
    train(warm, f"init_from={base}", *gate, "trainer.max_steps=4", "ckpt_path=last")
    resumed = weights(warm)
    assert all(torch.equal(resumed[k], v) for k, v in saved.items())
    assert not any(torch.equal(resumed[k], now[k]) for k in NEW)

