"""sinklab eval streaming: perplexity through an evicting KV cache against full forwards, the recompute baseline
against a direct computation, transformers' DynamicCache (evicted and re-rotated) against the sinklab cache, the
command's table / JSON / plot on a real trained run, the documentation's lines, user errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sinklab.evals import streaming_ppl as pp
from sinklab.targets import SinklabTarget
from tests.helpers import (ABSOLUTE_KINDS, HF_KINDS, assert_one_line_error, readme_cli_lines, run_cli, save_ckpt,
                           small_model, token_ids)

CASES = [{}, {"n_sink_tokens": 2}, {"attn_bias": "kv", "pos": "alibi"}, {"pos": "learnable"}, {"window": 6}]
IDS = ["rope", "sink_tokens", "kv_bias_alibi", "learnable", "window"]


def full_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    """NLL (N - 1,) of tokens[1:] from one full forward."""
    return F.cross_entropy(model(tokens[None, :-1])[0], tokens[1:], reduction="none")


# ------------------------------------------------------------------------------------------------ the computation
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streaming_without_eviction_equals_the_full_forward(case):
    m = small_model(**case)  # context 24
    tokens = token_ids(B=1, T=20)[0]
    want = full_nll(m, tokens)
    for first, recent in ((0, 20), (4, 16), (2, 22)):  # x + y >= the 20 tokens: nothing is evicted
        got = pp.stream_nll(SinklabTarget.of_model(m).stream(first, recent), tokens, chunk=7)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    dense = pp.stream_nll(SinklabTarget.of_model(m).stream(None, None), tokens)
    torch.testing.assert_close(dense, want, atol=2e-5, rtol=1e-5)
    assert pp.perplexity(dense) == pytest.approx(math.exp(want.mean().item()), rel=1e-5)


@pytest.mark.parametrize("case", CASES[:3], ids=IDS[:3])
def test_each_prediction_sees_the_first_x_and_the_last_y_tokens_renumbered(case):
    """In a 1-layer model a cached key depends on its token only, so with eviction the prediction after token t is the
    full forward's over [first x] + [the y tokens ending at t], numbered from 0: at most x + y keys, y counting t."""
    m = small_model(n_layer=1, **case)
    tokens = token_ids(B=1, T=30, seed=3)[0]
    x, y = 3, 5
    got = pp.stream_nll(SinklabTarget.of_model(m).stream(x, y), tokens, chunk=4)
    for t in range(tokens.shape[0] - 1):
        seen = tokens[:t + 1] if t + 1 <= x + y else torch.cat([tokens[:x], tokens[t + 1 - y:t + 1]])
        want = F.cross_entropy(m(seen[None])[0, -1:], tokens[t + 1:t + 2])
        torch.testing.assert_close(got[t], want, atol=2e-5, rtol=1e-5, msg=f"target {t + 1}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_recompute_baseline_equals_a_direct_computation(case):
    m = small_model(**case)  # context 24
    tokens = token_ids(B=1, T=61, seed=1)[0]
    got = pp.recompute_nll(SinklabTarget.of_model(m), tokens, context=24, batch_size=5)
    want = torch.stack([F.cross_entropy(m(tokens[None, max(0, t + 1 - 24):t + 1])[0, -1], tokens[t + 1])
                        for t in range(60)])  # each target from the <= 24 tokens ending at its input
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    short = token_ids(B=1, T=10, seed=2)[0]  # shorter than the context: one forward
    torch.testing.assert_close(pp.recompute_nll(SinklabTarget.of_model(m), short, 24), full_nll(m, short),
                               atol=2e-5, rtol=1e-5)


def test_bucket_perplexities():
    nll = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    assert pp.bucket_ends(5, 2) == [2, 4, 5]
    assert pp.bucket_ppl(nll, [2, 4, 5]) == pytest.approx([math.exp(0.5), math.exp(2.5), math.exp(4.0)])
    assert pp.bucket_ends(9, 4) == [4, 9] and pp.bucket_ends(10, 4) == [4, 8, 10] and pp.bucket_ends(3, 4) == [3]


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def streaming_run(trained_run, tmp_path_factory):
    """The trained run, a 400-token text of its validation split as a .npy, and its export to transformers."""
    from sinklab.runs.run_data import read_run_data

    d = tmp_path_factory.mktemp("streaming")
    text = read_run_data(trained_run, {"num_workers": 0}, lambda dm: dm.val_text(400), "test", "text", "")
    np.save(d / "text.npy", text.numpy())
    return trained_run, d / "text.npy", d


def streaming_json(capsys, *args: str) -> dict:
    rc, out, err = run_cli("sinklab", "eval", "streaming", *args, "--json", capsys=capsys)
    assert rc == 0, err
    return json.loads(out)


def test_table_json_and_plot_on_a_trained_run(capsys, streaming_run):
    run, text, d = streaming_run
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(run), "--n-tokens", "300", "--first", "0,4", "--recent",
                           "16,60", "--plot", str(d / "ppl.png"), capsys=capsys)
    assert rc == 0, err
    assert "the first 300 tokens of" in out and "(BOS first); 299 targets" in out
    table = [line.split() for line in out.splitlines()]
    names = [" ".join(r[:2]) for r in table if r[:1] in (["x=0"], ["x=4"])]
    assert names[:4] == ["x=0 y=16", "x=0 y=60", "x=4 y=16", "x=4 y=60"]
    assert any(r[:1] == ["dense"] for r in table) and any(r[:2] == ["recompute", "64"] for r in table)
    assert "perplexity by first x (rows) and recent y (columns):" in out
    assert (d / "ppl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = streaming_json(capsys, str(run), "--n-tokens", "300", "--first", "0,4", "--recent", "16,60",
                         "--bucket", "128")
    assert (res["source"], res["data"], res["n_tokens"], res["targets"], res["context"]) == \
        ("sinklab", "run", 300, 299, 64)
    assert res["bucket_ends"] == [128, 299]  # the last 43 targets join the bucket before them
    by_name = {s["name"]: s for s in res["settings"]}
    assert list(by_name) == ["x=0 y=16", "x=0 y=60", "x=4 y=16", "x=4 y=60", "dense", "recompute 64"]
    assert [by_name["x=4 y=60"][k] for k in ("kind", "first", "recent", "keys")] == ["streaming", 4, 60, 64]
    for s in res["settings"]:
        assert math.isfinite(s["ppl"]) and s["ppl"] > 1 and len(s["bucket_ppl"]) == 2, s["name"]
        assert s["loss"] == pytest.approx(math.log(s["ppl"]))
    # the command's numbers are the functions' on the same text (the run's validation text, BOS first)
    from sinklab.runs.checkpoints import load_model

    model = load_model(run / "checkpoints" / "last.ckpt")
    tokens = torch.from_numpy(np.load(text))[:300]
    assert int(tokens[0]) == 0  # the BOS id of the default data
    with torch.no_grad():
        direct = pp.recompute_nll(SinklabTarget.of_model(model), tokens, 64)
        window = pp.stream_nll(SinklabTarget.of_model(model).stream(0, 16), tokens)
    assert by_name["recompute 64"]["ppl"] == pytest.approx(pp.perplexity(direct), rel=1e-5)
    assert by_name["x=0 y=16"]["ppl"] == pytest.approx(pp.perplexity(window), rel=1e-5)
    assert by_name["x=0 y=16"]["ppl"] != pytest.approx(by_name["x=4 y=16"]["ppl"], rel=1e-4)  # x matters


@pytest.mark.slow
@pytest.mark.ci
def test_transformers_cache_evicts_and_rerotates_as_the_sinklab_cache(capsys, monkeypatch, streaming_run):
    """The run exported with `sinklab export-hf`: DynamicCache with eviction and re-rotated keys gives the sinklab
    cache's perplexities (x = 0 and 2, 400 tokens through 18 or 20 keys: eviction from the 19th token on)."""
    pytest.importorskip("transformers")
    run, text, d = streaming_run
    hf_dir = d / "hf"
    rc, out, err = run_cli("sinklab", "export-hf", str(run), str(hf_dir), "--no-tokenizer", capsys=capsys)
    assert rc == 0, err
    args = ["--tokens", str(text), "--first", "0,2", "--recent", "18", "--bucket", "100"]
    ours = streaming_json(capsys, str(run), *args)
    theirs = streaming_json(capsys, "--hf-model", str(hf_dir), *args)
    assert theirs["source"] == "hf" and [s["name"] for s in theirs["settings"]] == \
        ["x=0 y=18", "x=2 y=18", "dense", "recompute 64"]
    for a, b in zip(ours["settings"], theirs["settings"]):
        assert a["name"] == b["name"]
        assert b["ppl"] == pytest.approx(a["ppl"], rel=2e-5), a["name"]
        assert b["bucket_ppl"] == pytest.approx(a["bucket_ppl"], rel=2e-5), a["name"]
    # without the re-rotation the kept keys sit at the wrong positions: the perplexity moves
    from sinklab.targets import transformers_cache as hf_cache
    from sinklab.targets.transformers_lm import load_hf_model

    model, tokens = load_hf_model(hf_dir), torch.from_numpy(np.load(text))
    with torch.no_grad():
        exact = pp.perplexity(pp.stream_nll(hf_cache.HFStream(model, 2, 18, str(hf_dir)), tokens))
        monkeypatch.setattr(hf_cache, "rotate_back", lambda keys, inv_freq, shift: keys)
        unrotated = pp.perplexity(pp.stream_nll(hf_cache.HFStream(model, 2, 18, str(hf_dir)), tokens))
    assert exact == pytest.approx(ours["settings"][1]["ppl"], rel=2e-5)
    assert abs(unrotated - exact) > 1e-3 * exact


def test_recompute_windows_other_than_the_context(capsys, tmp_path):
    """--window L,...: the recompute baseline from the last L tokens (the paper's L = the cache's x + y), each
    window's number the function's; the sweep row names a window other than the context's recompute_w<L>."""
    model = small_model(block_size=64)
    ckpt = save_ckpt(model, tmp_path / "m.ckpt")
    tokens = token_ids(B=1, T=120, vocab=97)[0]
    np.save(tmp_path / "t.npy", tokens.numpy())
    res = streaming_json(capsys, str(ckpt), "--tokens", str(tmp_path / "t.npy"), "--first", "4", "--recent", "12",
                         "--baselines", "recompute", "--window", "16,64")
    by_name = {s["name"]: s for s in res["settings"]}
    assert list(by_name) == ["x=4 y=12", "recompute 16", "recompute 64"]
    with torch.no_grad():
        for w in (16, 64):
            direct = pp.perplexity(pp.recompute_nll(SinklabTarget.of_model(model), tokens, w))
            assert by_name[f"recompute {w}"]["ppl"] == pytest.approx(direct, rel=1e-5)
            assert by_name[f"recompute {w}"]["keys"] == w
    assert by_name["recompute 16"]["ppl"] != pytest.approx(by_name["recompute 64"]["ppl"], rel=1e-4)
    row = pp.StreamingPerplexity.row(res)
    assert row["recompute_w16_ppl"] == by_name["recompute 16"]["ppl"]
    assert row["recompute_ppl"] == by_name["recompute 64"]["ppl"]  # the context's window keeps its old column
    assert all(pp.StreamingPerplexity.column_bounds(c) is not None for c in row), row  # every column has bounds


@pytest.mark.parametrize("args, message", [
    (["--window", "65"], "--window 65: allowed: 2 <= L <= 64"),
    (["--window", "1"], "--window 1: allowed: 2 <= L <= 64"),
    (["--baselines", "dense", "--window", "16"], "--window goes with the recompute baseline"),
])
def test_bad_windows_are_refused_in_one_line(capsys, tmp_path, args, message):
    ckpt = save_ckpt(small_model(block_size=64), tmp_path / "m.ckpt")
    np.save(tmp_path / "t.npy", token_ids(B=1, T=50, vocab=97)[0].numpy())
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(ckpt), "--tokens", str(tmp_path / "t.npy"), *args,
                           capsys=capsys)
    assert rc == 2 and out == ""
    assert_one_line_error(err, message)


def test_dense_is_skipped_with_a_note_for_absolute_positions(capsys, tmp_path):
    model = small_model(pos="learnable", vocab_size=97)  # 24 positions
    ckpt = save_ckpt(model, tmp_path / "m.ckpt")
    np.save(tmp_path / "t.npy", token_ids(B=1, T=50)[0].numpy())
    res = streaming_json(capsys, str(ckpt), "--tokens", str(tmp_path / "t.npy"), "--first", "2", "--recent", "22")
    assert [s["name"] for s in res["settings"]] == ["x=2 y=22", "recompute 24"]
    assert len(res["notes"]) == 2 and res["notes"][1].startswith("dense: skipped: position 49 is past the 24")
    assert res["notes"][0].startswith("model.pos=learnable adds absolute positions to the embeddings")
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(ckpt), "--tokens", str(tmp_path / "t.npy"), "--first",
                           "2", "--recent", "22", "--baselines", "dense", capsys=capsys)
    assert rc == 0 and "note: dense: skipped: position 49" in out, err


@pytest.mark.slow
@pytest.mark.ci
def test_readme_streaming_commands_run(capsys, streaming_run):
    """Every `sinklab eval` line of the documentation, on the trained run and its export (--n-tokens 300 instead of the
    documentation's 10,000 tokens, which take about a minute per setting at the CPU recipe's size)."""
    run, text, d = streaming_run
    commands = [c for c in readme_cli_lines("sinklab eval", {"runs/a": run, "hf_out": d / "hf_readme",
                                                             "streaming.png": d / "readme.png"})
                if c[:2] != ["eval", "retrieval"]]  # a run trained with a retrieval task: tests/evals/test_retrieval.py
    assert any(c[:2] == ["eval", "--help"] for c in commands)
    assert len([c for c in commands if c[:2] == ["eval", "streaming"]]) >= 3
    for args in commands:
        if "--hf-model" in args:
            pytest.importorskip("transformers")
            run_cli("sinklab", "export-hf", str(run), str(d / "hf_readme"), "--no-tokenizer", capsys=capsys, check=True)
        if args[:2] == ["eval", "streaming"]:
            args = [a for i, a in enumerate(args) if a != "--n-tokens" and args[i - 1] != "--n-tokens"]
            args += ["--n-tokens", "300"]
        rc, out, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 0, (args, err)
        if args[:2] == ["eval", "--help"]:
            assert all(name in out for name in ("streaming", "intervene", "quant", "retrieval")), out
        elif "--json" in args:
            assert json.loads(out)["targets"] == 299
        else:
            assert "perplexity" in out or "ppl" in out, out
    assert (d / "readme.png").is_file()


# ------------------------------------------------------------------------------------------------ user errors
@pytest.mark.parametrize("args, message", [
    (["--first", "4", "--recent", "61"], "--first 4 --recent 61: x + y = 65 exceeds the model context 64; allowed: "
                                         "x + y <= 64"),
    (["--recent", "1"], "--recent 1: allowed: >= 2"),
    (["--baselines", "dense,sliding"], "unknown baseline 'sliding'; allowed: dense, recompute"),
    (["--first", "0,a"], "argument --first: '0,a' is not a comma-separated list of integers >= 0"),
    (["--tokens", "missing.npy"], "--tokens missing.npy: no such file"),
    (["--tokens", "TWO_D"], "is not one text (N,) with N >= 2 tokens"),
    (["--n-tokens", "1"], "--n-tokens 1: allowed: >= 2"),
    (["--data", "NOT_A_RUN"], "not a run dir (it has no .hydra/config.yaml)"),
    (["--plot", "ppl.pdf"], "--plot ppl.pdf: allowed: a .png file name"),
    (["--plot", "A_FILE/ppl.png"], "/ppl.png: cannot write it: "),
    (["--first", "63"], "--first 63 leaves 1 recent tokens in the model context 64; allowed: x <= 62"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, trained_run, tmp_path, args, message):
    np.save(tmp_path / "two_d.npy", np.zeros((2, 5), dtype=np.int64))
    (tmp_path / "file").write_text("a file, where a directory would be")
    args = [str(tmp_path / "two_d.npy") if a == "TWO_D" else str(tmp_path) if a == "NOT_A_RUN" else
            a.replace("A_FILE", str(tmp_path / "file")) for a in args]
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(trained_run), *args, capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, message)
    assert out == ""


def test_a_prefix_lm_and_a_missing_target_are_refused(capsys, tmp_path):
    ckpt = save_ckpt(small_model(prefix_len=4), tmp_path / "p.ckpt")
    np.save(tmp_path / "t.npy", token_ids(B=1, T=30)[0].numpy())
    rc, _, err = run_cli("sinklab", "eval", "streaming", str(ckpt), "--tokens", str(tmp_path / "t.npy"), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "model.prefix_len=4")
    rc, _, err = run_cli("sinklab", "eval", "streaming", str(tmp_path / "nothing"), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "no such checkpoint or run dir")
    rc, _, err = run_cli("sinklab", "eval", "streaming", str(save_ckpt(small_model(), tmp_path / "c.ckpt")),
                         capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "pass --data RUN_DIR or --tokens FILE.npy")


# ------------------------------------------------------------------------------------------------ every RoPE family
ROPE_CASES = [(k, ("full_attention",)) for k in HF_KINDS if k not in ABSOLUTE_KINDS] + \
    [(k, ("sliding_attention",)) for k in ("gemma2", "gemma3", "gpt_oss")]


@pytest.mark.parametrize("kind,layer_types", ROPE_CASES, ids=[f"{k}-{t[0].split('_')[0]}" for k, t in ROPE_CASES])
def test_transformers_cache_evicts_exactly_for_every_rope_family(kind, layer_types):
    """A 1-layer model of each RoPE family (partial rotary, q/k norms, per-layer RoPE bases, YaRN, sliding windows of
    8 keys < the x + y = 11 kept): the prediction after token t is the full forward's over the first x tokens and the
    y ending at t, numbered from 0. Without the re-rotation it is not."""
    from sinklab.targets import transformers_cache as hf_cache
    from tests.helpers.hf_models import build, sharpen

    torch.manual_seed(0)
    m = build(kind, layer_types)
    sharpen(kind, m)
    m.set_attn_implementation("eager")
    m.eval()
    tokens = token_ids(B=1, T=30, vocab=128, seed=3)[0]
    x, y = 3, 8
    with torch.no_grad():
        got = pp.stream_nll(hf_cache.HFStream(m, x, y, kind), tokens, chunk=4)
        want = torch.stack([F.cross_entropy(m(input_ids=(tokens[:t + 1] if t + 1 <= x + y else torch.cat(
            [tokens[:x], tokens[t + 1 - y:t + 1]]))[None]).logits[0, -1], tokens[t + 1]) for t in range(29)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        unrotated = hf_cache.HFStream(m, x, y, kind)
        unrotated.inv_freq = [torch.zeros_like(f) for f in unrotated.inv_freq]  # a rotation by 0: keys left in place
        assert (pp.stream_nll(unrotated, tokens) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind", HF_KINDS)
def test_the_command_on_every_architecture(capsys, hf_models, tmp_path, kind):
    """RoPE families stream (no eviction: the dense perplexity); absolute positions are refused in one line."""
    np.save(tmp_path / "t.npy", token_ids(B=1, T=60, vocab=128)[0].numpy())
    args = ["eval", "streaming", "--hf-model", str(hf_models[kind]), "--tokens", str(tmp_path / "t.npy"),
            "--first", "0,4", "--recent", "20,60"]
    if kind in ABSOLUTE_KINDS:
        rc, out, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 2
        assert_one_line_error(err, "learned absolute positions")
        return
    by_name = {s["name"]: s["ppl"] for s in streaming_json(capsys, *args[2:])["settings"]}
    # 60 tokens through 60 kept keys: nothing evicted, every prediction sees its whole prefix, as dense and recompute
    assert by_name["x=0 y=60"] == pytest.approx(by_name["dense"], rel=1e-5)
    assert by_name["x=0 y=60"] == pytest.approx(by_name["recompute 64"], rel=1e-5)
    if kind != "mistral":  # (its every layer sees 16 keys: what x=4 y=20 evicts it never saw)
        assert by_name["x=4 y=20"] != pytest.approx(by_name["dense"], rel=1e-4)  # evicted from the 25th token on


@pytest.mark.slow
@pytest.mark.ci
def test_other_cache_policies_stream_beside_streamingllm(capsys, streaming_run):
    """--policies window --budgets 59 is StreamingLLM's x = 0, y = 60 cache (59 kept + the token fed): the same
    perplexity; H2O at the same budget is scored too, and its columns reach the sweep row."""
    from sinklab.evals.streaming_ppl import StreamingPerplexity

    run, text, d = streaming_run
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(run), "--n-tokens", "300", "--first", "0", "--recent",
                           "60", "--baselines", "none", "--policies", "window,h2o", "--budgets", "59", "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    by = {s["name"]: s for s in res["settings"]}
    assert by["window budget=59"]["ppl"] == pytest.approx(by["x=0 y=60"]["ppl"], rel=1e-5)
    assert by["h2o budget=59"]["kind"] == "policy" and by["h2o budget=59"]["keys"] == 60
    row = StreamingPerplexity.row(res)
    assert {"window_b59_ppl", "h2o_b59_ppl", "x0_y60_ppl"} <= set(row)
    assert all(StreamingPerplexity.column_bounds(c) for c in row)
    rc, out, err = run_cli("sinklab", "eval", "streaming", str(run), "--budgets", "8", capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "--budgets goes with --policies P,...")
