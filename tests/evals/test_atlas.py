"""sinklab atlas: the page is self-contained, its maps are the model's attention maps of the first probe sequence (rows
summing to one), its per-head values are `sinklab measure`'s, its slider runs over the kept checkpoints in training
order; a run without kept ones draws last.ckpt and says so; a transformers model is one frame; the docs' lines run;
bad input is one line. The page in a real browser: tests/evals/test_atlas_browser.py."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from sinklab.analysis.atlas import Atlas, Frame, pack_map, read_page_data, render, unpack_map
from sinklab.cli.atlas import build_parser, check_args
from sinklab.metrics import attention_maps
from sinklab.model import ModelConfig, Transformer
from sinklab.runs.checkpoints import kept_name
from sinklab.runs.run_data import probe_tokens
from tests.helpers import assert_one_line_error, natural_run, readme_cli_lines, run_cli, save_ckpt, tiny_hf

KEPT_STEPS = (4, 8)  # two kept checkpoints, then last.ckpt


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir (local corpus, BPE 300, probe set of 10 x 16 with the BOS id first) with three random 2-layer
    models of 4 heads with a K bias slot (an extra key column): kept at steps 4 and 8, and last.ckpt; {path: model}."""
    run, dm = natural_run(tmp_path_factory.mktemp("atlas"))
    config = run / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(config)
    cfg.data.probe_bos = True
    OmegaConf.save(cfg, config)
    models = {}
    for seed, name in enumerate([*(Path("kept") / kept_name(s, s * 128) for s in KEPT_STEPS), Path("last.ckpt")]):
        torch.manual_seed(seed)
        model = Transformer(ModelConfig(vocab_size=dm.vocab_size, n_layer=2, n_head=4, d_model=32, d_ff=64,
                                        block_size=32, attn_bias="k")).eval()
        models[save_ckpt(model, run / "checkpoints" / name)] = model
    return run, models


def atlas(capsys, tmp_path, *args: str) -> tuple[dict, str, dict]:
    """`sinklab atlas ARGS --json` in this process: (its JSON, the page, the page's data)."""
    out = tmp_path / "atlas.html"
    rc, stdout, err = run_cli("sinklab", "atlas", *args, "--out", str(out), "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(stdout)
    html = out.read_text(encoding="utf-8")
    assert res["out"] == str(out) and res["bytes"] == out.stat().st_size
    return res, html, read_page_data(html)


def maps_of(data: dict, frame: int) -> np.ndarray:
    f = data["frames"][frame]
    shape = (data["n_layer"], data["n_head"], data["seq_len"], data["n_extra"] + data["seq_len"])
    return unpack_map(f["maps"], f["lo"], f["hi"], shape)


def test_the_page_draws_each_kept_checkpoints_maps_and_measure_values(run, capsys, tmp_path):
    run_dir, models = run
    res, html, data = atlas(capsys, tmp_path, str(run_dir))
    # self-contained: nothing fetched from anywhere, the script inline
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"<link\b|<script[^>]*\bsrc=|@import|url\(", html, re.IGNORECASE)
    assert "DecompressionStream" in html and html.count("<script") == 2
    # the slider: the kept checkpoints in training order, then last.ckpt (no step in a checkpoint saved by hand)
    assert [f["label"] for f in data["frames"]] == ["step 4 (512 tokens)", "step 8 (1,024 tokens)", "last.ckpt"]
    assert res["note"] is None and data["note"] is None
    assert (data["n_layer"], data["n_head"], data["seq_len"], data["n_extra"]) == (2, 4, 16, 1)
    tokens = probe_tokens(run_dir, None, None)
    assert data["queries"][0] == "<|endoftext|>" and data["keys"][:2] == ["[bias]", "<|endoftext|>"]
    assert len(data["queries"]) == 16 and data["keys"][1:] == data["queries"]
    for i, (path, model) in enumerate(models.items()):
        a = maps_of(data, i)  # (L, H, T, 1 + T)
        assert a.shape == (2, 4, 16, 17)
        # each row sums to one, within the stored rounding: 17 values, each within 1 / (2 * 255)
        assert np.abs(a.sum(-1) - 1).max() <= 17 / 510, i
        with torch.no_grad():
            ref = torch.stack([m[0] for m in attention_maps(model, tokens[:1])]).numpy()  # (L, H, T, 1 + T)
        assert np.abs(a - ref).max() <= 1 / 510 + 1e-6, path
        assert data["frames"][i]["where"] == str(path)
    # the values: every per-head grid, alpha_1 first and equal to `sinklab measure --json`'s (4 significant digits)
    assert data["metrics"][0] == "sink/alpha" and {"entropy", "sink/slot_alpha/bias"} <= set(data["metrics"])
    rc, out, err = run_cli("sinklab", "measure", str(run_dir), "--json", capsys=capsys)
    assert rc == 0, err
    measured = json.loads(out)
    for name, grid in (("sink/alpha", measured["alpha"]), ("entropy", measured["entropy"]["by_head"]),
                       ("sink/slot_alpha/bias", measured["slot_alpha"]["bias"])):
        np.testing.assert_allclose(data["frames"][-1]["values"][name], grid, rtol=6e-4, err_msg=name)
    assert len({json.dumps(f["values"]["sink/alpha"]) for f in data["frames"]}) == 3  # three different models


def test_a_run_without_kept_checkpoints_draws_last_and_says_so(run, capsys, tmp_path):
    run_dir, _ = run
    alone = tmp_path / "alone"
    shutil.copytree(run_dir, alone, ignore=shutil.ignore_patterns("kept"))
    for args in ([str(alone)], [str(run_dir), "--last"]):
        res, _, data = atlas(capsys, tmp_path, *args, "--metric", "entropy")
        assert [f["label"] for f in data["frames"]] == ["last.ckpt"] and data["metric"] == "entropy"
    res, _, data = atlas(capsys, tmp_path, str(alone))
    assert res["note"] == data["note"] and "has no kept checkpoints (checkpoints/kept/)" in res["note"]
    assert "draws last.ckpt alone, without a slider" in res["note"]
    rc, out, err = run_cli("sinklab", "atlas", str(alone), "--out", str(tmp_path / "a.html"), capsys=capsys)
    assert rc == 0 and out.splitlines()[0].startswith(f"atlas: {tmp_path / 'a.html'} (1 checkpoint, 2 layers x 4 "
                                                      "heads, natural: 10 sequences x 16 tokens; ")
    assert out.splitlines()[1] == f"note: {res['note']}" and len(out.splitlines()) == 2


def test_a_transformers_model_is_one_frame_labelled_by_its_tokenizer(capsys, tmp_path):
    model_dir = tiny_hf("llama", tmp_path / "llama", tokenizer=True)
    res, _, data = atlas(capsys, tmp_path, "--hf-model", str(model_dir), "--input", "random", "--seq-len", "12",
                         "--num-seqs", "3")
    assert len(data["frames"]) == 1 and data["frames"][0]["label"] == "llama" and res["note"] is None
    assert (data["n_layer"], data["n_extra"], data["seq_len"]) == (2, 0, 12) and data["input"].startswith("random: 3")
    assert np.abs(maps_of(data, 0).sum(-1) - 1).max() <= 12 / 510
    assert not any(q.isdigit() for q in data["queries"])  # the tokenizer's words, not the ids


def test_the_data_cannot_close_its_script_and_packing_keeps_signed_maps():
    """A token whose text is `</script>` or `<!--<script>` stays inside the JSON (no `<`, `>`, `&`, U+2028 or
    U+2029 in it: escaped); maps with negative weights (differential attention)
    are stored on [min, max] and read back within the rounding."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(1, 2, 3, 3)).astype(np.float32)
    packed, lo, hi = pack_map(a)
    assert lo == pytest.approx(a.min()) and hi == pytest.approx(a.max())
    assert np.abs(unpack_map(packed, lo, hi, a.shape) - a).max() <= (hi - lo) / 510 + 1e-6
    words = ["</script><b>x", "a\nb", '"q"', "<!--<script>", "&amp;\u2028\u2029"]
    page = render(Atlas("t</script><!--", [Frame("f", a, {"m": [[0.5, None]]})], words, words, "tokens: 1 x 5", "m"))
    assert page.count("</script>") == 2 and page.count("<!--") == 1 and page.count("<script") == 2  # the template's
    inline = page[page.index('"atlas-data"'):].split(">", 1)[1].split("</script>", 1)[0]
    assert not any(c in inline for c in "<>&\u2028\u2029")
    data = read_page_data(page)
    assert data["keys"] == words and data["title"] == "t</script><!--"
    assert data["frames"][0]["values"] == {"m": [[0.5, None]]}


def test_the_readme_lines_run(run, capsys, tmp_path, monkeypatch):
    """The documentation's `sinklab atlas` lines: on the local run they run; the hub model's line is parsed and
    checked."""
    run_dir, _ = run
    monkeypatch.chdir(tmp_path)
    commands = readme_cli_lines("sinklab atlas", {"runs/a": run_dir,
                                                  "runs/a/checkpoints/last.ckpt": run_dir / "checkpoints/last.ckpt"})
    assert len(commands) >= 3
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        check_args(args)
        if args.hf_model is not None:
            assert args.hf_model == "EleutherAI/pythia-160m" and args.revision == "step143000"
            continue
        rc, out, err = run_cli("sinklab", *argv, capsys=capsys)
        assert rc == 0 and out.startswith(f"atlas: {args.out} "), (argv, err)
        assert read_page_data(args.out.read_text())["metric"] == args.metric


@pytest.mark.parametrize("args, fragments", [
    (["{run}", "--metric", "attention"], ["--metric attention: no registered metric 'attention'", "sink/alpha"]),
    (["{run}", "--metric", "entropy/nothing"], ["--metric entropy/nothing: not a per-head grid of this model",
                                                "sink/alpha", "induction/induction"]),
    (["{missing}"], ["TARGET", "no such checkpoint or run dir"]),
    (["{run}", "--out", "atlas.png"], ["--out atlas.png: allowed: a .html or .htm file name"]),
    (["{run}", "--out", "{file}/sub/a.html"], ["--out ", "/sub/a.html: cannot write it: ", "/file is a file, not a "
                                                                                           "directory"]),
    (["{run}", "--out", "/proc/atlas.html"], ["--out /proc/atlas.html: cannot write it"]),
    (["{run}", "--hf-model", "x"], ["pass either TARGET", "not both"]),
    (["--hf-model", "x", "--last"], ["--last applies to a run dir"]),
    (["{run}", "--text", "t.txt"], ["--text goes with --hf-model"]),
    (["{run}", "--num-seqs", "0"], ["--num-seqs 0 must be a positive integer"]),
])
def test_bad_input_is_one_line(run, capsys, tmp_path, monkeypatch, args, fragments):
    run_dir, _ = run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, where a directory would be")
    argv = [a.format(run=run_dir, missing=tmp_path / "nothing", file=tmp_path / "file") for a in args]
    rc, out, err = run_cli("sinklab", "atlas", *argv, capsys=capsys)
    assert rc == 2 and out == ""
    assert_one_line_error(err, *fragments, starts="sinklab atlas: error: ")
    assert not (tmp_path / "atlas.html").exists()


def test_json_grids_names_every_layer_by_head_grid_of_a_part():
    """What the dropdown offers: lists of n_layer lists of n_head numbers (nulls allowed), by path without `by_head`;
    per-layer lists, per-pair grids and wrong shapes are not per-head values."""
    from sinklab.metrics.base import json_grids

    part = {"alpha": [[0.1, 0.2], [0.3, None]], "by_layer": [1.0, 2.0],
            "by_head": {"induction": [[1, 2], [3, 4]], "pairs": [[[1], [2]], [[3], [4]]]}, "wide": [[1, 2, 3]] * 2}
    assert json_grids(part, 2, 2) == {"alpha": [[0.1, 0.2], [0.3, None]], "induction": [[1, 2], [3, 4]]}
    assert json_grids([[0.5, 0.5], [0.5, 0.5]], 2, 2) == {"": [[0.5, 0.5], [0.5, 0.5]]}
