"""sinklab measure: JSON against direct computations, planted sinks, bias slot / sink tokens, HF models, errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sinklab.analysis.probe_inputs import make_tokens
from sinklab.metrics import activation_stats, attention_scores, brute_force_alpha, sink_rate
from sinklab.metrics import METRICS, Metric, massive, norms, outliers, residual_sinks
from sinklab.metrics.base import NON_NEGATIVE
from sinklab.model import ModelConfig, Transformer
from tests.helpers import HF_KINDS, MHA_KINDS, REPO, assert_one_line_error, natural_run, run_cli, save_ckpt, tiny_hf

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
PLANT_LAYER, PLANT_HEAD = 0, 2
SCHEMA = ("sink", "sink_star", "alpha", "massive", "norms", "seq_len", "num_seqs", "eps")  # issue 4's --json keys

NORM_KEYS, OUTLIER_KEYS = norms.KEYS, outliers.KEYS
STAT_KEYS = massive.KEYS + norms.KEYS + outliers.KEYS + residual_sinks.PER_LAYER  # activation_stats lists


# ------------------------------------------------------------------------------------------------ helpers
def json_and_text(capsys, *args) -> tuple[dict, str]:
    """`sinklab measure ARGS` in this process, with --json and without: (its JSON, its text)."""
    out = run_cli("sinklab", "measure", *map(str, args), "--json", capsys=capsys, check=True).stdout
    text = run_cli("sinklab", "measure", *map(str, args), capsys=capsys, check=True).stdout
    return json.loads(out), text


def planted(where: str = "token1", **overrides) -> Transformer:
    """Every head attends uniformly (q = 0) except head PLANT_HEAD of layer PLANT_LAYER, which puts all its
    attention on token 1 (id 0 carries a marker channel), on the K/V bias slot, or on the learned sink token.

    Channel 1 is constant over tokens, so the planted query is the same for every position; the marker sits
    in the lowest RoPE frequency (dim hd/2 - 1) so that rotation barely moves it over 32 positions."""
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=32, **overrides).validate()
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    hd, h = cfg.hd, PLANT_HEAD
    r = h * hd + hd // 2 - 1
    with torch.no_grad():
        for b in m.blocks:
            b.attn.q_proj.weight.zero_()
        emb = m.tok_emb.weight
        emb[:, 0] = 0.0
        emb[:, 1] = 1.0
        attn = m.blocks[PLANT_LAYER].attn
        attn.q_proj.weight[r, 1] = 30.0
        if where == "token1":
            emb[0, 0] = 10.0
            attn.k_proj.weight[r, 0] = 30.0
        elif where == "bias":
            attn.attn_bias.k_bias[h].zero_()
            attn.attn_bias.k_bias[h, hd // 2 - 1] = 60.0
        elif where == "sink":
            m.sink_tokens.zero_()
            m.sink_tokens[0, 0], m.sink_tokens[0, 1] = 10.0, 1.0
            attn.k_proj.weight[r, 0] = 30.0
    return m


def bos_tokens(n: int = 6, T: int = 32, vocab: int = 64) -> np.ndarray:
    rng = np.random.default_rng(0)
    tok = rng.integers(1, vocab, (n, T))
    tok[:, 0] = 0
    return tok


@pytest.fixture(scope="module")
def planted_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    model = planted("token1")
    np.save(d / "tokens.npy", bos_tokens())
    return model, save_ckpt(model, d / "model.ckpt"), d / "tokens.npy"


# ------------------------------------------------------------------------------------------------ sinklab checkpoints
@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_planted_sink_found_through_cli(planted_ckpt):
    model, ckpt, tokens = planted_ckpt
    proc = run_cli("sinklab", "measure", str(ckpt), "--tokens", str(tokens), "--json", "--eps", "0.3", "0.1",
                   process=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    alpha = np.array(res["alpha"])
    assert alpha.shape == (2, 4)
    sink_heads = {tuple(ix) for ix in np.argwhere(alpha > 0.3)}
    assert sink_heads == {(PLANT_LAYER, PLANT_HEAD)}
    assert alpha[PLANT_LAYER, PLANT_HEAD] > 0.99
    assert res["sink"]["1"] == pytest.approx(100.0 / 8)  # exactly one head of 2 x 4 in every sequence
    assert res["sink"]["2"] == 0.0
    assert set(res["sink_by_eps"]) == {"0.3", "0.1"} and res["sink_by_eps"]["0.3"] == res["sink"]
    assert res["sink_by_eps"]["0.1"]["1"] == 100.0  # uniform heads: alpha_1 = H_32 / 32 = 0.127 > 0.1
    # softmax rows sum to one: Sink* is Sink (always reported, for one schema), no alpha_star; no slots
    assert res["sink_star"] == res["sink"] and res["sink_star_by_eps"] == res["sink_by_eps"]
    assert "alpha_star" not in res and "slot" not in res
    assert set(SCHEMA) <= set(res) and set(res["norms"]) == set(NORM_KEYS)
    assert set(res["massive"]) == {"top", "median", "ratio", "token", "channel"}
    assert (res["seq_len"], res["num_seqs"], res["input"], res["eps"]) == (32, 6, "tokens", [0.3, 0.1])

    # the JSON equals a direct computation of the efficient metric and of the brute-force one
    tok = torch.from_numpy(np.load(tokens))
    direct = attention_scores(model, tok, k=4)
    np.testing.assert_allclose(alpha, direct.alpha[..., 0].mean(0).numpy(), atol=1e-6)
    assert [res["sink"][str(j + 1)] for j in range(4)] == pytest.approx(sink_rate(direct.alpha, 0.3).tolist())
    brute = brute_force_alpha(model, tok, k=4)
    np.testing.assert_allclose(alpha, brute.alpha[..., 0].mean(0).detach().numpy(), atol=1e-5)
    stats = activation_stats(model, tok)
    assert res["massive"]["top"] == pytest.approx(stats["massive_top"])
    assert res["massive"]["token"] == stats["massive_token"]
    assert res["norms"]["h1_norm_ratio"] == pytest.approx(stats["h1_norm_ratio"])
    for key in NORM_KEYS:
        assert res["norms"][key] == pytest.approx(stats[key]), key
    # issue 15's statistics: outliers, residual sinks with the norm weights, first-token attention (= alpha_1)
    assert set(res["outliers"]) == set(OUTLIER_KEYS)
    for key in OUTLIER_KEYS:
        assert res["outliers"][key] == pytest.approx(stats[key]), key
    sinks = res["residual_sinks"]
    assert set(sinks) == {"h_avg", "top", "channel", "ratio", "channel_share", "attn_norm_min", "ffn_norm_min",
                          "final_norm_min"}
    np.testing.assert_allclose(sinks["h_avg"], stats["h_avg"], rtol=1e-6)
    assert np.array(sinks["h_avg"]).shape == (2, 32) and sinks["channel"] == stats["resid_sink_channel"]
    assert sinks["ratio"] == pytest.approx(stats["resid_sink_ratio"])
    assert sinks["channel_share"] == stats["resid_sink_channel_share"]
    assert sinks["attn_norm_min"] == sinks["ffn_norm_min"] == [1.0, 1.0] and sinks["final_norm_min"] == 1.0
    assert res["first_token_attn"]["mean"] == res["alpha_mean"]["1"]
    np.testing.assert_allclose(res["first_token_attn"]["by_layer"], alpha.mean(-1), atol=1e-6)


@pytest.mark.parametrize("where,overrides,slot", [("bias", {"attn_bias": "kv"}, "bias"),
                                                  ("sink", {"n_sink_tokens": 1}, "token0")])
def test_bias_slot_and_sink_token_scored_apart(capsys, tmp_path, where, overrides, slot):
    model = planted(where, **overrides)
    ckpt = save_ckpt(model, tmp_path / "m.ckpt")
    np.save(tmp_path / "t.npy", bos_tokens())
    rc, out, err = run_cli("sinklab", "measure", str(ckpt), "--tokens", str(tmp_path / "t.npy"), "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    # the planted head attends to the slot, not to token 1: counted under "slot", never under "sink"
    assert res["slot"] == {slot: pytest.approx(100.0 / 8)}
    assert res["sink"]["1"] == 0.0
    slot_alpha = np.array(res["slot_alpha"][slot])
    assert slot_alpha[PLANT_LAYER, PLANT_HEAD] > 0.99
    assert np.array(res["alpha"])[PLANT_LAYER, PLANT_HEAD] < 1e-3
    direct = attention_scores(model, torch.from_numpy(np.load(tmp_path / "t.npy")), k=4)
    np.testing.assert_allclose(slot_alpha, direct.slot[..., 0].mean(0).numpy(), atol=1e-6)
    np.testing.assert_allclose(res["alpha"], direct.alpha[..., 0].mean(0).numpy(), atol=1e-6)


def test_not_row_normalised_reports_sink_star(capsys, tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=32,
                                    attn_op="sigmoid", sigmoid_bias=-2.0)).eval()
    ckpt = save_ckpt(model, tmp_path / "sig.ckpt")
    rc, out, err = run_cli("sinklab", "measure", str(ckpt), "--input", "random", "--num-seqs", "3", "--seq-len", "16",
                           "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["row_normalised"] is False and "sink_star" in res and "alpha_star" in res
    direct = attention_scores(model, make_tokens("random", 3, 16, 64, 0), k=4)
    np.testing.assert_allclose(res["alpha_star"], direct.alpha_star[..., 0].mean(0).numpy(), atol=1e-6)
    assert [res["sink_star"][str(j + 1)] for j in range(4)] == pytest.approx(
        sink_rate(direct.alpha_star, 0.3).tolist())


def test_random_and_repeat_inputs_and_table(capsys, planted_ckpt):
    _, ckpt, _ = planted_ckpt
    rep = make_tokens("repeat", 5, 12, 64, seed=3)
    assert rep.shape == (5, 12) and bool((rep == rep[:, :1]).all()) and rep.max() < 64
    rnd = make_tokens("random", 5, 12, 64, seed=3)
    assert torch.equal(rnd, make_tokens("random", 5, 12, 64, seed=3)) and not bool((rnd == rnd[:, :1]).all())
    rc, out, err = run_cli("sinklab", "measure", str(ckpt), "--input", "repeat", "--num-seqs", "5", "--seq-len", "12",
                           "--k", "2", "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert (res["input"], res["num_seqs"], res["seq_len"], sorted(res["sink"])) == ("repeat", 5, 12, ["1", "2"])
    # the readable form: the Sink_k table, the layer x head grid and the massive-activation summary
    rc, out, err = run_cli("sinklab", "measure", str(ckpt), "--input", "random", "--num-seqs", "4", "--eps", "0.3",
                           "0.5", capsys=capsys)
    assert rc == 0, err
    assert "Sink_k (%)" in out and "eps=0.3" in out and "eps=0.5" in out
    assert "alpha_1 per layer and head" in out and "massive activations" in out and "residual sinks" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("0 ") and "|" in line]) == 1


def test_the_text_shows_every_metric_with_its_json_values(capsys, planted_ckpt):
    """Every registered metric has its own lines in the text, in the registry's order, with the values of the JSON:
    attention entropy, secondary sinks, the no-op signature and induction scores too (gates: none without a gate)."""
    _, ckpt, tokens = planted_ckpt
    res, text = json_and_text(capsys, ckpt, "--tokens", str(tokens))
    lines = text.splitlines()
    titles = {"sink": "Sink_k (%): heads with alpha_k > eps, per sequence, averaged",
              "outliers": "outliers per layer", "entropy": "attention entropy per layer",
              "first_token_attn": "first-token attention (alpha_1)", "induction": "induction and previous-token",
              "massive": "massive activations per layer", "secondary_sinks": "sinks at any position k <= 17",
              "noop": "no-op signature per layer", "norms": "first-token norms",
              "residual_sinks": "residual sinks per layer", "heads": "head types: the sink and the largest q / k"}
    assert res["gates"] == {} and "gate scores" not in text
    assert "sparse" not in res and "sparse attention" not in text  # a dense model: the sparse metric does not apply
    assert "recurrence" not in res  # nor the recurrence metric: no recurrent layer
    shown = [name for name in METRICS.names() if name not in ("gates", "sparse", "recurrence")]
    starts = [next(i for i, line in enumerate(lines) if line.startswith(titles[name]) and lines[i - 1] == "")
              for name in shown]
    assert starts == sorted(starts) and len(starts) == len(METRICS.names()) - 3
    e = res["entropy"]
    planted_head = e["by_head"][PLANT_LAYER][PLANT_HEAD]
    assert planted_head < 0.01 and planted_head == min(min(layer) for layer in e["by_head"])  # all on token 1
    assert f"{'all':>5} {e['mean']:7.3f} {planted_head:7.3f} {max(max(h) for h in e['by_head']):7.3f}" in lines
    ind = res["induction"]["by_layer"]
    for layer in range(2):
        assert f"{layer:>5} {ind['induction'][layer]:9.3f} {ind['prev_token'][layer]:8.3f}" in lines
    sec, noop = res["secondary_sinks"], res["noop"]
    assert sec["first_layer"] is None and "no secondary sink in any layer" in lines
    # the planted head's sink drains its value in layer 0; layer 1 has no sink: no ratio, '-'
    drain = noop["by_layer"]["value_drain_ratio"]
    assert drain[1] is None and f"{0:>5} {drain[0]:8.3f}" in text and f"{1:>5} {'-':>8}" in text
    assert f"first-token attention (alpha_1) {res['first_token_attn']['mean']:.4f}" in lines
    # every head RoPE: the heads metric's one type has the sink metric's values, the planted head among its sinks
    rope = res["heads"]["by_type"]["rope"]
    assert list(res["heads"]["by_type"]) == ["rope"] and rope["heads"] == 8 and rope["sink_share"] == 100.0
    assert (rope["sink1"], rope["alpha1"]) == (pytest.approx(res["sink"]["1"]),
                                               pytest.approx(res["alpha_mean"]["1"]))
    assert res["induction"]["by_type"]["rope"]["induction"] == res["induction"]["induction"]
    assert any(line.startswith("rope ") and f"{rope['sink1']:7.2f}" in line for line in lines)


@pytest.fixture
def throwaway_metrics(monkeypatch):
    """Two metrics registered for one test only (a copy of the registry, put back afterwards), neither with a text
    of its own: `peak_h` logs act/peak_h and act/layer<i>/peak_h, `column0` writes a JSON part of its own."""
    monkeypatch.setattr(METRICS, "_classes", dict(METRICS._classes))

    @METRICS.register("peak_h")
    class PeakH(Metric):
        """The largest |h| leaving each layer."""

        records = frozenset({"h"})
        bounds = ((r"^act/(layer\d+/)?peak_h$", NON_NEGATIVE),)
        json_key = "peak_h"

        def __init__(self, ctx):
            super().__init__(ctx)
            self.peak = [0.0] * ctx.n_layer

        def update(self, layer, rec):
            self.peak[layer] = max(self.peak[layer], rec["h"].abs().max().item())

        def result(self):
            return {"max": max(self.peak), "by_layer": self.peak}

        @staticmethod
        def flatten(result):
            return {"act/peak_h": result["max"],
                    **{f"act/layer{i}/peak_h": v for i, v in enumerate(result["by_layer"])}}

    @METRICS.register("column0")
    class Column0(Metric):
        records = frozenset({"maps"})
        json_key = "column0"

        def __init__(self, ctx):
            super().__init__(ctx)
            self.sums, self.count = [0.0] * ctx.n_layer, [0] * ctx.n_layer

        def update_maps(self, layer, rows, maps):
            self.sums[layer] += maps[..., self.ctx.n_extra].double().sum().item()  # (B, H, R): token 1's column
            self.count[layer] += maps[..., 0].numel()

        def result(self):
            return [s / n for s, n in zip(self.sums, self.count)]

        def json(self, result):
            return {"by_layer": {"token1": result}, "first_layer": result[0], "by_head": [[0.0]]}

    return PeakH, Column0


def test_a_new_metric_shows_in_the_text_without_a_text_of_its_own(capsys, planted_ckpt, throwaway_metrics):
    """A metric registered from outside sinklab appears in `sinklab measure`'s text by `Metric.text`'s default:
    its log scalars (a per-layer table of act/layer<i>/...), or the numbers of a JSON part of its own."""
    model, ckpt, tokens = planted_ckpt
    res, text = json_and_text(capsys, ckpt, "--tokens", str(tokens))
    lines = text.splitlines()
    # the values equal the residual stream's own largest |h| per layer
    h = {}
    handles = [b.hook_resid.register_forward_hook(lambda _m, _i, out, i=i: h.__setitem__(i, out.abs().max().item()))
               for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(torch.from_numpy(np.load(tokens)))
    for handle in handles:
        handle.remove()
    assert res["peak_h"]["by_layer"] == pytest.approx([h[0], h[1]], rel=1e-6)
    i = lines.index("peak_h: The largest |h| leaving each layer.")
    assert lines[i - 1] == "" and lines[i + 1] == f"act/peak_h {res['peak_h']['max']:.4g}"
    assert lines[i + 2:i + 5] == [f"{'layer':>5} {'act/peak_h':>10}",
                                  *(f"{layer:>5} {v:10.4g}" for layer, v in enumerate(res["peak_h"]["by_layer"]))]
    # a JSON part of its own: its numbers by their paths; lists of n_layer numbers per layer, others left out
    token1 = res["column0"]["by_layer"]["token1"]
    assert token1 == pytest.approx(res["first_token_attn"]["by_layer"], rel=1e-5)
    i = lines.index("column0")
    assert lines[i + 1:i + 5] == [f"first_layer {token1[0]:.4g}", f"{'layer':>5} {'by_layer/token1':>15}",
                                  *(f"{layer:>5} {value:15.4g}" for layer, value in enumerate(token1))]
    assert lines.index("peak_h: The largest |h| leaving each layer.") < i and i + 4 == len(lines) - 1  # registry order


def test_eps_values_before_or_after_target(capsys, planted_ckpt):
    _, ckpt, tokens = planted_ckpt
    results = []
    for args in ((str(ckpt), "--eps", "0.3", "0.1", "--tokens", str(tokens)),
                 ("--eps", "0.3", "0.1", str(ckpt), "--tokens", str(tokens)),
                 ("--tokens", str(tokens), "--eps", "0.3", "0.1", "--", str(ckpt))):
        rc, out, err = run_cli("sinklab", "measure", "--json", *args, capsys=capsys)
        assert rc == 0, (args, err)
        res = json.loads(out)
        assert (res["eps"], res["target"]) == ([0.3, 0.1], str(ckpt)), args
        results.append(res["sink_by_eps"])
    assert results[0] == results[1] == results[2]
    for bad in (("--eps", "abc", str(ckpt)), ("--eps", "0.3", "x", "y"), (str(ckpt), "--eps", "0.3", "other")):
        rc, out, err = run_cli("sinklab", "measure", *bad, capsys=capsys)
        assert rc == 2, (bad, err)
        assert_one_line_error(err, "--eps")


def test_natural_probe_set_from_run_dir(tmp_path, capsys):
    """The default input for a run dir is the probe set of its data module (sinklab.data.LMDataModule)."""
    try:
        from sinklab.data import LMDataModule  # noqa: F401
    except ImportError as err:
        pytest.skip(f"sinklab.data.LMDataModule is not available ({err}): the natural-input path cannot run")
    run, dm = natural_run(tmp_path)
    probe = dm.probe_tokens()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=dm.vocab_size, n_layer=2, n_head=4, d_model=32, d_ff=64,
                                    block_size=32)).eval()
    save_ckpt(model, run / "checkpoints" / "last.ckpt")
    rc, out, err = run_cli("sinklab", "measure", str(run), "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["input"] == "natural" and (res["num_seqs"], res["seq_len"]) == tuple(probe.shape) == (10, 16)
    direct = attention_scores(model, probe, k=4)
    np.testing.assert_allclose(res["alpha"], direct.alpha[..., 0].mean(0).numpy(), atol=1e-6)
    # another probe size is the data module's probe set at that size; the checkpoint path works as well
    rc, out, err = run_cli("sinklab", "measure", str(run / "checkpoints" / "last.ckpt"), "--json", "--seq-len", "24",
                           "--num-seqs", "3", capsys=capsys)
    assert rc == 0, err
    assert (json.loads(out)["num_seqs"], json.loads(out)["seq_len"]) == (3, 24)


# ------------------------------------------------------------------------------------------------ errors
def test_user_errors_are_one_line_exit_2(capsys, tmp_path, planted_ckpt):
    _, ckpt, tokens = planted_ckpt
    np.save(tmp_path / "float.npy", np.zeros((2, 8), dtype=np.float32))
    np.save(tmp_path / "flat.npy", np.zeros(8, dtype=np.int64))
    np.save(tmp_path / "big.npy", np.full((2, 8), 64, dtype=np.int64))
    cases = [
        ((str(tmp_path / "missing.ckpt"), "--input", "random"), "TARGET"),
        ((str(ckpt), "--tokens", str(tmp_path / "float.npy")), "--tokens"),
        ((str(ckpt), "--tokens", str(tmp_path / "flat.npy")), "--tokens"),
        ((str(ckpt), "--tokens", str(tmp_path / "big.npy")), "--tokens"),
        ((str(ckpt), "--input", "random", "--seq-len", "33"), "--seq-len"),
        ((str(ckpt), "--input", "random", "--seq-len", "4", "--k", "5"), "--k"),
        ((str(ckpt),), "--input random"),  # a bare .ckpt has no probe set
        ((str(ckpt), "--input", "natural"), "--input natural"),
        ((str(ckpt), "--tokens", str(tokens), "--seq-len", "8"), "--seq-len"),
        (("--hf-model", str(tmp_path / "no_such_dir"), "--input", "random"), "--hf-model"),
        (("--input", "random"), "TARGET"),
    ]
    for args, named in cases:
        rc, out, err = run_cli("sinklab", "measure", *args, capsys=capsys)
        assert rc == 2, (args, out, err)
        assert out == "", (args, out)
        assert_one_line_error(err, named)


@pytest.mark.slow
@pytest.mark.ci
def test_hf_model_without_transformers_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; from sinklab.cli.measure import main; "
            f"sys.exit(main(['--hf-model', {str(tmp_path)!r}, '--input', 'random']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["sinklab measure: error: --hf-model needs transformers, an optional "
                                                "extra: pip install 'sinklab[hf]'"]


# ------------------------------------------------------------------------------------------------ HF models
def measure_hf_json(capsys, d: Path, *args: str, via_cli: bool = False) -> dict:
    if via_cli:  # as a user runs it
        proc = run_cli("sinklab", "measure", "--hf-model", str(d), "--json", *args, process=True, env=ENV)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", str(d), "--json", *args, capsys=capsys)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_model_json_matches_output_attentions(capsys, hf_models, kind):
    """Every architecture: the streamed maps (one layer at a time, from the attention modules' outputs) give the
    alpha_k and Sink_k of the eager `output_attentions`; gpt-oss's learned sink logits are the slot `sink_logit`,
    whose attention is 1 - the row's sum."""
    transformers = pytest.importorskip("transformers")
    d = hf_models[kind]
    res = measure_hf_json(capsys, d, "--input", "random", "--num-seqs", "4", "--seq-len", "24", "--batch-size", "3",
                          via_cli=kind == "llama")
    assert (res["source"], res["num_seqs"], res["seq_len"], res["row_normalised"]) == ("hf", 4, 24, True)
    assert set(SCHEMA) <= set(res) and res["sink_star"] == res["sink"] and "alpha_star" not in res
    assert set(res["norms"]) == set(NORM_KEYS)  # the key statistics as well, for every family here
    assert res["dtype"] == "float32" and res["model"]["sink_logits"] == (kind == "gpt_oss")

    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), attn_implementation="eager").eval()
    tok = make_tokens("random", 4, 24, 128, seed=0)
    with torch.no_grad():
        out = model(input_ids=tok, output_attentions=True, output_hidden_states=True)
    maps = torch.stack(out.attentions, 1)  # (N, L, H, T, T)
    alpha = torch.stack([maps[..., j:, j].mean(-1) for j in range(4)], -1)  # (N, L, H, K)
    np.testing.assert_allclose(res["alpha"], alpha[..., 0].mean(0).numpy(), atol=1e-5)
    assert np.ptp(np.array(res["alpha"])[0]) > 0.01  # layer 0's heads differ: a meaningful comparison
    for j in range(4):
        assert res["alpha_mean"][str(j + 1)] == pytest.approx(alpha[..., j].mean().item(), abs=1e-5)
        assert res["sink"][str(j + 1)] == pytest.approx(100.0 * (alpha[..., j] > 0.3).float().mean().item())
    if kind == "gpt_oss":  # the rows sum to less than one: the rest is on the sink logit
        assert (maps.sum(-1) < 0.999).all()
        sink = (1 - maps.sum(-1)).mean(-1)  # (N, L, H): the sink logit's attention, mean over queries
        np.testing.assert_allclose(res["slot_alpha"]["sink_logit"], sink.mean(0).numpy(), atol=1e-5)
        assert res["slot"]["sink_logit"] == pytest.approx(100.0 * (sink > 0.3).float().mean().item())
    else:
        assert "slot" not in res
    # residual stream of layer 0 (HF's hidden_states[1]; the last entry is after the final norm)
    h = out.hidden_states[1]
    norms = h.norm(dim=-1)
    assert res["norms"]["h1_norm_ratio"][0] == pytest.approx((norms[:, 0] / norms[:, 1:].mean(-1)).mean().item(),
                                                             rel=1e-5)
    assert res["massive"]["top"][0] == pytest.approx(h.abs().max().item(), rel=1e-6)
    assert len(res["massive"]["top"]) == 2
    # outliers and residual sinks from the same hooks (no norm weights for HF models)
    assert set(res["outliers"]) == set(OUTLIER_KEYS)
    assert res["outliers"]["resid_inf_norm"][0] == pytest.approx(h.abs().amax(dim=(1, 2)).mean().item(), rel=1e-6)
    np.testing.assert_allclose(res["residual_sinks"]["h_avg"][0], h.abs().mean(dim=(0, 1)).numpy(), rtol=1e-5)
    assert "attn_norm_min" not in res["residual_sinks"] and len(res["residual_sinks"]["channel"]) == 2


@pytest.fixture(scope="module")
def capture_attention():
    """An attention implementation registered with transformers' AttentionInterface (and the eager mask) that
    records the (query, key, value) each attention layer computes with, then runs the family's own eager attention
    (`eager_attention_forward` of its modeling module). This is where the model itself hands over its keys after its
    norms and RoPE: independent of sinklab.targets.transformers_lm's recomputation."""
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen.append((query, key, value))  # (B, H, T, hd), keys and values (B, H_kv, T, hd)
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value,
                                                                           attention_mask, **kwargs)

    transformers.AttentionInterface.register("sinklab_test_capture", capture)
    AttentionMaskInterface.register("sinklab_test_capture", eager_mask)
    return seen


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_key_value_norms_and_angles(capsys, hf_models, kind, capture_attention):
    """k1 / v1 norm ratios and cos(q_t, k_1) / cos(q_t, k_j) per layer against the queries, keys (after RoPE) and
    values the model attends with, recorded at its attention call, and a pairwise computation of the definitions."""
    transformers = pytest.importorskip("transformers")
    d = hf_models[kind]
    N, T = 4, 20
    res = measure_hf_json(capsys, d, "--input", "random", "--num-seqs", str(N), "--seq-len", str(T),
                          "--batch-size", "3")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), attn_implementation="sinklab_test_capture")
    capture_attention.clear()
    with torch.no_grad():
        model.eval()(input_ids=make_tokens("random", N, T, 128, seed=0))
    assert len(capture_attention) == 2
    for layer, (q, k, v) in enumerate(capture_attention):
        H, H_kv = q.shape[1], k.shape[1]
        assert (H, H_kv) == ((4, 4) if kind in MHA_KINDS else (4, 2))
        k_norm = k.transpose(1, 2).reshape(N, T, -1).norm(dim=-1)  # (N, H_kv, T, hd) -> (N, T, H_kv * hd) -> (N, T)
        v_norm = v.transpose(1, 2).reshape(N, T, -1).norm(dim=-1)
        expect = {"k1_norm_ratio": (k_norm[:, 0] / k_norm[:, 1:].mean(-1)).mean().item(),
                  "v1_norm_ratio": (v_norm[:, 0] / v_norm[:, 1:].mean(-1)).mean().item()}
        k_of_head = k[:, torch.arange(H) // (H // H_kv)]  # query head h reads kv head h // (H / H_kv)
        cos = F.cosine_similarity(q[:, :, :, None], k_of_head[:, :, None], dim=-1)  # (N, H, T_q, T_k)
        expect["cos_q_k1"] = cos[:, :, 1:, 0].mean().item()  # queries 2..T
        expect["cos_q_kj"] = torch.stack([cos[:, :, t, 1:t + 1].mean(-1) for t in range(1, T)], -1).mean().item()
        for key, value in expect.items():
            assert res["norms"][key][layer] == pytest.approx(value, rel=1e-4, abs=1e-6), (kind, layer, key)
    # the statistics are not trivially equal across layers (a wrong layer index would be caught); with q_norm /
    # k_norm (Qwen3, Gemma3, OLMo2) the key norms are ~equal by construction, the angles are not
    assert any(res["norms"][key][0] != pytest.approx(res["norms"][key][1], rel=1e-3)
               for key in ("k1_norm_ratio", "cos_q_k1"))


def test_hf_tokens_and_repeat(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tiny_hf("llama", tmp_path / "llama")
    tok = make_tokens("random", 3, 20, 128, seed=5).numpy().astype(np.int32)
    np.save(tmp_path / "t.npy", tok)
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", str(d), "--tokens", str(tmp_path / "t.npy"), "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), attn_implementation="eager").eval()
    with torch.no_grad():
        maps = torch.stack(model(input_ids=torch.from_numpy(tok).long(), output_attentions=True).attentions, 1)
    np.testing.assert_allclose(res["alpha"], maps[..., :, 0].mean(-1).mean(0).numpy(), atol=1e-5)
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", str(d), "--input", "repeat", "--num-seqs", "2", "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert (res["input"], res["seq_len"]) == ("repeat", 64)  # default T = min(64, context)
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", str(d), "--input", "random", "--seq-len", "65",
                           capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "--seq-len")


# ------------------------------------------------------------------------------------------------ training callback
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two optimizer steps of a tiny model on the synthetic task with the sink callback (measurement and validation
    at step 2), a CSV logger and an offline wandb logger, and a checkpoint saved at step 2 (before the validation)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from sinklab.data.synthetic import SyntheticDataModule
    from sinklab.train.callbacks import SinkCallback
    from sinklab.train.module import LitLM

    root = tmp_path_factory.mktemp("fit")
    torch.manual_seed(0)
    dm = SyntheticDataModule(n_tokens=16, block_size=16, batch_size=4, val_num_blocks=2, probe_num_seqs=3,
                             probe_seq_len=16, pad_vocab_to_multiple_of=8)
    lit = LitLM(model=dict(vocab_size=dm.vocab_size, n_layer=2, n_head=2, d_model=16, d_ff=32, block_size=16),
                optim=dict(lr=1e-3, weight_decay=0.0), max_steps=2)
    sink = SinkCallback(every_n_steps=2, batch_size=8)
    wandb_logger = WandbLogger(save_dir=str(root), offline=True, project="sinklab-test")
    trainer = L.Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                        callbacks=[sink, ModelCheckpoint(dirpath=root / "checkpoints", filename="step2",
                                                         every_n_train_steps=2, save_top_k=-1)],
                        logger=[CSVLogger(str(root), name="csv", version=0), wandb_logger], log_every_n_steps=1,
                        default_root_dir=str(root), accelerator="cpu", devices=1, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(lit, datamodule=dm)
        yield trainer, lit, sink, root, wandb_logger
    finally:
        wandb_logger.experiment.finish()


def test_sink_callback_logs_every_act_scalar_and_the_heatmap_to_wandb(trained):
    import csv

    trainer, _, sink, root, wandb_logger = trained
    with open(root / "csv" / "version_0" / "metrics.csv") as f:
        row = next(r for r in csv.DictReader(f) if r.get("sink/sink1") not in (None, ""))
    assert int(row["step"]) == 2
    for layer in range(2):
        for key in STAT_KEYS:
            assert row[f"act/layer{layer}/{key}"] != "", (layer, key)
    assert all(row[f"act/{key}"] != "" for key in ("massive_ratio", "h1_norm_ratio", "k1_norm_ratio", "cos_q_k1",
                                                   "resid_inf_norm", "attn_kurtosis", "resid_sink_channel_share",
                                                   "norm_min", "final_norm_min", "first_token_attn"))
    assert float(row["act/first_token_attn"]) == float(row["sink/alpha1"])
    assert float(row["heads/rope/sink1"]) == float(row["sink/sink1"])  # every head RoPE: one type, the sink's values
    assert row["heads/rope/qk_max_partial_cycle"] != "" and row["heads/rope/induction"] != ""
    assert (root / "sink_heatmaps" / "alpha1_step0000002.png").is_file()
    # WandbLogger.log_image turned the PNG into a wandb.Image: the offline run holds it as media
    media = Path(wandb_logger.experiment.dir) / "media" / "images" / "sink"
    assert [p.name for p in media.glob("alpha1_heatmap_*.png")], list(Path(wandb_logger.experiment.dir).rglob("*"))


def test_sink_callback_validation_after_resume_without_the_map(trained):
    """A resumed run can validate at the restored step before measuring (Lightning finishes an interrupted
    validation first). The map is saved with the callback state; a state without it (an older checkpoint) makes
    the callback measure again for the heatmap without logging the step's scalars twice."""
    from sinklab.train.callbacks import SinkCallback

    trainer, lit, sink, root, _ = trained
    ckpt = torch.load(root / "checkpoints" / "step2.ckpt", map_location="cpu", weights_only=True)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("SinkCallback"))
    assert state["last_step"] == state["alpha1_step"] == 2
    assert torch.equal(torch.tensor(state["alpha1"]), sink._alpha1)
    heatmap = root / "sink_heatmaps" / "alpha1_step0000002.png"
    csv_path = root / "csv" / "version_0" / "metrics.csv"
    rows_before = csv_path.read_text()

    legacy = {k: v for k, v in state.items() if k not in ("alpha1", "alpha1_step")}
    resumed = SinkCallback(every_n_steps=2, batch_size=8)
    resumed.load_state_dict(legacy)
    heatmap.unlink()
    resumed.on_validation_end(trainer, lit)  # the state's step (2) is the trainer's; no map in the state
    assert heatmap.is_file() and resumed._alpha1_step == 2 and resumed.seconds > legacy["seconds"]
    torch.testing.assert_close(resumed._alpha1, sink._alpha1)  # the same weights, the same probe set
    assert resumed.last == legacy["last"] and csv_path.read_text() == rows_before  # nothing logged again

    restored = SinkCallback(every_n_steps=2, batch_size=8)
    restored.load_state_dict(state)
    heatmap.unlink()
    restored.on_validation_end(trainer, lit)
    assert heatmap.is_file() and restored.seconds == state["seconds"]  # drawn from the saved map, no measurement


def test_past_context_measures_a_rope_model_beyond_its_context(capsys, tmp_path, planted_ckpt):
    """--past-context (RoPE-ID's length-extrapolation reading, issue 37): sequences twice the trained context, the
    same maps as the model's own forward past its context; without the flag, or for absolute positions, one line."""
    model, ckpt, _ = planted_ckpt
    long = tmp_path / "long.npy"
    np.save(long, bos_tokens(n=4, T=64))
    res, _ = json_and_text(capsys, ckpt, "--tokens", long, "--past-context")
    assert res["seq_len"] == 64 and res["past_context"] == {"context": 32, "seq_len": 64}
    model.past_context = True
    try:
        direct = attention_scores(model, torch.as_tensor(np.load(long)), k=4)
    finally:
        model.past_context = False
    np.testing.assert_allclose(res["alpha"], direct.alpha[..., 0].mean(0).numpy(), atol=1e-6)
    assert res["alpha"][PLANT_LAYER][PLANT_HEAD] > 0.9  # the planted head still finds token 1 at 64 tokens
    rc, out, err = run_cli("sinklab", "measure", str(ckpt), "--tokens", str(long), capsys=capsys)
    assert rc == 2 and "exceeds the model context" in err
    absolute = save_ckpt(planted("token1", pos="learnable").eval(), tmp_path / "abs.ckpt")
    for args, named in [((str(absolute), "--input", "random", "--seq-len", "64", "--past-context"), "--past-context"),
                        ((str(ckpt), "--input", "random", "--seq-len", "16", "--past-context"), "--past-context"),
                        ((str(ckpt), "--input", "random", "--seq-len", "64"), "--past-context")]:
        rc, out, err = run_cli("sinklab", "measure", *args, capsys=capsys)
        assert rc == 2 and out == "", (args, out, err)
        assert_one_line_error(err, named)
