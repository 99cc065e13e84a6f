"""What the contract (tests/model/test_contracts.py) cannot see of the trainable sparse operations: NSA's forced
blocks, its causal compressed blocks, the GQA group's shared choice, Eq. 9's block mapping and the metric's map
against the output; DSA's choice (the top-k of its indexer over the visible keys, by the formula), its dense warm-up
and its forced first token; the one-line refusals."""
from functools import partial

import pytest
import torch
from torch import nn

from sinklab.errors import UserError
from sinklab.model import ConfigError, ModelConfig
from sinklab.model.ops.base import masked_softmax
from sinklab.model.ops.nsa import NativeSparseAttention
from sinklab.model.positional import RotaryAt
from tests.helpers import SMALL, small_model, token_ids


def layer_inputs(m, idx, layer=0):
    """The q, k, v, the op's own tensors (`extra`) and the input x of a layer in the forward of `idx`, and the
    forward's layout."""
    attn, got = m.blocks[layer].attn, {}
    handles = [attn.register_forward_pre_hook(lambda _m, args: got.__setitem__("x", args[0]))]
    for name in ("q", "k", "v", "extra"):
        handles.append(getattr(attn, f"hook_{name}").register_forward_hook(
            lambda _m, _i, out, name=name: got.__setitem__(name, out)))
    try:
        with torch.no_grad():
            m(idx)
    finally:
        for h in handles:
            h.remove()
    return got, m.layout(idx.shape[1], idx.device)


# ---------------------------------------------------------------------------------------------------- NSA
def nsa_model(**knobs):
    return small_model(attn_op="nsa", block_size=64, **knobs)


def test_nsa_eq9_counts_each_compressed_block_by_the_strides_it_shares_with_the_selection_block():
    for l, d, ls in ((8, 4, 8), (32, 16, 64), (8, 4, 4), (4, 4, 8), (8, 2, 4)):
        few = {} if 64 // ls >= 4 else dict(nsa_force_initial=False, nsa_force_local=1)  # n <= the blocks there are
        op = nsa_model(nsa_cmp_block=l, nsa_cmp_stride=d, nsa_slc_block=ls, nsa_slc_topn=min(4, 64 // ls),
                       **few).blocks[0].attn.op
        nb, n_slc = (64 - l) // d + 1, 64 // ls
        want = torch.tensor([[len(set(range(i * d, i * d + l)) & set(range(j * ls, j * ls + ls))) / d
                              for j in range(n_slc)] for i in range(nb)])
        torch.testing.assert_close(op.overlap(nb, n_slc, torch.device("cpu")), want)


def test_nsa_compressed_block_is_seen_once_all_its_tokens_are():
    m = nsa_model()
    got, layout = layer_inputs(m, token_ids(T=64))
    op, rows = m.blocks[0].attn.op, layout.rows()
    b = op.branches(got["q"], got["k"], layout, rows, m.blocks[0].attn.scale, got["extra"])
    ends = b.blocks[:, -1]  # i d + l - 1
    assert torch.equal(b.blocks[:, 0], torch.arange(len(ends)) * 4) and b.blocks.shape[1] == 8
    visible = ends[None, :] <= rows[:, None]  # (T, nb)
    assert torch.equal(b.cmp > 0, visible.expand_as(b.cmp))
    torch.testing.assert_close(b.cmp.sum(-1)[..., 7:], torch.ones_like(b.cmp.sum(-1)[..., 7:]))
    assert torch.all(b.cmp[..., :7, :] == 0)  # before position l - 1 no block is complete: the branch is empty


def selected_blocks(m, idx, layer=0):
    """The selection blocks each head's selected branch reads, per query row: (B, H, T, n_slc) bool."""
    got, layout = layer_inputs(m, idx, layer)
    op = m.blocks[layer].attn.op
    b = op.branches(got["q"], got["k"], layout, layout.rows(), m.blocks[layer].attn.scale, got["extra"])
    return (b.slc > 0).view(*b.slc.shape[:-1], -1, op.slc_block).any(-1)


@pytest.mark.parametrize("force", [True, False])
def test_nsa_initial_block_is_forced_only_when_asked(force):
    m = nsa_model(nsa_force_initial=force, nsa_slc_topn=3, nsa_force_local=1)
    chosen = selected_blocks(m, token_ids(T=64))  # (B, H, 64, 8)
    assert (chosen.sum(-1) == torch.arange(64).div(8, rounding_mode="floor").add(1).clamp(max=3)).all()
    assert chosen[..., :, 0].all() == force  # every query row keeps block 0 when forced
    own = torch.arange(64) // 8
    assert chosen.gather(-1, own.view(1, 1, 64, 1).expand(*chosen.shape[:2], 64, 1)).all()  # the local block
    op = m.blocks[0].attn.op
    # block 0 scored lowest by every query: left out unless forced
    a_cmp = torch.ones(1, 4, 64, 15)
    a_cmp[..., :2] = 0.0  # the compressed blocks 0 and 1 lie in selection block 0 (with block 1 partly)
    rows = torch.arange(64)
    picked = op.select(a_cmp, rows, rows[:, None] >= torch.arange(64))  # (1, Hkv, 64, 8)
    assert picked[..., 24:, 0].all() == force and (picked.sum(-1) <= 3).all()


def test_nsa_heads_of_a_gqa_group_select_the_same_blocks():
    m = nsa_model(n_kv_head=2, nsa_force_initial=False, nsa_force_local=1)
    chosen = selected_blocks(m, token_ids(T=64))  # (B, 4, 64, 8): heads 0, 1 share kv head 0, heads 2, 3 kv head 1
    assert torch.equal(chosen[:, 0], chosen[:, 1]) and torch.equal(chosen[:, 2], chosen[:, 3])
    assert not torch.equal(chosen[:, 0], chosen[:, 2])  # the two groups choose apart


class MeanPool(nn.Module):
    def forward(self, blocks):
        return blocks.mean(-2)  # (B, h, nb, l, hd) -> (B, h, nb, hd)


def test_nsa_map_of_the_metrics_is_the_one_the_output_reads():
    """With every branch's values the layer's own and a compressed value the mean of its block's, the output of each
    query equals its metric map (gates' sum, a block's weight spread over its tokens) times the values."""
    m = nsa_model()
    attn = m.blocks[0].attn
    op = attn.op
    with torch.no_grad():
        op.v_cmp_proj.weight.copy_(attn.v_proj.weight)
        op.v_win_proj.weight.copy_(attn.v_proj.weight)
    op.compress_v = MeanPool()
    got, layout = layer_inputs(m, token_ids(T=64))
    rows = layout.rows()
    a = attn.probs(got["q"], got["k"], layout, rows, got["extra"])  # (B, H, T, T)
    o = op.attend(got["q"], got["k"], got["v"], layout, rows, attn.scale, got["extra"])
    torch.testing.assert_close(o, a @ got["v"])
    g = op.gates(got["extra"], rows)  # (B, H, T, 3)
    torch.testing.assert_close(a.sum(-1), g[..., 0] * (rows >= 7) + g[..., 1] + g[..., 2])


def nsa_by_the_masks(op, q, k, v, layout, rows, scale, extra):
    """Eq. 5 for query rows, each branch the masked softmax of its full logits: the blocks gathered by index, the
    chosen blocks spread over their tokens by index, every mask applied to the (B, H, R, n_keys) logits (what the op
    computed before it made its token branches' logits with their masks in one matmul)."""
    S0, P, ls = layout.n_slots, layout.n_key_pos, op.slc_block
    seen, bias = layout.mask(rows), layout.bias(rows)  # ((H,) R, n_keys), (H, R, n_keys) or None
    bias = torch.zeros(seen.shape[-1]) if bias is None else bias
    seen_pos = seen[..., S0:]
    nb = max(0, (P - op.block) // op.stride + 1)
    blocks = (torch.arange(nb) * op.stride)[:, None] + torch.arange(op.block)  # (nb, l)
    kc = op.compress_k(extra["k_cmp"][:, :, blocks])  # (B, Hkv, nb, hd)
    vc = op.compress_v(extra["v_cmp"][:, :, blocks])
    rope = layout.rotary_at(P) if op.rotates and layout.rotary_at is not None else None
    if rope is not None:
        kc = RotaryAt(rope.cos[blocks[:, -1]], rope.sin[blocks[:, -1]])(kc)
    kc, vc = op.group(kc), op.group(vc)
    a_cmp = masked_softmax((q @ kc.transpose(-1, -2)) * scale + bias[..., S0 + blocks[:, -1]],
                           seen_pos[..., blocks].all(-1))
    chosen = op.group(op.select(a_cmp, rows, seen_pos))  # (B, H, R, n_slc)
    in_chosen = torch.cat([chosen.new_ones(*chosen.shape[:-1], S0), chosen[..., torch.arange(P) // ls]], -1)
    a_slc = masked_softmax((q @ k.transpose(-1, -2)) * scale + bias, seen & in_chosen)
    near = (rows[:, None] - torch.arange(P)) < op.window
    a_win = masked_softmax((q @ op.group(extra["k_win"]).transpose(-1, -2)) * scale + bias[..., S0:],
                           seen_pos & near)
    g = extra["gate"][:, :, rows]
    return g[..., 0:1] * (a_cmp @ vc) + g[..., 1:2] * (a_slc @ v) + g[..., 2:3] * (a_win @ op.group(extra["v_win"]))


@pytest.mark.parametrize("knobs, restrict", [
    ({}, None), ({"n_kv_head": 2, "nsa_force_local": 1}, None), ({"attn_bias": "k"}, None),
    ({"pos": "alibi", "nsa_slc_block": 4, "nsa_force_initial": False}, None), ({"pos": "relative"}, None),
    ({"window": 20}, None),
    ({"prefix_len": 6}, None),
    # key 0 hidden: row 0 sees nothing in any branch; per-head masks: a head may see none of the chosen tokens
    ({}, ("hidden_key", lambda b, h, q, kv: kv != 0, None)),
    ({"nsa_force_local": 0}, ("per_head", lambda b, h, q, kv: (h + kv) % 3 != 0, 4))],
    ids=["default", "gqa", "k_slot", "alibi", "relative", "window", "prefix", "hidden_key", "per_head"])
def test_nsa_output_and_gradients_equal_the_masked_formula(knobs, restrict):
    """The op's output for every row, and for a chunk of rows, and the gradients of every input and parameter,
    equal the masked formula's to float32 rounding."""
    m = nsa_model(**knobs)
    attn = m.blocks[0].attn
    got, layout = layer_inputs(m, token_ids(T=64))
    if restrict is not None:
        layout = layout.restricted(restrict[0], restrict[1], heads=restrict[2])
    inputs = [t.clone().requires_grad_() for t in (got["q"], got["k"], got["v"], *got["extra"].values())]
    params = [*attn.op.parameters(), *layout.bias_params]  # a learned relative bias table takes its gradient
    for rows in (layout.rows(), layout.rows(40, 64)):
        outs = []
        for f in (attn.op.attend, partial(nsa_by_the_masks, attn.op)):
            q, k, v, *more = inputs
            o = f(q[:, :, rows - layout.start], k, v, layout, rows, attn.scale, dict(zip(got["extra"], more)))
            grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1])).sum(), inputs + params,
                                        allow_unused=True)
            outs.append((o, grads))
        (o, grads), (o_ref, grads_ref) = outs
        torch.testing.assert_close(o, o_ref)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref)


def test_nsa_refuses_impossible_knobs_in_one_line():
    for knobs, words in (({"nsa_cmp_stride": 3}, "model.nsa_cmp_stride=3 must divide model.nsa_cmp_block=8"),
                         ({"nsa_slc_block": 16}, "model.nsa_slc_block=16 must divide the context"),
                         ({"nsa_cmp_block": 5, "nsa_cmp_stride": 5}, "model.nsa_cmp_block=5 must divide the context"),
                         ({"nsa_slc_topn": 2}, "model.nsa_slc_topn=2 is smaller than the 3 forced"),
                         ({"nsa_slc_topn": 50}, "model.nsa_slc_topn=50 exceeds the 3 selection blocks of the context "
                                                "(model.block_size=24 / model.nsa_slc_block=8); allowed: 3..3"),
                         ({"nsa_window": 30}, "model.nsa_window=30 exceeds the context"),
                         ({"nsa_force_local": -1}, "model.nsa_force_local=-1 must be an integer >= 0")):
        with pytest.raises(ConfigError, match="^" + words.replace(".", r"\.").replace("+", r"\+").replace("(", r"\(").replace(")", r"\)")) as err:
            ModelConfig(**{**SMALL, "attn_op": "nsa", "nsa_slc_topn": 3, **knobs})  # 3 selection blocks of 8
        assert "\n" not in str(err.value)
    ModelConfig(**{**SMALL, "attn_op": "nsa", "nsa_slc_topn": 2, "nsa_force_initial": False})  # 2 forced: fits


def test_nsa_refuses_an_evicting_cache_and_decodes_with_a_dense_one():
    m = small_model(attn_op="nsa", nsa_slc_topn=3)  # the 3 selection blocks of the context of 24
    idx = token_ids()
    with pytest.raises(UserError, match=r"^model\.attn_op=nsa keeps per-token tensors .* allowed: a dense cache$"):
        m(idx[:, :4], cache=m.new_cache(keep_first=2, recent=8))
    cache = m.new_cache()
    steps = [m(idx[:, :10], cache=cache)] + [m(idx[:, t:t + 1], cache=cache) for t in range(10, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), m(idx), atol=2e-5, rtol=1e-5)
    assert set(cache.extra[0]) == {"k_cmp", "v_cmp", "k_win", "v_win", "gate"}


def test_nsa_gates_pass_their_hook_point():
    m = small_model(attn_op="nsa", nsa_slc_topn=3)  # the 3 selection blocks of the context of 24
    seen = []
    m.blocks[1].attn.op.hook_gate.register_forward_hook(lambda _m, _i, out: seen.append(out))
    m(token_ids())
    assert len(seen) == 1 and seen[0].shape == (2, 4, 24, 3) and ((seen[0] > 0) & (seen[0] < 1)).all()
    assert isinstance(m.blocks[0].attn.op, NativeSparseAttention)


# ---------------------------------------------------------------------------------------------------- DSA
def dsa_model(**knobs):
    return small_model(attn_op="dsa", pos="nope", **{"dsa_warmup_steps": 0, "dsa_topk": 6, **knobs})


def indexer_by_hand(op, x):
    """I_ts = sum_j w_tj ReLU(q^I_tj . k^I_s) from the layer's input x (B, T, d), w scaled by H_I^-1/2 d_I^-1/2."""
    B, T, _ = x.shape
    q = (x @ op.index_q.weight.T).view(B, T, op.index_heads, op.index_dim)  # (B, T, H_I, d_I)
    k = x @ op.index_k.weight.T  # (B, T, d_I)
    w = (x @ op.index_w.weight.T) / (op.index_heads * op.index_dim) ** 0.5  # (B, T, H_I)
    return torch.einsum("btj,btjs->bts", w, torch.relu(torch.einsum("btjd,bsd->btjs", q, k)))


def test_dsa_keeps_the_top_k_of_its_indexer_over_the_visible_keys():
    m = dsa_model()
    attn = m.blocks[1].attn
    got, layout = layer_inputs(m, token_ids(), layer=1)
    rows = layout.rows()
    scores = indexer_by_hand(attn.op, got["x"])  # (B, T, T)
    torch.testing.assert_close(attn.op.index_scores(rows, got["extra"]), scores)
    a = attn.probs(got["q"], got["k"], layout, rows, got["extra"])  # (B, H, T, T)
    torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
    for t in range(24):
        kept = a[:, 0, t] > 0  # (B, T): the same keys for every head
        assert torch.equal(a[:, :, t] > 0, kept[:, None].expand(2, 4, 24)), t
        assert (kept.sum(-1) == min(6, t + 1)).all() and not kept[:, t + 1:].any(), t  # k of the visible keys
        for b in range(2):  # the highest scores among them (ReLU's zeros may tie)
            left = scores[b, t, :t + 1][~kept[b, :t + 1]]
            assert not len(left) or scores[b, t][kept[b]].min() >= left.max(), t
        s = (got["q"][:, :, t:t + 1] @ got["k"].transpose(-1, -2))[:, :, 0] * attn.scale  # (B, H, T)
        torch.testing.assert_close(a[:, :, t], torch.softmax(s.masked_fill(~kept[:, None], float("-inf")), -1))


def test_dsa_is_dense_in_the_warmup_and_sparse_from_its_step():
    m = dsa_model(dsa_warmup_steps=5)
    idx = token_ids()
    dense = small_model(pos="nope")  # the same weights but the indexer's: softmax attention
    dense.load_state_dict({k: v for k, v in m.state_dict().items() if ".op." not in k})
    torch.testing.assert_close(m(idx), dense(idx))
    attn = m.blocks[0].attn
    for step, kept in ((4, torch.arange(1, 25)), (5, torch.arange(1, 25).clamp(max=6))):
        m.set_step(step)
        got, layout = layer_inputs(m, idx)
        a = attn.probs(got["q"], got["k"], layout, layout.rows(), got["extra"])
        assert torch.equal((a > 0).sum(-1), kept.expand(2, 4, 24)), step


def test_dsa_forces_the_first_token_within_k_only_when_asked():
    for force in (False, True):
        m = dsa_model(dsa_force_first=force, dsa_topk=2)
        got, layout = layer_inputs(m, token_ids())
        a = m.blocks[0].attn.probs(got["q"], got["k"], layout, layout.rows(), got["extra"])
        assert ((a > 0).sum(-1) <= 2).all()
        assert (a[..., 0] > 0).all() == force


def test_dsa_refuses_impossible_knobs_in_one_line():
    for knobs, words in (({"dsa_topk": 0}, "model.dsa_topk=0 must be an integer in 1..model.block_size=24"),
                         ({"dsa_topk": 25}, "model.dsa_topk=25 must be an integer in 1..model.block_size=24"),
                         ({"dsa_warmup_steps": -1}, "model.dsa_warmup_steps=-1 must be an integer >= 0"),
                         ({"dsa_index_heads": 0}, "model.dsa_index_heads=0 must be a positive integer"),
                         ({"dsa_force_first": True, "dsa_topk": 2, "n_sink_tokens": 2},
                          "model.dsa_topk=2 cannot hold the 3 positions")):
        with pytest.raises(ConfigError, match="^" + words.replace(".", r"\.")) as err:
            ModelConfig(**{**SMALL, "attn_op": "dsa", **knobs})
        assert "\n" not in str(err.value)
