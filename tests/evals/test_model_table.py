"""The model table of `sinklab measure --hf-model A B ... --input natural random repeat` (Table 1 of Gu et al. with the
paper's numbers beside ours), natural text through each model's own tokenizer, and the docs' lines of "Measure a
pretrained transformers model", on tiny random models stored under the docs' hub ids in a local huggingface_hub cache."""
from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from tests.helpers import VERSE, assert_one_line_error, hub_cache, readme_cli_lines, run_cli, tiny_hf

# the documentation's hub ids -> the tiny family that stands in for each (revisions: branch -> seed)
HUB = {"openai-community/gpt2-xl": ("gpt2", {"main": 0}), "meta-llama/Llama-2-7b-hf": ("llama", {"main": 0}),
       "mistralai/Mistral-7B-v0.1": ("mistral", {"main": 0}), "meta-llama/Meta-Llama-3-8B": ("llama", {"main": 1}),
       "EleutherAI/pythia-160m": ("neox", {"main": 0, "step1000": 1}), "openai/gpt-oss-20b": ("gpt_oss", {"main": 0})}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A huggingface_hub cache holding a tiny model (with a word-level tokenizer) under each hub id of HUB, and a
    text of VERSE's words for natural input."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("table")
    for repo_id, (kind, revisions) in HUB.items():
        dirs = {branch: tiny_hf(kind, root / "src" / repo_id / branch, seed=seed, tokenizer=True)
                for branch, seed in revisions.items()}
        hub_cache(root / "cache", repo_id, dirs)
    rng = random.Random(0)
    (root / "verse.txt").write_text("\n".join(" ".join(rng.choice(VERSE) for _ in range(12)) for _ in range(400)))
    return root


@pytest.fixture
def offline(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def measure_json(capsys, *args: str) -> dict:
    rc, out, err = run_cli("sinklab", "measure", *args, "--json", capsys=capsys)
    assert rc == 0, err
    return json.loads(out)


def test_the_table_is_each_single_measurement_with_the_paper_beside(offline, capsys, tmp_path):
    text = str(offline / "verse.txt")
    args = ["--input", "natural", "random", "repeat", "--text", text, "--num-seqs", "6", "--seq-len", "32"]
    res = measure_json(capsys, "--hf-model", "openai-community/gpt2-xl", "meta-llama/Llama-2-7b-hf", *args,
                       "--csv", str(tmp_path / "t.csv"), "--markdown", str(tmp_path / "t.md"))
    models, inputs = ("openai-community/gpt2-xl", "meta-llama/Llama-2-7b-hf"), ("natural", "random", "repeat")
    assert [(r["model"], r["input"]) for r in res["rows"]] == [(m, i) for m in models for i in inputs]
    paper = {(r["model"], r["input"]): r["paper_sink1"] for r in res["rows"]}
    assert paper[("openai-community/gpt2-xl", "random")] == 70.29  # sinklab/reference/paper_tables.yaml
    assert paper[("meta-llama/Llama-2-7b-hf", "natural")] == 92.47 and paper[("meta-llama/Llama-2-7b-hf",
                                                                                "repeat")] == 0.0
    for r in res["rows"]:  # each row is the single measurement of that model on that input
        given = args[4:] if r["input"] == "natural" else args[6:]  # --text with natural input only
        alone = measure_json(capsys, "--hf-model", r["model"], "--input", r["input"], *given)
        assert (r["sink1"], r["alpha1"]) == (alone["sink"]["1"], alone["alpha_mean"]["1"])
        assert r["first_token_attn"] == r["alpha1"] and r["massive_ratio"] == max(alone["massive"]["ratio"])
    table = pd.read_csv(tmp_path / "t.csv")
    assert list(table["model"]) == ["openai-community/gpt2-xl", "meta-llama/Llama-2-7b-hf"]
    assert table.loc[0, "paper repeat"] == 62.28 and table.loc[1, "Sink_1 random"] == res["rows"][4]["sink1"]
    assert table.loc[1, "alpha_1 natural"] == pytest.approx(res["rows"][3]["alpha1"])
    md = (tmp_path / "t.md").read_text()
    assert "| model" in md and "(77.00)" in md and "(90.13)" in md and md.count("\n") == 4
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", "meta-llama/Llama-2-7b-hf", "--input", "random", "--csv",
                           str(tmp_path / "t.txt"), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "--csv", ".csv")


def test_natural_text_goes_through_the_models_tokenizer_bos_first(offline, capsys):
    """Natural input: consecutive pieces of the text tokenized by the model's own tokenizer, each starting with the
    BOS its tokenizer puts first (the LLaMA stand-in's; the GPT-2 stand-in's puts none)."""
    import transformers

    from sinklab.targets.hub_models import resolve_model

    text = (offline / "verse.txt").read_text()
    for repo_id, bos in (("meta-llama/Llama-2-7b-hf", [0]), ("openai-community/gpt2-xl", [])):
        res = measure_json(capsys, "--hf-model", repo_id, "--input", "natural", "--text", str(offline / "verse.txt"),
                           "--num-seqs", "4", "--seq-len", "20")
        path = resolve_model(repo_id)
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        ids = tok(text[:20_000], add_special_tokens=False)["input_ids"]
        body = 20 - len(bos)
        want = torch.tensor([bos + ids[i * body:(i + 1) * body] for i in range(4)])  # (4, 20)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
        with torch.no_grad():
            maps = torch.stack(model(input_ids=want, output_attentions=True).attentions, 1)
        np.testing.assert_allclose(res["alpha"], maps[..., :, 0].mean(-1).mean(0).numpy(), atol=1e-5)
        assert ("'<s>' first" in res["text"]) == bool(bos), res["text"]


def test_the_readme_measure_commands_run(offline, capsys, tmp_path, hf_models):
    """Every `sinklab measure --hf-model` line of the docs, the hub ids read from the local cache (tiny stand-ins),
    with 4 sequences of 32 tokens instead of 100 x 64; the GGUF line is the real tier's (tests/real/)."""
    commands = readme_cli_lines("sinklab measure --hf-model", {"path/to/llama": hf_models["llama"],
                                                               "table1.md": tmp_path / "t.md",
                                                               "table1.csv": tmp_path / "t.csv"})
    commands = [c for c in commands if not c[2].endswith(".gguf")]
    assert len(commands) >= 4 and any(len(c) > 5 and "--revision" in c for c in commands)
    text = ["--text", str(offline / "verse.txt")]
    for args in commands:
        args = args + ["--num-seqs", "4", "--seq-len", "32"] + (text if "natural" in args else [])
        rc, out, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 0, (args, err)
        if "--json" in args:
            assert json.loads(out)["input"] == "natural"
    assert (tmp_path / "t.md").is_file() and len(pd.read_csv(tmp_path / "t.csv")) == 4
