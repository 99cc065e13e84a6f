"""sinklab export-hf: LLaMA-compatible checkpoints load as LlamaForCausalLM with the same logits; others refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sinklab.export.llama import unrepresentable
from sinklab.model import ModelConfig, Transformer
from tests.helpers import REPO, assert_one_line_error, natural_run, run_cli, save_ckpt

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SMALL = dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, d_ff=80, block_size=32)


def random_model(**overrides) -> Transformer:
    """Random weights everywhere, norm gains included (they are ones at init and would hide a mapping slip)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_gqa_export_has_the_same_logits(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model = random_model(n_kv_head=2, rope_base=500.0, norm_eps=1e-6)
    ckpt = save_ckpt(model, tmp_path / "m.ckpt")
    out = tmp_path / "hf"
    rc, printed, err = run_cli("sinklab", "export-hf", str(ckpt), str(out), "--no-tokenizer", capsys=capsys)
    assert rc == 0, err
    assert "check: max |logit difference|" in printed and "tokenizer: skipped" in printed
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["max_position_embeddings"],
            config["rms_norm_eps"], config["tie_word_embeddings"]) == (4, 2, 32, 1e-6, False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.rope_parameters["rope_theta"] == 500.0 if hasattr(hf.config, "rope_parameters") \
        else hf.config.rope_theta == 500.0
    idx = torch.randint(0, SMALL["vocab_size"], (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(input_ids=idx).logits
    assert ours.abs().max() > 0.5  # logits of a size where a mapping slip would show
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_refuses_what_llama_cannot_represent(tmp_path, capsys):
    ckpt = save_ckpt(random_model(pos="alibi"), tmp_path / "alibi.ckpt")
    rc, out, err = run_cli("sinklab", "export-hf", str(ckpt), str(tmp_path / "out"), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "model.pos=alibi (LLaMA needs rope)")
    assert not (tmp_path / "out").exists()

    cfg = ModelConfig(**SMALL, attn_bias="kv", norm="layer", window=8).validate()
    reasons = unrepresentable(cfg)
    assert [r.split("=")[0] for r in reasons] == ["model.norm", "model.attn_bias", "model.window"]
    assert unrepresentable(ModelConfig(**SMALL, n_kv_head=1).validate()) == []
    for overrides in ({"ffn": "gelu"}, {"n_sink_tokens": 1}, {"gate": "headwise"}, {"sink_logit": "learned"},
                      {"norm_position": "post"}, {"attn_op": "sigmoid"}, {"softmax_scale": 2.0}, {"prefix_len": 4},
                      {"gate": "vga"}, {"attn_op": "differential"}, {"rope_heads": [0, 2]},
                      {"rope_head_fractions": [1.0, 0.75, 0.0, 1.0]}, {"pos": "nape"}, {"head_norm": "rms"}):
        cfg = ModelConfig(**SMALL, **overrides).validate()
        assert not cfg.llama_compatible and [r.split("=")[0] for r in unrepresentable(cfg)] == \
            ["model." + next(iter(overrides))]

    # the module entry point, and an output dir that is not empty
    proc = run_cli("sinklab", "export-hf", str(ckpt), str(tmp_path / "o2"), process=True, env=ENV, timeout=60)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "model.pos=alibi")
    ok = save_ckpt(random_model(), tmp_path / "ok.ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    rc, out, err = run_cli("sinklab", "export-hf", str(ok), str(tmp_path / "full"), capsys=capsys)
    assert rc == 2 and "OUT_DIR" in err


def test_exports_the_runs_tokenizer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run, dm = natural_run(tmp_path)
    save_ckpt(random_model(vocab_size=dm.vocab_size), run / "checkpoints" / "last.ckpt")
    rc, out, err = run_cli("sinklab", "export-hf", str(run), str(tmp_path / "hf"), capsys=capsys)
    assert rc == 0, err
    assert "tokenizer: from the run's data module" in out
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the quick brown fox sings of golden hills"
    assert tok(text)["input_ids"] == dm.tokenizer.encode(text).ids
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == dm.eos_id
