"""Differential attention (sinklab/model/ops/differential.py, arXiv 2410.05258) against the paper's formula computed
by hand from the module's weights: two softmax maps of half-width queries and keys, lambda's re-parametrisation and
depth schedule, the per-head RMSNorm x (1 - lambda_init); and its refusal of a head width that cannot be halved."""
import math

import pytest
import torch

from sinklab.metrics import attention_maps
from sinklab.model import ConfigError
from sinklab.model.ops.differential import halves, lambda_init
from tests.helpers import small_model, token_ids

H, HD = 4, 8  # SMALL's heads and head width


def test_lambda_init_follows_the_papers_depth_schedule():
    assert lambda_init(0) == pytest.approx(0.2)  # the paper's l = 1
    assert lambda_init(3) == pytest.approx(0.8 - 0.6 * math.exp(-0.9))
    m = small_model(attn_op="differential")
    assert [b.attn.op.lambda_init for b in m.blocks] == [pytest.approx(lambda_init(i)) for i in range(2)]


def test_halves_keep_whole_rotary_pairs_so_each_half_is_relative():
    """Rotating q and k by RoPE then halving gives the same half logits at shifted positions: each half holds whole
    rotate-half pairs (j, j + hd/2)."""
    m = small_model(attn_op="differential")
    rope = m.layout(12, torch.device("cpu")).rope
    q, k = torch.randn(1, 1, 12, HD), torch.randn(1, 1, 12, HD)
    same_q, same_k = q[:, :, :1].expand_as(q), k[:, :, :1].expand_as(k)  # the same vectors at every position
    def relative(half_q, half_k):  # the logits depend on i - j only: constant along a diagonal
        s = (half_q @ half_k.transpose(-1, -2))[0, 0]  # (12, 12)
        return torch.allclose(torch.diagonal(s, 2), s[0, 2].expand(10), atol=1e-5, rtol=1e-5)

    assert all(relative(hq, hk) for hq, hk in zip(halves(rope(same_q)), halves(rope(same_k))))
    assert not relative(rope(same_q)[..., :HD // 2], rope(same_k)[..., :HD // 2])  # a plain split breaks the pairs
    assert torch.equal(torch.cat(halves(torch.arange(8.)), -1), torch.tensor([0., 2, 4, 6, 1, 3, 5, 7]))


def test_block_output_is_the_papers_formula_and_rows_sum_to_one_minus_lambda():
    m = small_model(attn_op="differential", pos="nope")
    attn = m.blocks[0].attn
    with torch.no_grad():
        attn.op.subln.weight.uniform_(0.5, 1.5)
    seen = {}
    attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))
    idx = token_ids()
    with torch.no_grad():
        m(idx)
    x = seen["x"]
    B, N, _ = x.shape
    q, k, v = ((x @ p.weight.T).view(B, N, H, HD).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    op = attn.op
    lam = (torch.exp(op.lambda_q1 @ op.lambda_k1) - torch.exp(op.lambda_q2 @ op.lambda_k2) + 0.2).detach()
    maps = []
    for (qh, kh) in zip(halves(q), halves(k)):
        s = (qh @ kh.transpose(-1, -2)) / math.sqrt(HD // 2)  # 1 / sqrt(d), d = hd / 2
        maps.append(torch.softmax(s.masked_fill(~causal, float("-inf")), -1))
    a = maps[0] - lam * maps[1]
    o = a @ v
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps) * op.subln.weight * (1 - 0.2)
    want = o.transpose(1, 2).reshape(B, N, H * HD) @ attn.o_proj.weight.T
    torch.testing.assert_close(seen["out"], want, atol=1e-5, rtol=1e-5)
    recorded = attention_maps(m, idx)[0]  # what the metrics see: the differential map
    torch.testing.assert_close(recorded, a, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(recorded.sum(-1), (1 - lam).expand(B, H, N), atol=1e-5, rtol=1e-5)
    assert not m.cfg.row_normalised and not m.cfg.llama_compatible


def test_a_head_width_that_is_not_a_multiple_of_4_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^model.attn_op=differential .* head width 6 .* multiple of 4$"):
        small_model(attn_op="differential", head_dim=6)
