"""The sink metric against brute force and hand-made attention maps."""
import pytest
import torch

from sinklab.metrics import attention_scores, brute_force_alpha, column_scores, sink_rate, slot_names, summarise


def causal_uniform(T):
    a = torch.ones(T, T).tril()
    return a / a.sum(-1, keepdim=True)


def test_alpha_on_a_hand_made_uniform_map():
    T = 4
    alpha, _ = column_scores(causal_uniform(T), n_extra=0, k=2)
    # column 1 receives 1, 1/2, 1/3, 1/4 from rows 1..4
    assert alpha[0].item() == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    # column 2 receives 1/2, 1/3, 1/4 from rows 2..4
    assert alpha[1].item() == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)


def test_known_sink_is_counted():
    T = 64
    sink_head = torch.zeros(T, T)
    sink_head[:, 0] = 0.9
    sink_head += 0.1 * causal_uniform(T)
    heads = torch.stack([sink_head, causal_uniform(T), causal_uniform(T), causal_uniform(T)])  # (H, T, T)
    maps = torch.stack([heads, torch.stack([causal_uniform(T)] * 4)])[None]  # (N=1, L=2, H=4, T, T)
    alpha, _ = column_scores(maps, n_extra=0, k=4)
    # brute force by the definition: alpha_1 = mean over all rows of column 1
    assert alpha[0, 0, 0, 0].item() == pytest.approx(sink_head[:, 0].mean().item())
    assert alpha[0, 0, 0, 0] > 0.9
    rates = sink_rate(alpha, eps=0.3)
    assert rates[0].item() == pytest.approx(100 / 8)  # one head of 8 (2 layers x 4 heads)
    assert rates[1].item() == 0.0


def test_sink_is_averaged_over_sequences_not_pooled():
    alpha = torch.tensor([0.31, 0.29]).reshape(2, 1, 1, 1)  # sequence 1 sinks, sequence 2 not
    assert sink_rate(alpha, 0.3)[0].item() == 50.0
    assert sink_rate(torch.full((1, 1, 1, 1), 0.3), 0.3)[0].item() == 0.0  # strict >


@pytest.mark.parametrize("sw", [{}, dict(attn_bias="kv"), dict(attn_bias="k", attn_bias_shared=True),
                                dict(n_sink_tokens=2), dict(attn_op="sigmoid"), dict(attn_op="elu"),
                                dict(attn_op="kernel", kernel_map="identity"), dict(prefix_len=5),
                                dict(window=6), dict(pos="alibi"), dict(sink_logit="learned"),
                                dict(attn_op="softpick")],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_efficient_route_equals_brute_force(make_model, sw):
    m = make_model(**sw)
    tokens = torch.randint(0, 97, (5, 24), generator=torch.Generator().manual_seed(1))
    fast = attention_scores(m, tokens, k=4, batch_size=2, chunk=7)  # chunks that do not divide T
    slow = brute_force_alpha(m, tokens, k=4)
    torch.testing.assert_close(fast.alpha, slow.alpha, atol=1e-5, rtol=0)
    for name in ("slot", "alpha_star", "slot_star"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bias_slot_and_sink_tokens_are_scored_apart(make_model):
    m = make_model(attn_bias="kv", n_sink_tokens=1)
    tokens = torch.randint(0, 97, (3, 24))
    scores = attention_scores(m, tokens)
    assert scores.slot.shape == (3, 2, 4, 2) and slot_names(m.cfg) == ["bias", "token0"]
    # plant the sink on the bias slot: huge key aligned with every query is impossible to do by hand for all
    # queries, so check instead that the slot's score is its attention averaged over all real queries
    _, probs = m(tokens, return_probs=True)
    expect = probs[0][:, :, 1:, 0].mean(-1)  # real-token queries, bias column
    torch.testing.assert_close(scores.slot[:, 0, :, 0], expect, atol=1e-6, rtol=0)
    out = summarise(scores, (0.3,), slot_names(m.cfg))
    assert "slot_bias" in out and "slot_token0" in out and "sink1" in out


def test_star_only_for_unnormalised_ops(make_model):
    tokens = torch.randint(0, 97, (2, 24))
    assert attention_scores(make_model(), tokens).alpha_star is None
    assert attention_scores(make_model(attn_op="sigmoid", attn_normalize=True), tokens).alpha_star is None
    star = attention_scores(make_model(attn_op="sigmoid"), tokens).alpha_star
    assert star is not None and torch.all(star <= 1)


def test_memory_of_efficient_route_does_not_hold_full_maps(make_model):
    """At T = 512 one full map stack is 2 x 4 x 512 x 512 floats per sequence; the chunked route never builds it."""
    m = make_model(block_size=512)
    tokens = torch.randint(0, 97, (1, 512))
    seen = []
    orig = m.blocks[0].attn.probs

    def spy(q, k, layout, rows):
        seen.append(len(rows))
        return orig(q, k, layout, rows)

    m.blocks[0].attn.probs = spy
    attention_scores(m, tokens, chunk=64)
    assert max(seen) == 64 and sum(seen) == 512
