"""sinklab quant: fake quantizers against hand-computed grids, calibration, a planted outlier channel, the command
on a real run dir and on transformers models, user errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sinklab.model import Transformer
from sinklab.quant import (SCHEMES, asymmetric_grid, calibrate, evaluate, fake_quantized, quantizable_layers,
                           quantize_asymmetric, quantize_symmetric)
from tests.helpers import HF_KINDS, assert_one_line_error, readme_cli_lines, run_cli, save_ckpt, small_model


# ------------------------------------------------------------------------------------------------ quantizers
def test_symmetric_weights_by_hand():
    w = torch.tensor([[0.6, -1.0], [0.2, 0.05]])
    # per tensor: scale = max |w| / qmax = 1 / 127 (8 bits), 1 / 7 (4 bits); q = round(w / scale)
    # 8 bits: 0.6 * 127 = 76.2 -> 76, 0.2 * 127 = 25.4 -> 25, 0.05 * 127 = 6.35 -> 6
    expect8 = torch.tensor([[76 / 127, -1.0], [25 / 127, 6 / 127]])
    # 4 bits: 0.6 * 7 = 4.2 -> 4, 0.2 * 7 = 1.4 -> 1, 0.05 * 7 = 0.35 -> 0
    expect4 = torch.tensor([[4 / 7, -1.0], [1 / 7, 0.0]])
    torch.testing.assert_close(quantize_symmetric(w, 8), expect8)
    torch.testing.assert_close(quantize_symmetric(w, 4), expect4)
    # per output channel (rows): row 0 as above; row 1 has scale 0.2 / qmax
    # 8 bits: 0.05 / (0.2 / 127) = 31.75 -> 32; 4 bits: 0.05 / (0.2 / 7) = 1.75 -> 2
    torch.testing.assert_close(quantize_symmetric(w, 8, per_channel=True),
                               torch.tensor([[76 / 127, -1.0], [0.2, 32 * 0.2 / 127]]))
    torch.testing.assert_close(quantize_symmetric(w, 4, per_channel=True),
                               torch.tensor([[4 / 7, -1.0], [0.2, 2 * 0.2 / 7]]))
    # per input channel (axis 1, transformers' Conv1D layout): columns 0.6 and 1.0 set the scales
    # 4 bits: column 0 scale 0.6 / 7: 0.2 / (0.6 / 7) = 2.33 -> 2; column 1 scale 1 / 7 as above
    torch.testing.assert_close(quantize_symmetric(w, 4, per_channel=True, axis=1),
                               torch.tensor([[0.6, -1.0], [2 * 0.6 / 7, 0.0]]))
    assert torch.equal(quantize_symmetric(torch.zeros(2, 3), 4, per_channel=True), torch.zeros(2, 3))


def test_asymmetric_activations_by_hand():
    x = torch.tensor([-1.3, -1.0, 0.003, 0.55, 2.0, 2.5])
    # range [-1, 2], 4 bits: scale = 3 / 15 = 0.2, zero point = 1 / 0.2 = 5, q = clamp(round(x / 0.2) + 5, 0, 15)
    assert asymmetric_grid(4, -1.0, 2.0) == (pytest.approx(0.2), 5)
    # -1.3 -> -6.5 + 5 clamps to 0 -> -1.0; 0.003 -> 0 -> 0.0; 0.55 -> 2.75 -> 3 -> 0.6; 2.5 -> clamps to 15 -> 2.0
    torch.testing.assert_close(quantize_asymmetric(x, 4, -1.0, 2.0), torch.tensor([-1.0, -1.0, 0.0, 0.6, 2.0, 2.0]))
    # 8 bits: scale = 3 / 255 = 1 / 85, zero point 85; 0.55 * 85 = 46.75 -> 47; 0.003 * 85 = 0.255 -> 0
    assert asymmetric_grid(8, -1.0, 2.0) == (pytest.approx(1 / 85), 85)
    torch.testing.assert_close(quantize_asymmetric(x, 8, -1.0, 2.0),
                               torch.tensor([-1.0, -1.0, 0.0, 47 / 85, 2.0, 2.0]))
    # a range without zero is widened to contain it: [0.5, 2] -> [0, 2], 4 bits: scale 2 / 15, zero point 0;
    # 1.1 * 7.5 = 8.25 -> 8; -0.1 clamps to 0
    assert asymmetric_grid(4, 0.5, 2.0) == (pytest.approx(2 / 15), 0)
    torch.testing.assert_close(quantize_asymmetric(torch.tensor([1.1, -0.1]), 4, 0.5, 2.0),
                               torch.tensor([8 * 2 / 15, 0.0]))


def test_calibration_is_a_running_min_max():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    batches = [torch.tensor([[-1.0, 2.0, 9.0], [0.5, 0.0, 9.0]]),  # inputs [:, :-1]: min -1, max 2
               torch.tensor([[-3.0, 1.0, 9.0], [0.0, 0.5, 9.0]])]  # min -3, max 1
    ranges = calibrate(model, {"0": model[0]}, batches, momentum=0.9)
    assert ranges == {"0": (pytest.approx(0.9 * -1 + 0.1 * -3), pytest.approx(0.9 * 2 + 0.1 * 1))}
    assert ranges == calibrate(model, {"0": model[0]}, batches, momentum=0.9)  # the hooks are gone: no drift
    assert calibrate(model, {"0": model[0]}, batches, momentum=0.0)["0"] == (-3.0, 1.0)  # the last batch's


def test_fake_quantized_layers_compute_with_quantized_weights_and_inputs_and_are_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = {"0": model[0], "2": model[2]}
    ranges = {"0": (-1.5, 2.0), "2": (0.0, 1.0)}
    with torch.no_grad(), fake_quantized(layers, SCHEMES["w4a4"], ranges, per_channel=True):
        got = model(x)
    h = F.linear(quantize_asymmetric(x, 4, -1.5, 2.0), quantize_symmetric(before["0.weight"], 4, True),
                 before["0.bias"]).relu()
    expect = F.linear(quantize_asymmetric(h, 4, 0.0, 1.0), quantize_symmetric(before["2.weight"], 4, True),
                      before["2.bias"])
    torch.testing.assert_close(got, expect)
    assert not torch.allclose(got, model(x))  # the quantization changed something
    for k, v in model.state_dict().items():  # restored, and no hook left
        assert torch.equal(v, before[k]), k
    assert not model[0]._forward_pre_hooks and not model[2]._forward_pre_hooks
    with torch.no_grad(), fake_quantized(layers, SCHEMES["w8a16"], per_channel=False):  # weights only
        torch.testing.assert_close(model[0](x), F.linear(x, quantize_symmetric(before["0.weight"], 8),
                                                         before["0.bias"]))
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight  # one tensor in two layers (as a head tied to the embedding)
    w = tied[0].weight.detach().clone()
    with fake_quantized({"0": tied[0], "1": tied[1]}, SCHEMES["w4a16"]):
        assert torch.equal(tied[1].weight, quantize_symmetric(w, 4))
    assert torch.equal(tied[0].weight, w) and tied[1].weight is tied[0].weight


def test_every_linear_layer_but_the_head_is_quantized():
    model = small_model(gate="headwise")
    names = set(quantizable_layers(model))
    per_block = {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "attn.gate_proj", "ffn.w1", "ffn.w2",
                 "ffn.w3"}
    assert names == {f"blocks.{i}.{n}" for i in range(2) for n in per_block}
    assert set(quantizable_layers(model, quantize_head=True)) == names | {"lm_head"}


def test_a_prefix_lm_is_scored_on_the_targets_training_scores():
    model = small_model(prefix_len=4)
    val = [affine_task(7, B=3, T=20)]
    res = evaluate(model, model, val, val, [SCHEMES["w8a8"]], prefix_len=4)
    with torch.no_grad():
        logits = model(val[0][:, :-1])  # (3, 20, V); targets 1..3 are the prefix's, not scored
    expect = F.cross_entropy(logits[:, 3:].flatten(0, 1), val[0][:, 4:].flatten()).item()
    assert res["val_targets"] == 3 * 17
    assert res["schemes"]["fp32"]["loss"] == pytest.approx(expect, rel=1e-6)


# ------------------------------------------------------------------------------------------------ planted outlier
def affine_task(seed: int, B: int = 16, T: int = 24, noise: float = 0.3) -> torch.Tensor:
    """(B, T + 1) sequences of x_{t+1} = 5 x_t + 3 mod 97, a share `noise` of the tokens replaced at random."""
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randint(0, 97, (B, 1), generator=g)]
    for _ in range(T):
        seq.append((seq[-1] * 5 + 3) % 97)
    b = torch.cat(seq, 1)
    return torch.where(torch.rand(b.shape, generator=g) < noise, torch.randint(0, 97, b.shape, generator=g), b)


@pytest.fixture(scope="module")
def trained_small():
    """The 2-layer d 32 model trained 150 steps on `affine_task` (a perplexity far below the vocabulary's 97)."""
    model = small_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(150):
        b = affine_task(step)
        loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def plant_outlier(model: Transformer, channel: int = 3, scale: float = 50.0) -> Transformer:
    """Channel `channel` of every norm's output times `scale`, the following layers' weights on it divided by it: the
    same function in fp32, and an input channel `scale` times larger than the rest for q/k/v and the FFN."""
    with torch.no_grad():
        for block in model.blocks:
            for norm, layers in ((block.norm1, (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)),
                                 (block.norm2, (block.ffn.w1, block.ffn.w3))):
                norm.weight[channel] *= scale
                for layer in layers:
                    layer.weight[:, channel] /= scale
    return model


def test_a_planted_outlier_channel_grows_the_w8a8_gap(trained_small):
    import copy

    val = [affine_task(1000 + i) for i in range(2)]
    calib = [affine_task(2000 + i) for i in range(4)]
    before = {k: v.clone() for k, v in trained_small.state_dict().items()}
    plain = evaluate(trained_small, trained_small, val, calib, SCHEMES.values())
    assert all(torch.equal(v, before[k]) for k, v in trained_small.state_dict().items())  # restored
    outlier = copy.deepcopy(trained_small)
    plant_outlier(outlier)
    planted = evaluate(outlier, outlier, val, calib, SCHEMES.values())
    p, q = plain["schemes"], planted["schemes"]
    assert p["fp32"]["ppl"] < 40  # trained: far below 97, so quantization error shows in the perplexity
    assert q["fp32"]["ppl"] == pytest.approx(p["fp32"]["ppl"], rel=1e-4)  # the same function in fp32
    assert p["w8a8"]["gap"] < 0.05 * p["fp32"]["ppl"]  # 8 bits are nearly lossless without the outlier
    assert q["w8a8"]["gap"] > 10 * max(p["w8a8"]["gap"], 0.01)
    assert q["w4a4"]["gap"] > p["w4a4"]["gap"]
    # most of W8A8's new error is the activations': the outlier stretches the per-tensor input range
    assert q["w8a8"]["gap"] - q["w8a16"]["gap"] > 5 * max(p["w8a8"]["gap"] - p["w8a16"]["gap"], 0.01)
    def widest(res: dict) -> float:
        return max(max(-lo, hi) for lo, hi in res["ranges"].values())

    assert widest(planted) > 10 * widest(plain)  # the calibrated ranges hold the outlier


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def quant_run(small_run):
    return small_run


def direct_ppl(model, blocks) -> float:
    with torch.no_grad():
        losses = [F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten(), reduction="sum") for b in blocks]
    return math.exp(sum(float(x) for x in losses) / sum(b[:, 1:].numel() for b in blocks))


def readme_quant_commands(run: Path, hf_dir: Path, sweep: Path) -> list[list[str]]:
    """The documentation's `sinklab quant` lines, runs/a, hf_out and the sweep dir replaced by this test's dirs."""
    paths = {"runs/a": run, "hf_out": hf_dir, "logs/train/multiruns/<time>": sweep}
    return [line[1:] for line in readme_cli_lines("sinklab quant ", paths)]


def test_quant_on_a_run_dir_table_and_json(capsys, quant_run):
    run, dm, model = quant_run
    rc, out, err = run_cli("sinklab", "quant", str(run), capsys=capsys)
    assert rc == 0, err
    assert "validation: 2 sequences x 32 tokens" in out and "the LM head and embeddings stay fp32" in out
    table = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("fp32", *SCHEMES)]
    assert [row[0] for row in table] == ["fp32", *SCHEMES]
    assert [row[1:3] for row in table] == [["fp32", "fp32"], ["int8", "fp32"], ["int8", "uint8"], ["int4", "fp32"],
                                           ["int4", "uint4"]]

    rc, out, err = run_cli("sinklab", "quant", str(run), "--json", "--weights", "per-channel", "--calib-batches", "3",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert (res["data"], res["val_seqs"], res["seq_len"], res["val_targets"]) == ("run", 2, 32, 64)
    assert (res["calib_batches"], res["weights"], len(res["layers"])) == (3, "per-channel", 14)
    assert set(res["schemes"]) == {"fp32", *SCHEMES} and set(res["ranges"]) == set(res["layers"])
    for name, r in res["schemes"].items():
        assert math.isfinite(r["ppl"]) and r["ppl"] >= 1, name
        assert r["gap"] == pytest.approx(r["ppl"] - res["schemes"]["fp32"]["ppl"])
        assert r["loss"] == pytest.approx(math.log(r["ppl"]))
    assert res["schemes"]["fp32"]["gap"] == 0.0
    assert res["schemes"]["w4a4"]["ppl"] != res["schemes"]["fp32"]["ppl"]  # quantization does something
    blocks = list(dm.val_dataloader())
    assert res["schemes"]["fp32"]["ppl"] == pytest.approx(direct_ppl(model, blocks), rel=1e-5)
    # the checkpoint path with --data finds the same blocks
    rc, out, err = run_cli("sinklab", "quant", str(run / "checkpoints" / "last.ckpt"), "--data", str(run), "--json",
                           "--schemes", "w8a8", "w8a8", capsys=capsys)
    assert rc == 0, err
    assert json.loads(out)["schemes"]["fp32"]["ppl"] == pytest.approx(res["schemes"]["fp32"]["ppl"])
    assert list(json.loads(out)["schemes"]) == ["fp32", "w8a8"]


def test_readme_quant_commands_run(capsys, tmp_path, quant_run):
    """Every `sinklab quant` line of the documentation, on this run, its export to transformers (when installed) and a
    sweep whose job 0 is this run."""
    run, dm, model = quant_run
    hf_dir, sweep = tmp_path / "hf_out", tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    for entry in run.iterdir():  # the run as the sweep's job 0
        (sweep / "0" / entry.name).symlink_to(entry)
    commands = readme_quant_commands(run, hf_dir, sweep)
    assert len(commands) >= 4 and any("--hf-model" in c for c in commands) and any("--sweep" in c for c in commands)
    fp32 = []
    for args in commands:
        if "--hf-model" in args:
            pytest.importorskip("transformers")
            run_cli("sinklab", "export-hf", str(run), str(hf_dir), capsys=capsys, check=True)
        rc, out, err = run_cli("sinklab", "quant", *args, capsys=capsys)
        assert rc == 0, (args, err)
        if "--json" in args:
            fp32.append(json.loads(out)["schemes"]["fp32"]["ppl"])
        elif "--sweep" in args:
            assert out.splitlines()[-1] == f"wrote {sweep / 'quant.csv'} (1 job)", out
            fp32.append(json.loads((sweep / "0" / "quant.json").read_text())["schemes"]["fp32"]["ppl"])
        else:
            assert "w8a8" in out and "gap" in out, args
    # the exported LLaMA gives the checkpoint's fp32 perplexity on the same blocks
    assert fp32 and max(fp32) == pytest.approx(min(fp32), rel=1e-4)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_models_with_tokens(capsys, tmp_path, hf_models, kind):
    transformers = pytest.importorskip("transformers")
    d = hf_models[kind]
    tokens = torch.randint(0, 128, (6, 20), generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "t.npy", tokens.numpy())
    rc, out, err = run_cli("sinklab", "quant", "--hf-model", str(d), "--tokens", str(tmp_path / "t.npy"),
                           "--batch-size", "4", "--json", "--quantize-head", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    # the head by the family's own name (lm_head; GPT-NeoX's embed_out before transformers renamed it)
    (head,) = [name for name, m in model.named_modules() if m is model.get_output_embeddings()]
    # LLaMA: q, k, v, o, gate, up, down per layer; GPT-2: c_attn, c_proj, c_fc, c_proj (Conv1D); and the head
    expected = {"llama": 2 * 7 + 1, "gpt2": 2 * 4 + 1}
    assert len(res["layers"]) == expected.get(kind, len(res["layers"])) and head in res["layers"]
    assert len(res["layers"]) >= 2 * 4 + 1  # the attention projections at least, in every family
    assert (res["data"], res["val_batches"], res["val_targets"]) == ("tokens", 2, 6 * 19)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    ppl = math.exp(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item())
    assert res["schemes"]["fp32"]["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] >= 1 for r in res["schemes"].values())
    assert res["schemes"]["w4a4"]["ppl"] != pytest.approx(ppl, rel=1e-6)  # quantization changed the model


def test_user_errors_are_one_line_exit_2(capsys, tmp_path, quant_run):
    run, _, model = quant_run
    bare = save_ckpt(model, tmp_path / "bare.ckpt")
    np.save(tmp_path / "short.npy", np.zeros((2, 1), dtype=np.int64))
    cases = [
        ((str(tmp_path / "missing"),), ["TARGET"]),
        ((str(run), "--schemes", "w3a3"), ["--schemes", *SCHEMES]),
        ((str(run), "--weights", "per-row"), ["--weights", "per-tensor", "per-channel"]),
        ((str(run), "--momentum", "1"), ["--momentum", "[0, 1)"]),
        ((str(run), "--calib-batches", "0"), ["--calib-batches"]),
        ((str(bare),), ["--data RUN_DIR", "--tokens"]),
        ((str(bare), "--data", str(tmp_path)), ["--data"]),
        ((str(bare), "--tokens", str(tmp_path / "short.npy")), ["--tokens", "T >= 2"]),
        ((str(run), "--calib-tokens", str(tmp_path / "short.npy")), ["--calib-tokens"]),
        (("--hf-model", str(tmp_path / "no_such_dir"), "--data", str(run)), ["--hf-model"]),
        (("--schemes", "w8a8"), ["TARGET"]),
    ]
    for args, named in cases:
        rc, out, err = run_cli("sinklab", "quant", *args, capsys=capsys)
        assert rc == 2, (args, out, err)
        assert out == "", (args, out)
        assert_one_line_error(err, *named)
