"""sinklab eval intervene: the interventions do what they say (a key masked for every query and path, the massive
activations found and overwritten where they are), and the command's table, JSON and errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sinklab.evals.interventions import drop_first_key, drop_random_key, find_massive, residuals
from sinklab.metrics import SinklabRecorder, attention_maps
from sinklab.model import ModelConfig, Transformer
from sinklab.targets import SinklabTarget
from tests.helpers import (HF_KINDS, assert_one_line_error, natural_run, run_cli, save_ckpt, small_model,
                           token_ids)


@pytest.mark.parametrize("case", [{}, {"n_sink_tokens": 1}, {"attn_op": "sigmoid"}], ids=["softmax", "sinks", "sigmoid"])
def test_masking_the_first_key_removes_its_column_on_every_path(case):
    m = small_model(**case)
    idx = token_ids(B=2, T=12)
    S = m.cfg.n_sink_tokens
    plain = m(idx)
    mask = drop_first_key(S)
    fused = m(idx, extra_mask=mask)  # the fused kernel (softmax) must take the mask: no is_causal shortcut
    explicit = small_model(**case, attn_backend="explicit")(idx, extra_mask=mask)
    torch.testing.assert_close(fused, explicit, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(fused, plain, atol=1e-3)
    for a in attention_maps(m, idx, extra_mask=mask):  # (B, H, S + T, n_keys)
        assert (a[:, :, S + 1:, S] == 0).all() and (a[:, :, S, S] > 0).all()
        if m.cfg.row_normalised:  # softmax renormalises over the remaining keys
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
    torch.testing.assert_close(m(idx), plain, atol=0, rtol=0)  # the model itself is unchanged


def test_the_random_control_drops_one_earlier_key_per_query():
    m = small_model()
    idx = token_ids(B=1, T=12)
    before = attention_maps(m, idx)
    after = attention_maps(m, idx, extra_mask=drop_random_key(0, 12, seed=3, device=idx.device))
    zeros = (after[0][0, 0] == 0) & (before[0][0, 0] > 0)  # (T, T) newly zero entries, head 0
    assert zeros[:2].sum() == 0  # queries 1 and 2 have no key other than token 1 and themselves
    for q in range(2, 12):
        (dropped,) = torch.nonzero(zeros[q]).flatten().tolist()
        assert 1 <= dropped < q  # not the first token, not itself
    assert len({int(torch.nonzero(zeros[q])[0]) for q in range(5, 12)}) > 1  # random, not a fixed column


def massive_model(channel: int = 5, token_id: int = 7) -> Transformer:
    """Token id 7 carries 80 in one embedding channel: a massive activation at its position from layer 1 on."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)).eval()
    with torch.no_grad():
        m.tok_emb.weight[token_id, channel] = 80.0
        m.tok_emb.weight[token_id, channel + 1] = -40.0
    return m


def test_find_massive_locates_the_planted_channels_and_set_activations_overwrites_them():
    m = massive_model()
    probe = token_ids(B=6, T=16, seed=1)
    probe[:, 2] = 7  # token 3 of every sequence
    target = SinklabTarget.of_model(m)
    found = find_massive(target, probe, n_channels=2)
    assert (found["layer"], found["token"], found["channels"]) == (0, 3, [5, 6])
    assert found["mean_values"][0] > 70 and found["mean_values"][1] < -30 and found["ratio"] > 20
    def first_layer_h() -> torch.Tensor:
        layers = {}
        with SinklabRecorder(m).hooks({"h"}, lambda i, rec: layers.__setitem__(i, rec["h"])), torch.no_grad():
            m(probe)
        return layers[0]
    with target.set_output(0, 2, [5, 6], torch.tensor([0.0, 1.5])):
        h = first_layer_h()
    assert (h[:, 2, 5] == 0).all() and (h[:, 2, 6] == 1.5).all()
    assert (first_layer_h()[:, 2, 5] > 70).all()  # the hook is gone
    with pytest.raises(Exception, match="--channels 40 must be in 1..32"):
        find_massive(target, probe, n_channels=40)


def test_intervene_command_table_and_json(small_run, capsys):
    run, dm, _ = small_run
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    rows = res["rows"]
    assert list(rows) == ["none", "zero", "mean", "mask_first", "mask_random", "zero_value_first"]
    assert res["layers"] == [0, 1] and "per_layer" not in res and "per_head" not in res
    assert rows["none"]["dppl"] == 0 and all(r["ppl"] > 1 for r in rows.values())
    assert res["val_targets"] == 2 * 32 and res["probe"] == {"num_seqs": 10, "seq_len": 16}
    # under mask_first only query 1 attends to token 1, with weight 1: alpha_1 = 1 / T exactly
    assert rows["mask_first"]["alpha1"] == pytest.approx(1 / 16, abs=1e-6) and rows["mask_first"]["sink1"] == 0
    assert rows["none"]["alpha1"] > 1 / 16 and rows["mask_random"]["alpha1"] >= rows["none"]["alpha1"]
    assert 0 <= res["massive"]["layer"] < 2 and 1 <= res["massive"]["token"] <= 16
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--interventions", "mask_first", capsys=capsys)
    assert rc == 0, err
    assert "massive activations: layer" in out and [line.split()[0] for line in out.splitlines()[-2:]] == \
        ["none", "mask_first"]


@pytest.mark.parametrize("args,message", [(["--channels", "0"], "--channels 0 must be in 1..32"),
                                          (["--val-batches", "0"], "--val-batches 0 must be a positive integer"),
                                          (["--interventions", "drop"], "invalid choice: 'drop'")])
def test_intervene_refuses_bad_input_in_one_line(small_run, capsys, args, message):
    run, _, _ = small_run
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), *args, capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, message)


def test_intervene_needs_a_run_dir(tmp_path, capsys):
    ckpt = save_ckpt(small_model(), tmp_path / "m.ckpt")
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(ckpt), capsys=capsys)
    assert rc == 2 and "has no run config" in err


def test_validation_blocks_get_the_bos_token_the_model_was_trained_with(tmp_path):
    from omegaconf import OmegaConf

    from sinklab.runs.run_data import read_run_data, val_blocks

    run, dm = natural_run(tmp_path)
    plain = val_blocks(dm, None)
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg.data.bos = True
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    with_bos = read_run_data(run, {"num_workers": 0}, lambda d: val_blocks(d, None), "T", "w", "h")
    assert len(with_bos) == len(plain) and with_bos[0].shape == plain[0].shape
    assert (with_bos[0][:, 0] == dm.eos_id).all()
    torch.testing.assert_close(with_bos[0][:, 1:], plain[0][:, :-1])


# ------------------------------------------------------------------------------------------------ transformers models
@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_interventions_on_every_architecture(capsys, hf_models, tmp_path, kind):
    """The first key masked through transformers' attention interface: the eager maps lose column 1 for every later
    query (query 1 keeps it: alpha_1 = 1 / T exactly without sink logits), the model is eager again after; the
    command's table on --tokens."""
    import transformers

    from sinklab.targets import TransformersTarget
    from sinklab.targets.transformers_lm import load_hf_model
    from sinklab.targets.transformers_masking import masked_attention

    model = load_hf_model(hf_models[kind])
    idx = token_ids(B=2, T=16, vocab=128)
    with torch.no_grad():
        plain = model(input_ids=idx, output_attentions=True)
        with masked_attention(model, drop_first_key(0)):
            masked = model(input_ids=idx, output_attentions=True)
        again = model(input_ids=idx).logits
    for a in masked.attentions:  # (B, H, T, T)
        assert (a[:, :, 1:, 0] == 0).all() and (a[:, :, 0, 0] > 0).all()
    assert not torch.allclose(masked.logits, plain.logits, atol=1e-4)
    torch.testing.assert_close(again, plain.logits, atol=0, rtol=0)
    assert model.config._attn_implementation == "eager"
    target = TransformersTarget.of_model(model, str(hf_models[kind]))
    with torch.no_grad(), target.set_output(0, 3, [1, 2], torch.tensor([0.0, 5.0])):
        h = residuals(target, idx)[0]
    assert (h[:, 3, 1] == 0).all() and (h[:, 3, 2] == 5).all()
    assert isinstance(model, transformers.PreTrainedModel)

    np.save(tmp_path / "v.npy", token_ids(B=8, T=17, vocab=128, seed=2).numpy())
    rc, out, err = run_cli("sinklab", "eval", "intervene", "--hf-model", str(hf_models[kind]), "--tokens",
                           str(tmp_path / "v.npy"), "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert list(res["rows"]) == ["none", "zero", "mean", "mask_first", "mask_random", "zero_value_first"]
    assert res["source"] == "hf" and res["rows"]["zero_value_first"]["dppl"] != 0
    assert res["probe"] == {"num_seqs": 8, "seq_len": 16} and res["val_targets"] == 8 * 16
    if kind != "gpt_oss":  # (gpt-oss's sink logit takes part of query 1's attention)
        assert res["rows"]["mask_first"]["alpha1"] == pytest.approx(1 / 16, abs=1e-6)
    assert res["rows"]["none"]["alpha1"] > res["rows"]["mask_first"]["alpha1"]
    assert all(np.isfinite(r["ppl"]) for r in res["rows"].values())
