"""`sinklab eval intervene` per layer and per head: a `LayerMask` (a mask some layers / query heads obey) and the
first token's value set to 0 act where they say and nowhere else, on every attention path, in the maps the metrics
read, and alike in sinklab's model and in transformers'; --layers, --per-layer and --per-head end to end."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from sinklab.cli.intervene import format_table
from sinklab.errors import UserError
from sinklab.evals.interventions import drop_first_key
from sinklab.metrics import attention_maps
from sinklab.metrics.record import measure_model
from sinklab.model import Transformer
from sinklab.model.masks import LayerMask
from sinklab.targets import SinklabTarget
from tests.helpers import assert_one_line_error, layer_records, run_cli, small_model, token_ids


@pytest.mark.parametrize("case", [{}, {"attn_backend": "explicit"}, {"n_sink_tokens": 1, "attn_bias": "kv"},
                                  {"attn_op": "sigmoid"}, {"window": 5}],
                         ids=["sdpa", "explicit", "sinks_kv_bias", "sigmoid", "window"])
def test_a_layer_mask_of_every_layer_and_head_is_the_plain_mask(case):
    m = small_model(**case)
    idx = token_ids(B=2, T=12)
    mask = drop_first_key(m.cfg.n_sink_tokens)
    with torch.no_grad():
        plain = m(idx, extra_mask=mask)
        everywhere = m(idx, extra_mask=LayerMask(mask))
        named = m(idx, extra_mask=LayerMask(mask, layers=range(m.cfg.n_layer), heads=range(m.cfg.n_head)))
        unchanged = m(idx)
    torch.testing.assert_close(everywhere, plain, atol=0, rtol=0)
    torch.testing.assert_close(named, plain, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(plain, unchanged, atol=1e-3)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "explicit"])
@pytest.mark.parametrize("sinks", [0, 1], ids=["no_sink_token", "sink_token"])
def test_a_mask_in_one_layer_changes_its_map_and_nothing_upstream(backend, sinks):
    """In layer 1 of 3 (every head, then head 2 alone): layer 0's residual stream and map are those of the unchanged
    model, layer 1's masked heads lose the first token's column for every later query and its other heads keep
    their map; the fused kernel gives the explicit path's output."""
    m = small_model(n_layer=3, attn_backend=backend, n_sink_tokens=sinks)
    idx, S = token_ids(B=2, T=12), sinks
    with torch.no_grad():
        before = [r["h"] for r in layer_records(m, idx)]
        maps_before = attention_maps(m, idx)
        for heads in (None, [2]):
            mask = LayerMask(drop_first_key(S), [1], heads)
            after = [r["h"] for r in layer_records(m, idx, extra_mask=mask)]
            explicit = [r["h"] for r in layer_records(m, idx, explicit=True, extra_mask=mask)]
            maps = attention_maps(m, idx, extra_mask=mask)
            torch.testing.assert_close(after[2], explicit[2], atol=2e-5, rtol=1e-5)
            assert torch.equal(after[0], before[0]) and torch.equal(maps[0], maps_before[0])
            assert not torch.allclose(after[1], before[1], atol=1e-4)
            for head in range(m.cfg.n_head):
                a, b = maps[1][:, head], maps_before[1][:, head]  # (B, S + T, n_keys)
                if heads is None or head in heads:
                    assert (a[:, S + 1:, S] == 0).all() and (b[:, S + 1:, S] > 0).all() and (a[:, S, S] > 0).all()
                else:
                    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_metrics_read_the_maps_of_a_mask_in_one_layer_and_head():
    """The sink metric under a mask of head 2 in layer 1: that head's alpha_1 is query 1's own 1 / T, the other heads
    of layers 0 and 1 keep theirs, layer 2 (downstream) changes; the sparse metric's visible_1 of that head is 1 / T
    (only query 1 sees token 1), every other head's as without the mask."""
    m, probe, T = small_model(n_layer=3), token_ids(B=3, T=16), 16
    target = SinklabTarget.of_model(m)
    mask = LayerMask(drop_first_key(0), [1], [2])
    with torch.no_grad():
        (plain,) = target.measure(probe, ["sink"], k=1)
        with target.masked(mask):
            (masked,) = target.measure(probe, ["sink"], k=1)
    a, b = masked.scores().alpha[..., 0], plain.scores().alpha[..., 0]  # (N, L, H)
    torch.testing.assert_close(a[:, 1, 2], torch.full_like(a[:, 1, 2], 1 / T))
    assert (b[:, 1, 2] > 1.5 / T).all()
    kept = torch.ones(3, 4, dtype=torch.bool)
    kept[1, 2] = kept[2] = False
    torch.testing.assert_close(a[:, kept], b[:, kept], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 2], b[:, 2], atol=1e-4)

    windowed = small_model(n_layer=3, window=5)
    (sparse,) = measure_model(windowed, probe, ["sparse"], k=2, extra_mask=mask)
    (sparse_plain,) = measure_model(windowed, probe, ["sparse"], k=2)
    vis, vis_plain = sparse.result()["visible"][..., 0], sparse_plain.result()["visible"][..., 0]  # (N, L, H)
    assert torch.equal(vis[:, 1, 2], torch.full_like(vis[:, 1, 2], 1 / T))
    assert torch.equal(vis[:, kept], vis_plain[:, kept]) and (vis_plain[:, 1, 2] > 1 / T).all()


def test_a_recurrent_layer_refuses_a_mask_in_one_line():
    m = small_model(attn_op="gated_deltanet")
    idx = token_ids(B=1, T=8)
    for mask in (LayerMask(drop_first_key(0), [1]), LayerMask(drop_first_key(0), [0], [1])):
        with pytest.raises(UserError) as err:
            m(idx, extra_mask=mask)
        assert "a mask of an intervention (a key dropped) does not apply to it" in str(err.value)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------- zero_value_first
@pytest.mark.parametrize("case", [{}, {"n_sink_tokens": 1, "attn_bias": "kv"}, {"n_kv_head": 2}],
                         ids=["plain", "sinks_kv_bias", "gqa"])
def test_zero_value_first_is_the_attention_output_with_that_value_zeroed_by_hand(case):
    """Layer 1's attention output under zero_value(layer 1, the first text token) is A @ v with that token's value
    row set to 0 in every head (A the unchanged map, which stays as it was); layer 0 is untouched."""
    m = small_model(n_layer=3, **case)
    target = SinklabTarget.of_model(m)
    idx, S, attn = token_ids(B=2, T=12), m.cfg.n_sink_tokens, m.blocks[1].attn
    outputs = []
    handle = attn.register_forward_hook(lambda _m, _i, out: outputs.append(out))
    try:
        with torch.no_grad():
            before, maps_before = layer_records(m, idx), attention_maps(m, idx)
            with target.zero_value([1], S):
                after, maps_after = layer_records(m, idx), attention_maps(m, idx)
    finally:
        handle.remove()

    def by_hand(v: torch.Tensor) -> torch.Tensor:  # (B, H, n_keys, hd) -> the attention output (B, N, d)
        o = maps_before[1] @ v  # (B, H, N, hd)
        return attn.o_proj(o.transpose(1, 2).flatten(2))

    v = before[1]["v"].clone()
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], by_hand(v), atol=1e-5, rtol=1e-5)  # the hand computation is the layer's
        v[:, :, m.cfg.n_slots + S] = 0
        torch.testing.assert_close(outputs[2], by_hand(v), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs[2], outputs[0], atol=1e-4)
    assert (after[1]["v"][:, :, m.cfg.n_slots + S] == 0).all() and torch.equal(after[0]["v"], before[0]["v"])
    assert torch.equal(after[0]["h"], before[0]["h"]) and torch.equal(maps_after[1], maps_before[1])
    assert not torch.allclose(after[2]["h"], before[2]["h"], atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(layer_records(m, idx)[2]["h"], before[2]["h"], atol=0, rtol=0)  # nothing stays


# ------------------------------------------------------------------------------------------------ transformers models
def imported_llama() -> tuple:
    """A tiny random transformers LLaMA and the same model imported into sinklab (`sinklab import-hf`'s conversion),
    as the two targets."""
    pytest.importorskip("transformers")
    from sinklab.export.hf_import import model_config, sinklab_state_dict
    from sinklab.targets import TransformersTarget
    from tests.helpers.hf_models import build, sharpen

    torch.manual_seed(0)
    hf = build("llama")
    sharpen("llama", hf)
    hf.eval().set_attn_implementation("eager")
    cfg = model_config(hf.config, 128)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(sinklab_state_dict(hf.state_dict(), cfg.n_layer, cfg.tie_embeddings))
    return SinklabTarget.of_model(ours), TransformersTarget.of_model(hf, "llama")


@pytest.mark.parametrize("layer", [0, 1])
def test_sinklab_and_transformers_agree_on_each_intervention_in_one_layer(layer):
    """mask_first in one layer, in two of its query heads (of different kv heads), and zero_value_first in one layer:
    the same logits from the imported model as from transformers', and the same alpha_1 per head in the maps their
    metrics read."""
    ours, theirs = imported_llama()
    idx = token_ids(B=2, T=16, vocab=128)
    interventions = {"mask_first": lambda t: t.masked(LayerMask(drop_first_key(0), [layer])),
                     "mask_first_heads": lambda t: t.masked(LayerMask(drop_first_key(0), [layer], [1, 2])),
                     "zero_value_first": lambda t: t.zero_value([layer], 0)}
    with torch.no_grad():
        plain = ours.logits(idx)
        torch.testing.assert_close(theirs.logits(idx), plain, atol=1e-5, rtol=1e-5)
        for name, opened in interventions.items():
            with opened(ours), opened(theirs):
                a, b = ours.logits(idx), theirs.logits(idx)
                (sink_a,), (sink_b,) = ours.measure(idx, ["sink"], k=1), theirs.measure(idx, ["sink"], k=1)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
            assert not torch.allclose(a, plain, atol=1e-3), name
            alpha_a, alpha_b = sink_a.scores().alpha[..., 0], sink_b.scores().alpha[..., 0]  # (N, L, H)
            torch.testing.assert_close(alpha_a, alpha_b, atol=1e-5, rtol=1e-5, msg=name)
            if name == "mask_first_heads":
                torch.testing.assert_close(alpha_b[:, layer, 1:3], torch.full_like(alpha_b[:, layer, 1:3], 1 / 16))
                assert (alpha_b[:, layer, [0, 3]] > 1.5 / 16).all()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_transformers_zero_value_is_the_value_projection_zeroed(kind):
    """zero_value through the attention interface equals the value projection's output row set to 0 by a hook:
    LLaMA's v_proj, GPT-2's fused c_attn (its last third)."""
    pytest.importorskip("transformers")
    from sinklab.targets import TransformersTarget
    from tests.helpers.hf_models import build, sharpen

    torch.manual_seed(0)
    hf = build(kind)
    sharpen(kind, hf)
    hf.eval().set_attn_implementation("eager")
    target = TransformersTarget.of_model(hf, kind)
    if kind == "llama":
        projection, values = hf.model.layers[1].self_attn.v_proj, slice(None)
    else:
        projection, values = hf.transformer.h[1].attn.c_attn, slice(2 * hf.config.n_embd, None)

    def zeroed(_module, _inputs, out):
        out = out.clone()
        out[:, 3, values] = 0
        return out

    idx = token_ids(B=2, T=12, vocab=128)
    with torch.no_grad():
        plain = target.logits(idx)
        with target.zero_value([1], 3):
            ours = target.logits(idx)
        handle = projection.register_forward_hook(zeroed)
        try:
            by_hand = target.logits(idx)
        finally:
            handle.remove()
    torch.testing.assert_close(ours, by_hand, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[:, :3], plain[:, :3])  # causal: the queries before position 3 never see it
    assert not torch.allclose(ours[:, 3:], plain[:, 3:], atol=1e-4)
    assert hf.config._attn_implementation == "eager"


# ----------------------------------------------------------------------------------------------------- the command
def test_per_layer_and_per_head_end_to_end(small_run, capsys):
    run, _, _ = small_run
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--interventions", "mask_first",
                           "zero_value_first", "--per-layer", "--per-head", "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    base = res["rows"]["none"]["ppl"]
    assert res["layers"] == [0, 1] and list(res["per_layer"]) == ["mask_first", "zero_value_first"]
    for rows in res["per_layer"].values():
        assert [r["layer"] for r in rows] == [0, 1]
        assert all(r["ppl"] >= 1 and r["dppl"] == pytest.approx(r["ppl"] - base) for r in rows)
    heads = res["per_head"]["mask_first"]
    assert [(h["layer"], h["head"]) for h in heads] == [(layer, head) for layer in (0, 1) for head in range(4)]
    assert all(h["ppl"] >= 1 and 0 <= h["alpha1"] <= 1 and h["dppl"] == pytest.approx(h["ppl"] - base)
               for h in heads)
    assert len({h["ppl"] for h in heads}) > 1  # one head at a time, not every head
    # the heads' alpha_1 are the unchanged model's: their mean is its alpha_1
    assert sum(h["alpha1"] for h in heads) / len(heads) == pytest.approx(res["rows"]["none"]["alpha1"], abs=1e-6)
    rho = res["per_head"]["spearman_alpha1_dppl"]
    assert rho is not None and -1 <= rho <= 1

    # mask_first in layer 1 alone is --layers 1's mask_first; its alpha_1: 1 / T in layer 1, layer 0's as unchanged
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--interventions", "mask_first", "--layers", "1",
                           "--json", capsys=capsys)
    assert rc == 0, err
    one = json.loads(out)
    assert one["layers"] == [1]
    assert one["rows"]["mask_first"]["ppl"] == pytest.approx(res["per_layer"]["mask_first"][1]["ppl"], rel=1e-6)
    layer0 = sum(h["alpha1"] for h in heads if h["layer"] == 0) / 4
    assert one["rows"]["mask_first"]["alpha1"] == pytest.approx((layer0 + 1 / 16) / 2, abs=1e-6)

    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--interventions", "mask_first", "--layers", "1",
                           "--per-layer", "--per-head", capsys=capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert "mask_first in layers 1" in lines
    start = lines.index("each in one layer alone:")
    assert lines[start + 2].split()[0] == "1" and len(lines[start + 2].split()) == 3
    heads_at = next(i for i, line in enumerate(lines) if line.startswith("mask_first in one head alone, the 4 "))
    rows = [line.split() for line in lines[heads_at + 2:]]  # layer, head, val ppl, d ppl, alpha_1: costliest first
    assert [r[0] for r in rows] == ["1"] * 4 and sorted(r[1] for r in rows) == ["0", "1", "2", "3"]
    assert [float(r[3]) for r in rows] == sorted((float(r[3]) for r in rows), reverse=True)

    # a perplexity past 10^6 (a masked sink: SmolLM2's, the hybrids') keeps its column apart from the next one
    for row in [res["rows"]["mask_first"], res["per_layer"]["mask_first"][0], res["per_head"]["mask_first"][0]]:
        row["ppl"], row["dppl"] = 5020932.657, 5020932.657 - base
    lines = format_table(res).splitlines()
    row = lines[next(i for i, line in enumerate(lines) if line.startswith("mask_first "))].split()
    assert row[1:3] == ["5.02e+06", f"{5020932.657 - base:+.2e}"] and len(row) == 5  # name, ppl, d ppl, Sink_1, alpha_1
    layer_row = lines[lines.index("each in one layer alone:") + 2].split()
    assert layer_row[:3] == ["0", "5020932.657", f"{5020932.657 - base:+.2e}"] and len(layer_row) == 5  # 22 wide
    heads_at = next(i for i, line in enumerate(lines) if line.startswith("mask_first in one head alone"))
    assert lines[heads_at + 2].split()[2:4] == ["5.02e+06", f"{5020932.657 - base:+.2e}"]


@pytest.mark.parametrize("args,message", [
    (["--layers", "99"], "--layers 99: layer 99 is out of range; allowed: 0..1 (the model's 2 layers, 0-based)"),
    (["--layers", "0,x"], "argument --layers: '0,x' is not a comma-separated list of integers >= 0"),
    (["--per-layer", "--interventions", "zero", "mask_random"],
     "--per-layer applies mask_first and zero_value_first layer by layer; --interventions names neither")])
def test_bad_layer_options_are_refused_in_one_line_and_nothing_is_written(small_run, tmp_path, capsys, args, message):
    run, _, _ = small_run
    rc, out, err = run_cli("sinklab", "eval", "intervene", str(run), "--json", *args, capsys=capsys)
    assert rc == 2 and out == ""
    assert_one_line_error(err, message)
    sweep = tmp_path / "sweep"
    shutil.copytree(run, sweep / "0")
    rc, out, err = run_cli("sinklab", "eval", "intervene", "--sweep", str(sweep), *args, capsys=capsys)
    assert rc == 2 and message in err
    assert not (sweep / "0" / "intervene.json").exists() and not (sweep / "intervene.csv").exists()
