"""The contract every registered component passes (sinklab/model/registry.py). A newly registered attention
operation, positional encoding, norm, FFN, gate or attention bias is tested here without new test code: its fused,
chunked and explicit paths agree (forward and gradients), and so do FlexAttention (model.attn_backend=flex) and the
memory-linear training paths (model.attn_memory=linear), decoding with a KV cache gives the full forward's logits,
it is causal, its rows sum to one where it says so, the
chunked sink metric equals the brute-force one, it trains a step, and a file of its config group selects it.

The default suite runs every component with every value of each of its knobs (tests.helpers.covering); the full
product of the knobs (`component_cases`) runs with the `slow` tests."""
from functools import lru_cache

import pytest
import torch
from omegaconf import OmegaConf

from sinklab.metrics.sink import attention_scores, brute_force_alpha
from sinklab.model import ATTENTION_OPS, FAMILIES
from sinklab.model.ops.softmax import Softmax
from tests.helpers import (REPO, assert_same_logits_and_grads, case_id, component_cases, covering, logits_and_grads,
                           small_model, token_ids)

CASES = component_cases()
# the default suite: every registered component and every value of each of its knobs (covering); the rest of the
# knobs' full product (gate position x activation x sharing, ...) is marked slow
CORE = covering(CASES)
MASKS = {"causal": {}, "prefix": {"prefix_len": 4}, "window": {"window": 5}, "sinks": {"n_sink_tokens": 2, "window": 4}}
CONF = REPO / "conf" / "model"


# the families that meet the masks (positions, operations, biases) are checked under each mask, the others causal
MASK_FAMILIES = ("pos", "attn_op", "attn_bias")
WITH_MASKS = [(case, mask) for case in CASES for mask in (MASKS if next(iter(case)) in MASK_FAMILIES else ["causal"])]


def cases(items=CASES) -> list:
    """pytest params of `items` (cases, or (case, mask) pairs), those outside CORE marked slow."""
    out = []
    for item in items:
        case, args, name = (item[0], item, f"{case_id(item[0])}-{item[1]}") if isinstance(item, tuple) else \
            (item, (item,), case_id(item))
        out.append(pytest.param(*args, id=name, marks=() if case in CORE else pytest.mark.slow))
    return out


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_fused_chunked_and_explicit_paths_agree(case, mask):
    m = small_model(**case, **MASKS[mask]).train()
    idx = token_ids()
    fused = logits_and_grads(m, idx)  # the op's fused kernel where it has one
    explicit = logits_and_grads(m, idx, return_probs=True)  # whole maps
    for block in m.blocks:
        block.attn.use_fused, block.attn.row_chunk = False, 5  # query rows in chunks of 5
    chunked = logits_and_grads(m, idx)
    for other in (explicit, chunked):
        assert_same_logits_and_grads(other, fused)


def takes_flex(model) -> bool:
    """Whether attn_backend=flex computes the model's operation (every softmax variant)."""
    return issubclass(ATTENTION_OPS.selected(model.cfg), Softmax)


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_flex_and_memory_linear_paths_equal_the_explicit_maps(case, mask, flex_on_cpu):
    """FlexAttention for every softmax variant (model.attn_backend=flex), with model.attn_memory=linear for the
    others (the explicit path's row chunks, 5 rows each, recomputed in backward; kernel attention in its causal linear
    form): the explicit maps' logits and gradients."""
    idx = token_ids()
    explicit = logits_and_grads(small_model(**case, **MASKS[mask]).train(), idx, return_probs=True)
    m = small_model(**case, **MASKS[mask], attn_backend="flex", attn_memory="linear").train()
    for block in m.blocks:
        block.attn.row_chunk = 5
    assert_same_logits_and_grads(logits_and_grads(m, idx), explicit)
    assert len(flex_on_cpu) == (m.cfg.n_layer if takes_flex(m) else 0)  # one call per layer, no fallback


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_decoding_with_a_kv_cache_gives_the_full_forward_logits(case, mask):
    """A 6-token prompt (it covers the prefix LM's 4), a 3-token chunk, then one token at a time; odd steps through
    the explicit maps (return_probs), even ones through the fused kernel where the op has one."""
    m = small_model(**case, **MASKS[mask])
    idx = token_ids()
    full = m(idx)
    cache = m.new_cache()
    cuts = [0, 6, 9] + list(range(10, idx.shape[1] + 1))
    steps = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        out = m(idx[:, a:b], cache=cache, return_probs=bool(i % 2))
        steps.append(out[0] if isinstance(out, tuple) else out)
    assert cache.length == m.cfg.n_sink_tokens + idx.shape[1] and cache.seen == idx.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)


NEW_PATH_CASES = [(case, mask) for case, mask in WITH_MASKS if next(iter(case)) in MASK_FAMILIES]


@pytest.mark.parametrize("case,mask", cases(NEW_PATH_CASES))
def test_flex_and_linear_forms_decode_with_a_kv_cache(case, mask, flex_on_cpu):
    """FlexAttention and kernel attention's causal linear form see a KV cache's earlier keys and the bias slots:
    a 6-token prompt, a 3-token chunk, then one token at a time give the explicit path's logits (for the operations,
    positions and biases, which meet the cache's key layout)."""
    idx = token_ids()
    full = small_model(**case, **MASKS[mask], attn_backend="explicit")(idx)
    m = small_model(**case, **MASKS[mask], attn_backend="flex", attn_memory="linear")
    cache = m.new_cache()
    cuts = [0, 6, 9] + list(range(10, idx.shape[1] + 1))
    with torch.no_grad():  # flex's forward runs on every device
        steps = [m(idx[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)
    assert len(flex_on_cpu) == (m.cfg.n_layer * len(steps) if takes_flex(m) else 0)


@pytest.mark.parametrize("case", cases())
def test_no_information_from_the_future(case):
    m = small_model(**case)
    idx = token_ids()
    changed = idx.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 97
    before, after = m(idx), m(changed)
    torch.testing.assert_close(after[:, :15], before[:, :15], atol=0, rtol=0)
    assert (after[:, 15:] - before[:, 15:]).abs().max() > 1e-6


@pytest.mark.parametrize("case", cases())
def test_rows_sum_to_one_where_claimed(case):
    m = small_model(**case, n_sink_tokens=1, window=6)
    _, maps = m(token_ids(), return_probs=True)
    for a in maps:  # (B, H, S + T, n_keys): every map is zero where a key is not visible
        layout = m.layout(24, a.device)
        assert torch.all(a[..., ~layout.mask(torch.arange(layout.n_pos))] == 0)
        if m.cfg.row_normalised:
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


@pytest.mark.parametrize("case", cases())
def test_chunked_sink_metric_equals_brute_force(case):
    m = small_model(**case, n_sink_tokens=1 if "attn_bias" not in case else 0)
    tokens = token_ids(B=3, T=20, seed=1)
    fast, ref = attention_scores(m, tokens, k=3, batch_size=2, chunk=7), brute_force_alpha(m, tokens, k=3)
    torch.testing.assert_close(fast.alpha, ref.alpha, atol=1e-5, rtol=1e-5)
    for name in ("slot", "alpha_star", "slot_star"):
        mine, want = getattr(fast, name), getattr(ref, name)
        assert (mine is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", cases())
def test_trains_a_step(case):
    m = small_model(**case).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    idx = token_ids(B=4, T=25)
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        for name, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


@lru_cache(maxsize=None)
def composed(group: str, option: str) -> dict:
    from sinklab.config import compose

    return OmegaConf.to_container(compose([f"model/{group}={option}"]).model, resolve=True)


@pytest.mark.parametrize("registry", FAMILIES, ids=lambda r: r.key)
def test_a_config_file_selects_every_component(registry):
    files = sorted(p.stem for p in (CONF / registry.group).glob("*.yaml"))
    selected = {composed(registry.group, f)[registry.key] for f in files}
    assert set(registry.names()) <= selected, f"no conf/model/{registry.group}/*.yaml selects " \
                                              f"{sorted(set(registry.names()) - selected)}"


def test_components_command_lists_every_registered_component(capsys):
    import json

    from sinklab.cli import main

    assert main(["components", "--json"]) == 0
    listed = {(e["key"], e["name"]): e for e in json.loads(capsys.readouterr().out)}
    for registry in FAMILIES:
        for name in registry.names():
            entry = listed[(f"model.{registry.key}", name)]
            assert entry["files"] and entry["about"], entry
    assert listed[("model.attn_op", "sigmoid")]["knobs"] == {"attn_normalize": False, "sigmoid_bias": 0.0}
    assert main(["components"]) == 0  # the table the README points to
    table = capsys.readouterr().out
    assert "model.attn_op=sigmoid" in table and "knobs: attn_normalize=False, sigmoid_bias=0.0" in table


def test_the_default_suite_has_every_component_and_every_knob_value():
    """CORE, what the default suite runs, leaves out combinations only: every registered component and every value
    of each of its knobs is in it."""
    assert {next(iter(c.items())) for c in CORE} == {(r.key, cls.name) for r in FAMILIES for cls in r}
    assert {kv for c in CORE for kv in c.items()} == {kv for c in CASES for kv in c.items()}
    assert len(CORE) < len(CASES)
