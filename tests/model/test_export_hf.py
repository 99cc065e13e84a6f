"""sinklab export-hf: LLaMA-compatible checkpoints load as LlamaForCausalLM with the same logits (and no remote code);
the others as remote code (SinklabForCausalLM, trust_remote_code), which `sinklab measure --hf-model` measures as
`sinklab measure` measures the checkpoint; every component: tests/model/test_export_components.py."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import sinklab

from sinklab.export.llama import unrepresentable
from sinklab.model import ModelConfig, Transformer
from sinklab.runs.checkpoints import TOKENS_SEEN
from tests.helpers import (REPO, assert_one_line_error, git_checkout, natural_run, readme_cli_lines, run_cli,
                           save_ckpt)

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
    bars_on = transformers.utils.logging.is_progress_bar_enabled()
    rc, printed, err = run_cli("sinklab", "export-hf", str(ckpt), str(out), "--no-tokenizer", capsys=capsys)
    assert rc == 0, err
    assert "check: max |logit difference|" in printed and "tokenizer: skipped" in printed
    # its lines only: no transformers progress bar of its writes or its check's load, and the bars as they were after
    assert "Writing model shards" not in err and "Loading weights" not in err, err
    assert transformers.utils.logging.is_progress_bar_enabled() == bars_on
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
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


def test_what_llama_cannot_represent_is_remote_code(tmp_path, capsys):
    ckpt = save_ckpt(random_model(pos="alibi"), tmp_path / "alibi.ckpt")
    rc, out, err = run_cli("sinklab", "export-hf", str(ckpt), str(tmp_path / "out"), "--no-tokenizer", capsys=capsys)
    assert rc == 0, err
    assert "SinklabForCausalLM as remote code" in out and "model.pos=alibi (LLaMA needs rope)" in out
    assert "trust_remote_code=True" in out and "check: max |logit difference| vs the sinklab model = 0 " in out
    assert "Writing model shards" not in err and "Loading weights" not in err, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_sinklab.SinklabConfig",
                                  "AutoModelForCausalLM": "modeling_sinklab.SinklabForCausalLM"}
    assert config["sinklab_model"]["pos"] == "alibi" and config["sinklab_version"] == sinklab.__version__
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trust_remote_code=True" in card and f"pip install sinklab=={sinklab.__version__}" in card

    cfg = ModelConfig(**SMALL, attn_bias="kv", norm="layer", window=8).validate()
    reasons = unrepresentable(cfg)
    assert [r.split("=")[0] for r in reasons] == ["model.norm", "model.attn_bias", "model.window"]
    assert unrepresentable(ModelConfig(**SMALL, n_kv_head=1).validate()) == []
    for overrides in ({"ffn": "gelu"}, {"n_sink_tokens": 1}, {"gate": "headwise"}, {"sink_logit": "learned"},
                      {"norm_position": "post"}, {"attn_op": "sigmoid"}, {"softmax_scale": 2.0}, {"prefix_len": 4},
                      {"gate": "vga"}, {"attn_op": "differential"}, {"rope_heads": [0, 2]},
                      {"rope_head_fractions": [1.0, 0.75, 0.0, 1.0]}, {"pos": "nape"}, {"head_norm": "rms"},
                      {"sparsity": "strided"}, {"sparsity": "topk"}):
        cfg = ModelConfig(**SMALL, **overrides).validate()
        assert not cfg.llama_compatible and [r.split("=")[0] for r in unrepresentable(cfg)] == \
            ["model." + next(iter(overrides))]

    # the module entry point, and an output dir that is not empty
    proc = run_cli("sinklab", "export-hf", str(ckpt), str(tmp_path / "o2"), "--no-check", process=True, env=ENV,
                   timeout=60)
    assert proc.returncode == 0 and (tmp_path / "o2" / "modeling_sinklab.py").is_file(), proc.stderr
    ok = save_ckpt(random_model(), tmp_path / "ok.ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    rc, out, err = run_cli("sinklab", "export-hf", str(ok), str(tmp_path / "full"), capsys=capsys)
    assert rc == 2 and "OUT_DIR" in err


def test_measure_of_the_remote_code_export_equals_measure_of_the_run(tmp_path, capsys):
    """A gated model with learned sink tokens and a KV bias: `sinklab measure --hf-model` on its export (loaded
    through transformers with trust_remote_code, since its code files are this sinklab's) reports what `sinklab
    measure` reports on the checkpoint, per head; an export whose code was edited is refused in one line."""
    pytest.importorskip("transformers")
    model = random_model(gate="headwise", n_sink_tokens=1, attn_bias="kv")
    ckpt = save_ckpt(model, tmp_path / "gated.ckpt")
    out = tmp_path / "hf"
    run_cli("sinklab", "export-hf", str(ckpt), str(out), "--no-tokenizer", capsys=capsys, check=True)
    args = ["--input", "random", "--num-seqs", "6", "--seq-len", "24", "--json"]
    ours = json.loads(run_cli("sinklab", "measure", str(ckpt), *args, capsys=capsys, check=True).stdout)
    theirs = json.loads(run_cli("sinklab", "measure", "--hf-model", str(out), *args, capsys=capsys,
                                check=True).stdout)
    assert theirs["source"] == "hf" and theirs["model"]["model_type"] == "sinklab"
    assert len(ours["alpha"]) == 2 and len(ours["alpha"][0]) == 4  # alpha_1 per layer and head
    for key in ("alpha", "sink", "sink_by_eps", "gates", "massive", "entropy"):
        assert key in ours and theirs[key] == ours[key], key
    assert {k for k in ours if k not in ("target", "source", "seconds")} <= set(theirs)
    # the export answers to every TransformerLens name of the sinklab model it wraps, with the checkpoint's values
    from sinklab.targets import TargetSpec, load_target

    tokens = torch.randint(0, SMALL["vocab_size"], (2, 12))
    native, exported = (load_target(TargetSpec(name, source)) for name, source in ((str(ckpt), "sinklab"),
                                                                                  (str(out), "hf")))
    want, got = (t.run_with_cache(tokens, prepend_bos=False)[1] for t in (native, exported))
    assert "blocks.1.attn.hook_z" in got and "blocks.0.attn.hook_pattern" in got and sorted(got) == sorted(want)
    assert all(torch.allclose(got[name], want[name], atol=1e-6) for name in want)

    (out / "modeling_sinklab.py").write_text((out / "modeling_sinklab.py").read_text() + "\n# edited\n")
    rc, _, err = run_cli("sinklab", "measure", "--hf-model", str(out), *args, capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "its remote code (configuration_sinklab.py, modeling_sinklab.py) is not this sinklab's")


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


def test_the_readme_export_section_runs(tmp_path, capsys, monkeypatch):
    """The documentation's `sinklab export-hf` lines (a LLaMA run and a gated one, here random models with a
    word-level tokenizer beside their checkpoints) and its Python lines loading the gated export with
    trust_remote_code."""
    pytest.importorskip("transformers")
    from tests.helpers import doc_section, tiny_tokenizer

    runs = {}
    for name, overrides in (("runs/a", {}), ("runs/g", {"gate": "headwise"})):
        run = tmp_path / name
        tok = tiny_tokenizer(run)  # tokenizer.json in the run dir
        save_ckpt(random_model(vocab_size=len(tok), **overrides), run / "checkpoints" / "last.ckpt")
        runs[name] = run
    paths = {**runs, "hf_out": tmp_path / "hf_out", "hf_gated": tmp_path / "hf_gated"}
    lines = [line for line in readme_cli_lines("sinklab export-hf ", paths) if "--revisions" not in line]
    assert [line[1:] for line in lines] == [[str(runs["runs/a"]), str(paths["hf_out"])],
                                            [str(runs["runs/g"]), str(paths["hf_gated"])]]
    for line in lines:
        rc, out, err = run_cli("sinklab", *line, capsys=capsys)
        assert rc == 0 and "tokenizer: from " in out, err
    assert json.loads((tmp_path / "hf_out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "SinklabForCausalLM as remote code" in out

    section = doc_section("Export to transformers")
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "export-and-hooks.md", "exec"), scope)  # the documentation's own lines, as a user runs them
    ids, maps, model = scope["ids"], scope["maps"], scope["model"]
    assert type(model).__name__ == "SinklabForCausalLM" and ids.shape[1] > 8
    assert len(maps) == 2 and maps[0].shape == (1, 4, ids.shape[1], ids.shape[1])
    assert torch.allclose(maps[0].sum(-1), torch.ones(1, 4, ids.shape[1]), atol=1e-5)  # no extra columns here


def test_beam_search_through_the_sinklab_cache_equals_beam_search_without(tmp_path):
    """Beam search reorders the cache's sequences (`SinklabCacheLayer.reorder_cache`: keys, values, learned sink
    tokens' included): the beams through the cache are those recomputed from scratch at every step."""
    transformers = pytest.importorskip("transformers")
    from sinklab.export.llama import export

    ckpt = save_ckpt(random_model(gate="elementwise", n_sink_tokens=2), tmp_path / "m.ckpt")
    export(str(ckpt), str(tmp_path / "hf"), check=False, with_tokenizer=False, log=lambda line: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(2))
    beams = [hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, num_beams=3,
                         do_sample=False, pad_token_id=0, use_cache=cached) for cached in (True, False)]
    assert beams[0].shape == (2, 12) and torch.equal(beams[0], beams[1])


def test_loading_remote_code_without_sinklab_is_one_line(tmp_path, monkeypatch):
    """Where sinklab cannot be imported, loading the export says in one line which sinklab to install."""
    transformers = pytest.importorskip("transformers")
    from sinklab.export.llama import export

    export(str(save_ckpt(random_model(pos="alibi"), tmp_path / "m.ckpt")), str(tmp_path / "hf"), check=False,
           with_tokenizer=False, log=lambda line: None)
    monkeypatch.setitem(sys.modules, "sinklab", None)  # `import sinklab` fails, as where it is not installed
    with pytest.raises(ImportError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert str(err.value) == ("this model's code (modeling_sinklab.py) runs sinklab's model: pip install "
                              f"sinklab=={sinklab.__version__}")


# ------------------------------------------------------------------------------------------------ --revisions
def kept_run(base, kept=(2, 4), last=6, **overrides):
    """A run dir (its config has no data: --input random) with random models, each of its own seed, kept at the
    steps `kept` (32 tokens per step) and in last.ckpt at step `last` (None: no last.ckpt): (run dir, {step: its
    sinklab state dict})."""
    run = base / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    states = {}
    for i, step in enumerate([*kept, *([last] if last is not None else [])]):
        torch.manual_seed(i)
        model = Transformer(ModelConfig(**{**SMALL, **overrides})).eval()
        is_last = step == last and i == len(kept)
        path = save_ckpt(model, run / "checkpoints" / ("last.ckpt" if is_last else
                                                       f"kept/step{step:07d}-tokens{32 * step}.ckpt"))
        if is_last:
            ckpt = torch.load(path, weights_only=True)
            torch.save({**ckpt, "global_step": step, TOKENS_SEEN: 32 * step}, path)
        states[step] = model.state_dict()
    return run, states


def git_out(repo, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_revisions_are_branches_of_one_repository_that_trajectory_reads(tmp_path, capsys):
    """`sinklab export-hf RUN OUT --revisions` of a gated run (remote code) with checkpoints kept at steps 2 and 4
    and last.ckpt at 6: a git repository with branches step2, step4, step6 and main at step6, each branch's weights
    (loaded by transformers from a checkout) its checkpoint's; `sinklab trajectory --hf-model OUT --revision ...`
    gives each step the values, step and tokens of `sinklab trajectory RUN`."""
    transformers = pytest.importorskip("transformers")
    run, states = kept_run(tmp_path, gate="headwise")
    out = tmp_path / "hf"
    rc, printed, err = run_cli("sinklab", "export-hf", str(run), str(out), "--revisions", "--no-tokenizer",
                               capsys=capsys)
    assert rc == 0, err
    assert "SinklabForCausalLM as remote code" in printed and f"wrote {out} (" in printed
    assert "step4: checkpoints/kept/step0000004-tokens128.ckpt, 128 tokens seen; check: max |logit diff" in printed
    assert git_out(out, "for-each-ref", "--format=%(refname:short)", "refs/heads").split() == \
        ["main", "step2", "step4", "step6"]
    assert git_out(out, "rev-parse", "main") == git_out(out, "rev-parse", "step6") and \
        git_out(out, "status", "--porcelain") == ""  # the work tree is main's
    for step, state in states.items():
        d = git_checkout(out, f"step{step}", tmp_path / f"step{step}")
        assert sorted(p.name for p in d.iterdir()) == ["README.md", "config.json", "configuration_sinklab.py",
                                                       "generation_config.json", "model.safetensors",
                                                       "modeling_sinklab.py", "trainer_state.json"]
        assert json.loads((d / "trainer_state.json").read_text()) == {"global_step": step,
                                                                       "num_input_tokens_seen": 32 * step}
        assert f"This revision is branch `step{step}`" in (d / "README.md").read_text()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=True)
        theirs = hf.model.state_dict()
        assert theirs.keys() == state.keys()
        assert all(torch.equal(theirs[k], v) for k, v in state.items()), step

    def points(*args: str) -> list[dict]:
        res = json.loads(run_cli("sinklab", "trajectory", *args, "--input", "random", "--num-seqs", "6",
                                 "--metrics", "sink/sink1,sink/alpha1", "--csv", str(tmp_path / "t.csv"), "--plot",
                                 str(tmp_path / "t.png"), "--json", capsys=capsys, check=True).stdout)
        return [{k: p[k] for k in ("step", "tokens", "values")} for p in res["points"]]

    theirs = points("--hf-model", str(out), "--revision", "step2", "step4", "main")
    ours = points(str(run))
    assert [p["step"] for p in theirs] == [2, 4, 6] and [p["tokens"] for p in theirs] == [64, 128, 192]
    assert len({p["values"]["sink/alpha1"] for p in ours}) == 3  # three models, three values
    for a, b in zip(theirs, ours):
        assert (a["step"], a["tokens"]) == (b["step"], b["tokens"])
        for key, value in b["values"].items():
            assert a["values"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (a["step"], key)


def test_revisions_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    """A checkpoint file, an OUT_DIR with files, a revision the repository lacks, --revision of a directory that
    is no git repository, git missing (to write and to read): one line each; a run without kept checkpoints
    exports last.ckpt alone, as main and its step branch, and says so."""
    run, _ = kept_run(tmp_path, kept=(), last=6)
    out = tmp_path / "hf"
    rc, printed, err = run_cli("sinklab", "export-hf", str(run), str(out), "--revisions", "--no-tokenizer",
                               "--no-check", capsys=capsys)
    assert rc == 0, err
    assert (f"--revisions: {run} has no kept checkpoints (callbacks.checkpoint.keep); only last.ckpt is exported: "
            "main and its branch step6") in printed
    assert git_out(out, "branch", "--format=%(refname:short)").split() == ["main", "step6"]

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    plain = tmp_path / "plain"
    run_cli("sinklab", "export-hf", str(run), str(plain), "--no-tokenizer", "--no-check", capsys=capsys, check=True)
    measure = ["--input", "random", "--num-seqs", "2", "--seq-len", "8"]
    cases = [(["export-hf", str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "o"), "--revisions"],
              ["--revisions exports a run's kept checkpoints; pass a training run dir"]),
             (["export-hf", str(run), str(tmp_path / "full"), "--revisions"],
              [f"OUT_DIR {tmp_path / 'full'}: exists and is not an empty directory"]),
             (["trajectory", "--hf-model", str(out), "--revision", "step6", "step5", *measure],
              ["--revision step5: no such branch, tag or commit of --hf-model", "its branches: main, step6"]),
             (["measure", "--hf-model", str(plain), "--revision", "step6", *measure],
              ["--revision step6:", "is a local directory, not a git repository", "export-hf RUN DIR --revisions"])]
    for args, named in cases:
        rc, printed, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 2 and printed == "", (args, err)
        assert_one_line_error(err, *named)
    assert not (tmp_path / "o").exists()

    monkeypatch.setenv("PATH", str(tmp_path / "no-git"))  # no git on PATH
    for args, flag in ((["export-hf", str(run), str(tmp_path / "o2"), "--revisions"], "--revisions"),
                       (["trajectory", "--hf-model", str(out), "--revision", "step6", *measure], "--revision step6")):
        rc, printed, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 2, (args, err)
        assert_one_line_error(err, f"{flag}: needs git on PATH")
    assert not (tmp_path / "o2").exists()
