"""Sparse attention patterns (`model.sparsity`): what each keeps, beyond the contract every component passes
(tests/model/test_contracts.py: paths agree, KV-cache decoding, no information from the future, ...)."""
from __future__ import annotations

import pytest
import torch

from sinklab.contracts.component_checks import small_model, token_ids
from sinklab.metrics.record import attention_maps
from sinklab.model import ConfigError, ModelConfig
from tests.helpers.cli import assert_one_line_error

SMALL = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)


def kept(model, idx=None) -> list[torch.Tensor]:
    """Every layer's map support (B, H, T, n_keys): the keys each query attends to."""
    idx = token_ids() if idx is None else idx
    with torch.no_grad():
        return [a > 0 for a in attention_maps(model, idx)]


@pytest.mark.parametrize("force", [False, True])
def test_topk_keeps_the_k_largest_causal_logits(force):
    m = small_model(sparsity="topk", topk_k=5, topk_force_first=force)
    idx = token_ids()
    q, k = {}, {}
    attn = m.blocks[0].attn
    attn.hook_q.register_forward_hook(lambda _m, _i, out: q.setdefault("q", out))
    attn.hook_k.register_forward_hook(lambda _m, _i, out: k.setdefault("k", out))
    support = kept(m, idx)[0]
    s = (q["q"] @ k["k"].transpose(-1, -2)) * attn.scale  # (B, H, T, T)
    T = s.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    counts = support.sum(-1)  # (B, H, T)
    assert torch.equal(counts, torch.arange(1, T + 1).clamp(max=5).expand_as(counts))
    assert not (support & ~causal).any(), "a key from the future was kept"
    if force:
        assert support[..., 0].all(), "position 0 is not in every selection"
        rest = s[..., 1:].clone()
        want = rest.topk(4, dim=-1).indices[..., 5:, :]  # rows with more than k visible keys
        got = support[..., 5:, 1:]
    else:
        want = s.topk(5, dim=-1).indices[..., 5:, :]
        got = support[..., 5:, :]
    assert torch.equal(torch.zeros_like(got).scatter_(-1, want, True), got)


def test_topk_without_forcing_does_not_always_keep_the_first_token():
    support = kept(small_model(sparsity="topk", topk_k=3))[0]
    assert not support[:, :, 3:, 0].all()


@pytest.mark.parametrize("force", [False, True])
def test_moba_keeps_the_own_block_and_top_earlier_blocks(force):
    m = small_model(sparsity="moba", moba_block=4, moba_topk=3, moba_force_first=force)
    support = kept(m)[1]  # (B, H, T, T)
    T, L = support.shape[-1], 4
    for i in range(T):
        own = range(i // L * L, i + 1)
        assert support[:, :, i, list(own)].all(), f"query {i} does not see its own block causally"
        assert not support[:, :, i, i + 1:].any()
        blocks = support[:, :, i, :i // L * L].reshape(*support.shape[:2], -1, L)  # earlier blocks
        whole = blocks.all(-1)
        assert torch.equal(blocks.any(-1), whole), "a block is kept in part"
        assert torch.equal(whole.sum(-1), torch.full_like(whole.sum(-1), min(2, i // L)))
        if force and i >= L:
            assert whole[..., 0].all(), "block 0 is not forced"


@pytest.mark.parametrize("first", [0, 2])
def test_ashape_sees_the_window_and_the_first_positions(first):
    support = kept(small_model(sparsity="ashape", ashape_window=3, ashape_first=first))[0]
    T = support.shape[-1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    want = (j <= i) & ((i - j < 3) | (j < first))
    assert torch.equal(support, want.expand_as(support))


@pytest.mark.parametrize("force", [False, True])
def test_strided_heads_are_half_local_half_strided(force):
    support = kept(small_model(sparsity="strided", strided_stride=4, strided_force_first=force))[0]
    T = support.shape[-1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    first = (j == 0) if force else torch.zeros(T, T, dtype=torch.bool)
    local, strided = (j <= i) & ((i - j < 4) | first), (j <= i) & (((i - j) % 4 == 0) | first)
    assert torch.equal(support[:, :2], local.expand_as(support[:, :2]))
    assert torch.equal(support[:, 2:], strided.expand_as(support[:, 2:]))


def test_bigbird_blocks_own_window_global_and_random_drawn_once_per_layer():
    kw = dict(sparsity="bigbird", bigbird_block=4, bigbird_window=1, bigbird_global=1, bigbird_random=1)
    maps = kept(small_model(**kw))
    again = kept(small_model(**kw))
    for a, b in zip(maps, again):
        assert torch.equal(a, b), "the random blocks differ between two builds of the same config"
    support = maps[0][0]  # (H, T, T), every sequence alike
    T, L = support.shape[-1], 4
    nb = T // L
    blocks = support.reshape(support.shape[0], nb, L, nb, L)[:, :, -1].all(-1)  # (H, qb, kb) from each block's last row
    qb, kb = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    near = (kb <= qb) & ((qb - kb <= 1) | (kb == 0))
    extra = blocks & ~near
    assert (blocks >= near).all()
    assert torch.equal(extra.sum(-1)[:, 3:], torch.ones_like(extra.sum(-1)[:, 3:])), \
        "one random earlier block per head and query block beyond the window and the global block"
    assert not torch.equal(maps[0], maps[1]), "every layer draws the same random blocks"


@pytest.mark.parametrize("kw", [dict(sparsity="bigbird", bigbird_block=4, bigbird_random=2),
                                dict(sparsity="ashape"), dict(sparsity="strided", strided_stride=4)],
                         ids=["bigbird", "ashape", "strided"])
def test_a_fixed_pattern_reads_only_tensors_already_on_the_device(kw):
    """A mask_mod is compiled into FlexAttention's kernel, where it may create no buffer: on CUDA, a table copied
    to the device inside the mask function failed to lower (Inductor's SubgraphLoweringException, seen on an H200).
    Called on meta tensors, the pattern's mask function copies nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sinklab.model.sparsity import SPARSITIES

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig(**{**dict(vocab_size=64, n_layer=1, n_head=4, d_model=32, d_ff=64, block_size=16), **kw})
    meta = torch.device("meta")
    mask = SPARSITIES.selected(cfg)(cfg, 0).pattern(meta)
    position = torch.zeros(1, dtype=torch.long, device=meta)  # (1,): a 0-d index would be read with .item()
    with Ops() as ops:
        mask(position, position, position, position)
    copies = [op for op in ops.seen if "copy" in op]
    assert ops.seen and not copies, copies


def test_selection_composes_with_the_sink_logit_and_a_k_bias():
    m = small_model(sparsity="topk", topk_k=3, sink_logit="learned", attn_bias="k")
    with torch.no_grad():
        m.blocks[0].attn.op.sink_logit.fill_(1.0)
    a = attention_maps(m, token_ids())[0]  # (B, H, T, 1 + T): the bias slot first
    assert (a[..., 0] > 0).all(), "the bias slot is not kept"
    assert torch.equal((a[..., 1:] > 0).sum(-1), torch.arange(1, 25).clamp(max=3).expand(*a.shape[:2], 24))
    assert (a.sum(-1) < 1 - 1e-4).all(), "the sink logit takes no share"


def test_a_fixed_pattern_composes_with_sigmoid_attention():
    support = kept(small_model(sparsity="ashape", ashape_window=2, ashape_first=1, attn_op="sigmoid"))[0]
    assert not support[:, :, 10, 1:9].any() and support[:, :, 10, [0, 9, 10]].all()


@pytest.mark.parametrize("overrides, fragments", [
    (dict(sparsity="topk", topk_k=25), ("model.topk_k=25", "1..24")),
    (dict(sparsity="topk", topk_k=1, topk_force_first=True), ("model.topk_k=1", "2..24", "topk_force_first")),
    (dict(sparsity="moba", moba_block=5), ("model.moba_block=5", "block_size=24", "allowed: 1, 2, 3, 4, 6, 8, 12")),
    (dict(sparsity="moba", moba_topk=4), ("model.moba_topk=4", "1..3")),
    (dict(sparsity="moba", moba_topk=1, moba_force_first=True), ("model.moba_topk=1", "2..3", "block 0")),
    (dict(sparsity="bigbird", bigbird_block=7), ("model.bigbird_block=7", "allowed:")),
    (dict(sparsity="bigbird", bigbird_random=4), ("model.bigbird_random=4", "0..3")),
    (dict(sparsity="ashape", ashape_window=0), ("model.ashape_window=0", "1..24")),
    (dict(sparsity="strided", n_head=1, d_model=32), ("model.n_head=1", "n_head >= 2")),
    (dict(sparsity="topk", attn_op="differential"), ("model.sparsity=topk", "model.attn_op=differential", "softmax")),
    (dict(sparsity="none", topk_k=8), ("model.topk_k=8", "model.sparsity=topk")),
    (dict(sparsity="dense"), ("model.sparsity='dense'", "none, topk, moba")),
])
def test_bad_settings_are_one_line_errors(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**SMALL, **overrides})
    assert_one_line_error(err, *fragments)


def test_the_sparsity_group_options_select_their_component():
    from sinklab.config.store import compose

    cfg = compose(["model/sparsity=moba", "model.moba_topk=3"])
    assert cfg.model.sparsity == "moba" and cfg.model.moba_topk == 3 and cfg.model.moba_block == 8
