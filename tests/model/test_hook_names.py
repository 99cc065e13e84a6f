"""TransformerLens's hook names on sinklab models (`sinklab.model.hooked`) and the Target's `run_with_cache` /
`run_with_hooks`: every name on every layer in TransformerLens's shapes, the cached pattern is the map the metrics
score (for every registered component), reading changes no logit, hooks ablate and are removed (also after an
error), BOS is prepended as `sinklab measure` has it, and a third-party reader (attnview) renders a sinklab cache."""
import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from sinklab.errors import UserError
from sinklab.metrics.record import attention_maps, measure_model
from sinklab.model.hooked import hook_names, run_with_cache
from sinklab.targets import SinklabTarget, TargetSpec
from tests.helpers import assert_one_line_error, component_cases, doc_section, save_ckpt, small_model

T = 12
# a model with every kind of extra position and head sharing: 2 learned sink tokens, a KV bias slot, 2 kv heads
EXTRAS = dict(n_sink_tokens=2, attn_bias="kv", n_kv_head=2)


def tokens(B: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))


def no_hooks_left(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_every_layer_has_the_names_in_transformer_lens_shapes():
    model = small_model(**EXTRAS)
    cfg, B = model.cfg, 2
    P, H, Hkv, hd, d = cfg.n_sink_tokens + T, cfg.n_head, cfg.kv_heads, cfg.hd, cfg.d_model
    logits, cache = SinklabTarget.of_model(model).run_with_cache(tokens(B))
    per_layer = {"hook_resid_pre": (B, P, d), "hook_resid_mid": (B, P, d), "hook_resid_post": (B, P, d),
                 "hook_attn_out": (B, P, d), "hook_mlp_out": (B, P, d), "attn.hook_q": (B, P, H, hd),
                 "attn.hook_k": (B, P, Hkv, hd), "attn.hook_v": (B, P, Hkv, hd), "attn.hook_rot_q": (B, P, H, hd),
                 "attn.hook_rot_k": (B, P, Hkv, hd), "attn.hook_attn_scores": (B, H, P, P),
                 "attn.hook_pattern": (B, H, P, P), "attn.hook_slot_pattern": (B, H, P, 1),
                 "attn.hook_z": (B, P, H, hd)}
    expected = {"hook_embed": (B, T, d), "ln_final.hook_normalized": (B, T, d),
                **{f"blocks.{i}.{n}": s for i in range(cfg.n_layer) for n, s in per_layer.items()}}
    assert {n: tuple(t.shape) for n, t in cache.items()} == expected
    assert logits.shape == (B, T, cfg.vocab_size)
    assert torch.equal(logits, model(tokens(B)))  # reading every activation changes no logit
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["z", -1] is cache["blocks.1.attn.hook_z"]
    assert ("pattern", 2) not in cache and ("pattern", 0) in cache
    # before / after RoPE: equal at position 0 (no rotation there), different after it
    q, rot_q = cache["q", 0], cache["rot_q", 0]
    assert torch.equal(q[:, 0], rot_q[:, 0]) and not torch.allclose(q[:, 1:], rot_q[:, 1:])
    # resid_post is sinklab's hook_resid, the next block's input; the scores' softmax is the map with its slot
    assert torch.equal(cache["resid_post", 0], cache["resid_pre", 1])
    full = torch.cat([cache["slot_pattern", 0], cache["pattern", 0]], -1)  # softmax: a row's share on the slot too
    assert torch.allclose(full.sum(-1), torch.ones(()), atol=1e-6)
    assert torch.isinf(cache["attn_scores", 0][0, 0, 0, -1]) and cache["attn_scores", 0][0, 0, 0, 0].isfinite()


@pytest.mark.parametrize("overrides", [{}, dict(pos="alibi"), dict(norm_position="post"), dict(attn_op="differential")],
                         ids=["rope", "alibi", "post-norm", "differential"])
def test_names_a_model_has_and_has_not(overrides):
    names = set(hook_names(small_model(**overrides)))
    assert ("blocks.1.attn.hook_rot_q" in names) == (overrides.get("pos", "rope") == "rope")
    assert ("ln_final.hook_normalized" in names) == (overrides.get("norm_position") != "post")
    assert ("blocks.0.attn.hook_attn_scores" in names) == (overrides.get("attn_op") != "differential")
    assert "blocks.0.attn.hook_slot_pattern" not in names and "blocks.1.attn.hook_pattern" in names


@pytest.mark.parametrize("case", component_cases(), ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_cached_pattern_is_the_map_the_metrics_score(case):
    """For every registered component: the logits are the model's, the pattern (and a slot's share) is the map
    `sinklab.metrics.record` replays, and alpha_1 per head from the cache is what the sink metric measures."""
    model, idx = small_model(**case), tokens()
    S, n = model.cfg.n_sink_tokens, model.cfg.n_slots
    with torch.no_grad():
        logits, cache = run_with_cache(model, idx, lambda name: "pattern" in name)
        ref, maps = model(idx), attention_maps(model, idx)
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5)
    for i, a in enumerate(maps):  # (B, H, P, n + P)
        assert torch.allclose(cache["pattern", i], a[..., n:], atol=1e-6)
        assert (f"blocks.{i}.attn.hook_slot_pattern" in cache) == bool(n)
    alpha = measure_model(model, idx, ["sink"])[0].scores().alpha[..., 0].mean(0)  # (L, H) alpha_1
    real = torch.stack([cache["pattern", i][:, :, S:, S] for i in range(model.cfg.n_layer)], 1)  # (B, L, H, T)
    assert torch.allclose(real.mean(-1).mean(0).double(), alpha.double(), atol=1e-6)


def test_run_with_hooks_ablates_a_head_and_removes_its_hooks():
    model, idx = small_model(**EXTRAS), tokens()
    target = SinklabTarget.of_model(model)
    ref = model(idx)
    seen = []

    def zero_head(z, hook):
        seen.append((hook.name, hook.layer(), tuple(z.shape)))
        z = z.clone()
        z[:, :, 1] = 0.0  # head 1 of every position
        return z
    ablated = target.run_with_hooks(idx, [("blocks.0.attn.hook_z", zero_head)])
    assert seen == [("blocks.0.attn.hook_z", 0, (2, 2 + T, 4, 8))]
    assert not torch.allclose(ablated, ref) and no_hooks_left(model) and torch.equal(model(idx), ref)
    # a hook that returns what it got changes nothing; zeroing the head's value vectors is the same ablation
    same = target.run_with_hooks(idx, [(lambda name: name.endswith("hook_pattern"), lambda a, hook: a.clone())])
    assert torch.allclose(same, ref, atol=1e-6)
    for name in ("attn_scores", "rot_q", "rot_k", "q", "k"):  # back into the model's own layout (slot, kv repeat)
        same = target.run_with_hooks(idx, [(f"blocks.0.attn.hook_{name}", lambda t, hook: t.clone())])
        assert torch.allclose(same, ref, atol=1e-6), name
    halved = target.run_with_hooks(idx, [("blocks.0.attn.hook_rot_k", lambda t, hook: t * 0.5)])
    assert not torch.allclose(halved, ref)
    # the first real token (BOS in a run) taken out of the softmax through its logits, or out of the map
    def mask_first(s, hook):
        s = s.clone()
        s[:, :, 3:, 2] = float("-inf")  # queries after it (its own row would see no key but the slot)
        return s
    assert not torch.allclose(target.run_with_hooks(idx, [("blocks.0.attn.hook_attn_scores", mask_first)]), ref)
    def drop_first(a, hook):
        a = a.clone()
        a[..., 2] = 0.0
        return a
    assert not torch.allclose(target.run_with_hooks(idx, [("blocks.1.attn.hook_pattern", drop_first)]), ref)
    assert no_hooks_left(model)


def test_a_hook_that_raises_leaves_no_hook():
    model = small_model()

    def boom(t, hook):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        SinklabTarget.of_model(model).run_with_hooks(tokens(), [("blocks.1.hook_resid_post", boom),
                                                                ("blocks.0.attn.hook_pattern", lambda a, h: None)])
    assert no_hooks_left(model)


def test_unknown_names_and_replacing_an_nsa_map_are_one_line_errors():
    model = small_model()
    with pytest.raises(UserError) as err:
        run_with_cache(model, tokens(), ["blocks.0.attn.hook_patern"])
    assert_one_line_error(err, "names_filter 'blocks.0.attn.hook_patern': not a hook name",
                          "blocks.{i}.attn.hook_pattern")
    nsa = small_model(attn_op="nsa", nsa_slc_topn=3)  # the 3 selection blocks of the context of 24
    with pytest.raises(UserError) as err:
        SinklabTarget.of_model(nsa).run_with_hooks(tokens(), [("blocks.0.attn.hook_pattern", lambda a, h: a * 1)])
    assert_one_line_error(err, "model.attn_op=nsa does not attend through its map")
    assert no_hooks_left(nsa)


def test_bos_is_prepended_as_the_run_measures(tmp_path):
    """A run's probe set starts with its BOS id (a synthetic task's always; data.probe_bos for text), so
    run_with_cache puts it first by default; prepend_bos=False gives the tokens as they are."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"data": {"_target_": "sinklab.data.synthetic.SyntheticDataModule"}}),
                   run / ".hydra" / "config.yaml")
    save_ckpt(small_model(vocab_size=128), run / "checkpoints" / "last.ckpt")
    target = SinklabTarget.load(TargetSpec(str(run)))
    bos = int(target.natural_tokens(1, 8)[0][0, 0])  # the probe set's first token
    ids = torch.tensor([5, 6, 7])
    logits, cache = target.run_with_cache(ids, "hook_embed")
    assert logits.shape[1] == 4 and torch.equal(cache["hook_embed"][0, 0], target.model.tok_emb.weight[bos])
    assert torch.equal(logits, target.logits(torch.tensor([[bos, 5, 6, 7]])))
    assert target.run_with_hooks(ids, [], prepend_bos=False).shape[1] == 3
    # a model outside a run: nothing prepended unless its BOS id is given
    bare = SinklabTarget.of_model(small_model())
    assert bare.run_with_cache(ids, [])[0].shape[1] == 3
    assert SinklabTarget.of_model(small_model(), bos_id=96).run_with_cache(ids, [])[0].shape[1] == 4
    with pytest.raises(UserError) as err:
        bare.run_with_cache(ids, prepend_bos=True)
    assert_one_line_error(err, "prepend_bos=True: (in memory) has no BOS id")


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_a_transformers_model_answers_to_the_names_its_modules_give(kind, tmp_path):
    """A transformers model (TransformersTarget): hook_embed, hook_attn_out, hook_resid_post and the eager map as
    hook_pattern (gpt-oss: its sink logit's share as hook_slot_pattern), BOS first as its tokenizer starts a text."""
    pytest.importorskip("transformers")
    from sinklab.targets import TransformersTarget
    from tests.helpers.hf_models import tiny_hf

    target = TransformersTarget.load(TargetSpec(str(tiny_hf(kind, tmp_path / kind, tokenizer=True)), "hf"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits, cache = target.run_with_cache(ids)
        with_bos = torch.cat([torch.zeros(1, 1, dtype=torch.long), ids], 1)  # <s> is id 0
        assert torch.equal(logits, target.logits(with_bos))
        per_layer = {"attn.hook_pattern": (1, 4, 7, 7), "hook_attn_out": (1, 7, 32), "hook_resid_post": (1, 7, 32)}
        if kind == "gpt_oss":
            per_layer["attn.hook_slot_pattern"] = (1, 4, 7, 1)
        assert {n: tuple(t.shape) for n, t in cache.items()} == \
            {"hook_embed": (1, 7, 32), **{f"blocks.{i}.{n}": s for i in range(2) for n, s in per_layer.items()}}
        alpha = target.measure(with_bos, ["sink"])[0].scores().alpha[..., 0].mean(0)  # (L, H)
        from_cache = torch.stack([cache["pattern", i][0, :, :, 0].mean(-1) for i in range(2)])
        assert torch.allclose(from_cache.double(), alpha.double(), atol=1e-6)
        ablated = target.run_with_hooks(ids, [("blocks.0.hook_attn_out", lambda t, hook: torch.zeros_like(t))])
        assert not torch.allclose(ablated, logits) and no_hooks_left(target.model)
        with pytest.raises(UserError) as err:
            target.run_with_hooks(ids, [("blocks.1.attn.hook_pattern", lambda a, hook: a * 1)])
        assert_one_line_error(err, "a hook on blocks.1.attn.hook_pattern returned a tensor: this name is read-only")
        assert no_hooks_left(target.model) and target.run_with_cache(ids, [], prepend_bos=False)[0].shape[1] == 6


def test_attnview_renders_a_sinklab_cache(tmp_path):
    attnview = pytest.importorskip("attnview", reason="attnview, in the dev extra (scripts/setup.sh installs it)")
    model = small_model()
    _, cache = SinklabTarget.of_model(model).run_with_cache(tokens(1))
    words = [f"t{i}" for i in range(T)]
    path = attnview.export_cache(cache, tmp_path / "atlas.html", tokens=words)
    page = path.read_text()
    data = json.loads(re.search(r"const data=(.*?);let state=", page).group(1))
    assert [layer["name"] for layer in data["layers"]] == ["Layer 0", "Layer 1"]
    assert data["layers"][1]["queries"] == words
    assert torch.allclose(torch.tensor(data["layers"][1]["values"]), cache["pattern", 1][0])


def test_the_readme_snippet_runs(tmp_path):
    """The documentation's "Hooks and caches" snippet, with its run dir a checkpoint of a small model."""
    section = doc_section("Hooks and caches")
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ckpt = save_ckpt(small_model(), tmp_path / "a.ckpt")
    scope: dict = {}
    exec(snippet.replace('"runs/a"', repr(str(ckpt))), scope)
    assert scope["cache"]["pattern", 0].shape[-1] == scope["logits"].shape[1] and scope["alpha_1"].shape == (4,)
    assert not torch.allclose(scope["ablated"], scope["logits"])
