"""sinklab import-hf: a transformers LLaMA as a sinklab run dir (logits within 1e-4 in fp32, tied embeddings, GQA, its
tokenizer and data config), that measure and init_from take and export-hf writes back; what sinklab's model cannot
represent is refused in one line. The real SmolLM2-135M is imported in the `real` tier (tests/real)."""
import json

import pytest
import torch

from sinklab.export.hf_import import IMPORTED_FROM, sinklab_state_dict
from sinklab.runs.checkpoints import read_checkpoint
from sinklab.targets.transformers_lm import load_hf_model
from tests.helpers import assert_one_line_error, run_cli
from tests.helpers.hf_models import tiny_hf, tiny_tokenizer

transformers = pytest.importorskip("transformers")


def llama_dir(path, tie: bool, **extra):
    """A random 2-layer LLaMA (GQA 4 / 2 heads, RoPE base 1e5) saved with a word-level tokenizer."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e5}, **extra)
    model = transformers.LlamaForCausalLM(cfg)
    for p in model.parameters():  # weights large enough that a wrong map shows in the logits
        p.data.normal_(0, 0.3)
    model.save_pretrained(str(path))
    tiny_tokenizer(path, bos=True)
    return path


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_an_imported_llama_gives_transformers_logits_and_is_a_run_dir(tie, tmp_path, capsys):
    src = llama_dir(tmp_path / "hf", tie)
    capsys.readouterr()
    rc, out, err = run_cli("sinklab", "import-hf", str(src), str(tmp_path / "run"), capsys=capsys)
    assert rc == 0, err
    assert "check: max |logit difference| vs transformers = " in out
    run = tmp_path / "run"
    ckpt = read_checkpoint(run / "checkpoints" / "last.ckpt")
    model = ckpt["hyper_parameters"]["model"]
    assert (model["n_head"], model["n_kv_head"], model["rope_base"], model["tie_embeddings"]) == (4, 2, 1e5, tie)
    assert ckpt[IMPORTED_FROM]["class"] == "LlamaForCausalLM" and ckpt["global_step"] == 0
    assert (run / "tokenizer.json").is_file() and (run / ".hydra" / "config.yaml").is_file()

    import sinklab

    ours = sinklab.load_model(run)
    hf = load_hf_model(src)
    idx = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = float((ours(idx) - hf(input_ids=idx).logits).abs().max())
    assert diff <= 1e-4 and float(hf(input_ids=idx).logits.abs().max()) > 1.0
    assert (ours.lm_head.weight is ours.tok_emb.weight) == tie

    # every command reads it as a run dir; export-hf writes it back as the same LLaMA
    rc, out, err = run_cli("sinklab", "measure", str(run), "--input", "random", "--num-seqs", "4", "--json",
                           capsys=capsys)
    assert rc == 0, err
    measured = json.loads(out)
    assert 0 <= measured["sink"]["1"] <= 100 and 0 < measured["alpha_mean"]["1"] <= 1
    rc, out, err = run_cli("sinklab", "export-hf", str(run), str(tmp_path / "back"), capsys=capsys)
    assert rc == 0, err
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["LlamaForCausalLM"] and back["tie_word_embeddings"] == tie
    again = load_hf_model(tmp_path / "back")
    with torch.no_grad():
        assert float((again(input_ids=idx).logits - hf(input_ids=idx).logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("kind, extra, words", [
    ("qwen2", {}, "model_type=qwen2 (sinklab imports the LLaMA family: llama"),
    ("llama", {"attention_bias": True}, "attention_bias=True (sinklab needs false)"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act=gelu (sinklab needs silu (SwiGLU))"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type=linear (sinklab needs default (unscaled RoPE))"),
])
def test_what_sinklab_cannot_represent_is_refused_in_one_line(kind, extra, words, tmp_path, capsys):
    if kind == "llama":
        torch.manual_seed(0)
        cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   max_position_embeddings=64)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **extra})).save_pretrained(
            str(tmp_path / "hf"))
        tiny_tokenizer(tmp_path / "hf", bos=True)
    else:
        tiny_hf(kind, tmp_path / "hf", tokenizer=True)
    capsys.readouterr()  # transformers' own save_pretrained bars
    rc, out, err = run_cli("sinklab", "import-hf", str(tmp_path / "hf"), str(tmp_path / "run"), capsys=capsys)
    assert rc == 2 and out == ""
    assert_one_line_error(err, "sinklab's model cannot represent", words, starts="sinklab import-hf: error: SRC ")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_weight_map_is_the_inverse_of_export_hf():
    from sinklab.export.llama import LLAMA_NAMES, llama_state_dict
    from sinklab.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                                    block_size=16))
    state = model.state_dict()
    back = sinklab_state_dict(llama_state_dict(state, 2), 2, tied=False)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert len(LLAMA_NAMES(2)) == 3 + 9 * 2


def test_a_warm_start_reads_a_tokenizer_named_relative_or_absolute_as_the_same(tmp_path, monkeypatch):
    """init_from= an imported run dir: its checkpoint records the tokenizer's absolute path, a retrofit names it from
    where it runs (runs/x/tokenizer.json): the same file, no refusal; another file or EOS token is refused."""
    from sinklab.runs.checkpoints import vocabulary_differences

    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "tokenizer.json").write_text("{}")
    (tmp_path / "runs" / "x" / "other.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    saved = {"tokenizer": str(tmp_path / "runs" / "x" / "tokenizer.json"), "eos_token": "<s>", "prepared_dir": None}
    assert vocabulary_differences(saved, {**saved, "tokenizer": "runs/x/tokenizer.json"}) == ""
    assert "data.tokenizer=" in vocabulary_differences(saved, {**saved, "tokenizer": "runs/x/other.json"})
    assert vocabulary_differences(saved, {**saved, "eos_token": "</s>"}) == "data.eos_token='<s>' there, '</s>' here"
