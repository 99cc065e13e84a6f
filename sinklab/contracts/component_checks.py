"""The contract every registered component passes, as plain checks (an AssertionError says what broke).

tests/model/test_contracts.py runs them over every registered component (`component_cases`), and
`sinklab check-component MODULE` over the components of a user's module: the fused, chunked and explicit paths
agree (forward and gradients), and so do FlexAttention (model.attn_backend=flex) and the memory-linear paths
(model.attn_memory=linear); decoding with a KV cache gives the full forward's logits; it is causal; its rows sum to
one where it says so; the chunked sink metric equals the brute-force one; it trains a step; a config group option
selects it.
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from sinklab.metrics.record import attention_maps
from sinklab.metrics.sink import attention_scores, brute_force_alpha
from sinklab.model import FAMILIES, ConfigError, ModelConfig, Transformer
from sinklab.model.config import KNOBS
from sinklab.model.ops.softmax import Softmax

SMALL = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)
MASKS = {"causal": {}, "prefix": {"prefix_len": 4}, "window": {"window": 5}, "sinks": {"n_sink_tokens": 2, "window": 4}}
# the families that meet the masks (positions, operations, biases) are checked under each mask, the others causal
MASK_FAMILIES = ("pos", "attn_op", "attn_bias")


def small_model(**overrides) -> Transformer:
    """A 2-layer, d 32 model with seed 0, in eval mode."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**SMALL, **overrides})).eval()


def token_ids(B: int = 2, T: int = 24, seed: int = 0, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def component_cases(classes: Optional[Sequence[type]] = None) -> list[dict]:
    """One config (overrides of SMALL) per registered component of every family (or per class of `classes`), and
    per value of each choice or boolean knob it owns (softmax x sink_logit, kernel x kernel_map x attn_normalize,
    ...) and of each knob that lists values to try in `metadata={"cases": (...)}` (rope x rope_fraction x
    nope_every), except the combinations the component's `validate` refuses."""
    cases = []
    for registry in FAMILIES:
        for cls in registry:
            if classes is not None and cls not in classes:
                continue
            owned = [(k, f) for k, (f, owners) in KNOBS.items() if cls in owners]
            axes = [[(k, c) for c in f.metadata["choices"]] for k, f in owned if "choices" in f.metadata]
            axes += [[(k, False), (k, True)] for k, f in owned if f.type in (bool, "bool")]
            axes += [[(k, c) for c in f.metadata["cases"]] for k, f in owned if "cases" in f.metadata]
            for combo in itertools.product(*axes):
                case = {registry.key: cls.name, **dict(combo)}
                case.update(cls.contract_needs(case))
                if not refused(case):
                    cases.append(case)
    return cases


def refused(case: dict) -> bool:
    try:
        ModelConfig(**{**SMALL, **case})
    except ConfigError:
        return True
    return False


def case_id(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


def with_masks(cases: list[dict], families: Sequence[str] = MASK_FAMILIES) -> list[tuple[dict, str]]:
    """(case, mask) pairs: every mask for a component of `families`, causal for the others (a mask the case's
    setting refuses left out)."""
    return [(case, mask) for case in cases for mask in (MASKS if next(iter(case)) in families else ["causal"])
            if mask == "causal" or not refused({**case, **MASKS[mask]})]


@contextlib.contextmanager
def flex_on_cpu() -> Iterator[list]:
    """FlexAttention with gradients on the CPU; yields the list of its calls (one entry each). torch's CPU builds
    refuse flex's backward in its front end (`_validate_device`) before the eager implementation runs, whose dense
    reference backward (the same higher-order op) is what checks sinklab's mask_mod, score_mod and log-sum-exp
    composition; the refusal is lifted inside the block only."""
    from torch.nn.attention import flex_attention as flex

    from sinklab.model import backends

    real, validate, calls = backends.flex_attention, flex._validate_device, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    flex._validate_device, backends.flex_attention = (lambda *tensors: None), counted
    backends.flex_trains_on.cache_clear()
    try:
        with warnings.catch_warnings():  # flex's note that it runs uncompiled on the CPU
            warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
            assert backends.flex_trains_on("cpu")
            calls.clear()
            yield calls
    finally:
        flex._validate_device, backends.flex_attention = validate, real
        backends.flex_trains_on.cache_clear()


@contextlib.contextmanager
def explicit_paths(m, explicit: bool = True) -> Iterator[None]:
    """Inside the block (when `explicit`), every layer of `m` runs through its explicit maps, not a fused kernel."""
    fused = [b.attn.use_fused for b in m.blocks]
    for b in m.blocks:
        b.attn.use_fused = b.attn.use_fused and not explicit
    try:
        yield
    finally:
        for b, f in zip(m.blocks, fused):
            b.attn.use_fused = f


def logits_and_grads(m, idx, explicit: bool = False):
    """Logits and gradients of a fixed function of them; `explicit`: every layer through its explicit maps."""
    m.zero_grad()
    with explicit_paths(m, explicit):
        logits = m(idx)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def assert_same_logits_and_grads(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        # float32 sums make an error relative to the tensor's largest entry (a sink token's gradient reaches
        # ~3e3 and carries ~1e-3 of noise on every entry, its small ones included), so atol grows with it
        atol = 1e-4 + 1e-5 * want[1][name].abs().max().item()
        torch.testing.assert_close(got[1][name], want[1][name], atol=atol, rtol=1e-4, msg=name)


def flex_layers(model) -> int:
    """How many layers attn_backend=flex computes: those whose operation is a softmax variant (a layer pattern may
    mix ops) and whose keys, where a sparsity selects them from the scores, FlexAttention can select (moba: yes;
    topk: the explicit map)."""
    sparsity = [block.attn.sparsity for block in model.blocks]
    return sum(isinstance(block.attn.op, Softmax) and (not s.selects or s.flex_selects)
               for block, s in zip(model.blocks, sparsity))


# ---------------------------------------------------------------------------------------------- the checks
def paths_agree(case: dict, mask: str) -> None:
    """The fused kernel (where the op has one), the whole explicit maps and row chunks of 5: same logits and
    gradients."""
    m = small_model(**{**case, **MASKS[mask]}).train()
    idx = token_ids()
    fused = logits_and_grads(m, idx)
    explicit = logits_and_grads(m, idx, explicit=True)
    for block in m.blocks:
        block.attn.use_fused, block.attn.row_chunk = False, 5
    chunked = logits_and_grads(m, idx)
    for other in (explicit, chunked):
        assert_same_logits_and_grads(other, fused)


def flex_and_linear_equal_explicit(case: dict, mask: str, calls: list) -> None:
    """FlexAttention for every softmax variant, model.attn_memory=linear for the others (row chunks of 5
    recomputed in backward; kernel attention's causal linear form): the explicit maps' logits and gradients.
    `calls`: flex_on_cpu's list."""
    idx = token_ids()
    explicit = logits_and_grads(small_model(**{**case, **MASKS[mask]}).train(), idx, explicit=True)
    m = small_model(**{**case, **MASKS[mask]}, attn_backend="flex", attn_memory="linear").train()
    for block in m.blocks:
        block.attn.row_chunk = 5
    assert_same_logits_and_grads(logits_and_grads(m, idx), explicit)
    assert len(calls) == flex_layers(m)  # one call per softmax layer, no fallback


def cuts(T: int) -> list[tuple[int, int]]:
    """A 6-token prompt (it covers the prefix LM's 4), a 3-token chunk, then one token at a time."""
    at = [0, 6, 9] + list(range(10, T + 1))
    return list(zip(at, at[1:]))


def kv_cache_decoding(case: dict, mask: str) -> None:
    """Decoding with a KV cache gives the full forward's logits; odd steps through the explicit maps, even ones
    through the fused kernel where the op has one."""
    m = small_model(**{**case, **MASKS[mask]})
    idx = token_ids()
    full = m(idx)
    cache = m.new_cache()
    steps = []
    for i, (a, b) in enumerate(cuts(idx.shape[1])):
        with explicit_paths(m, explicit=bool(i % 2)):
            steps.append(m(idx[:, a:b], cache=cache))
    assert cache.length == m.cfg.n_sink_tokens + idx.shape[1] and cache.seen == idx.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)


def flex_and_linear_decode(case: dict, mask: str, calls: list) -> None:
    """FlexAttention and kernel attention's causal linear form see a KV cache's earlier keys and the bias slots."""
    idx = token_ids()
    full = small_model(**{**case, **MASKS[mask]}, attn_backend="explicit")(idx)
    m = small_model(**{**case, **MASKS[mask]}, attn_backend="flex", attn_memory="linear")
    cache = m.new_cache()
    with torch.no_grad():  # flex's forward runs on every device
        steps = [m(idx[:, a:b], cache=cache) for a, b in cuts(idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)
    assert len(calls) == flex_layers(m) * len(steps)


def no_information_from_the_future(case: dict) -> None:
    m = small_model(**case)
    idx = token_ids()
    changed = idx.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 97
    before, after = m(idx), m(changed)
    assert torch.equal(after[:, :15], before[:, :15]), \
        f"changing token 15 changes the logits before it (by {(after[:, :15] - before[:, :15]).abs().max():.3g})"
    assert (after[:, 15:] - before[:, 15:]).abs().max() > 1e-6, "changing token 15 changes no logit"


def rows_sum_to_one_where_claimed(case: dict) -> None:
    """Every map is zero where a key is not visible, and its rows sum to one where the config says so."""
    extra = {"n_sink_tokens": 1, "window": 6}
    if refused({**case, **extra}):  # a setting that refuses a window (a layer pattern without local layers)
        del extra["window"]
    m = small_model(**{**case, **extra})
    idx = token_ids()
    layout = m.layout(idx.shape[1], idx.device)
    for a in attention_maps(m, idx):  # (B, H, S + T, n_slots + S + T)
        assert torch.all(a[..., ~layout.mask(torch.arange(layout.n_pos))] == 0), "attention to keys it cannot see"
        if m.cfg.row_normalised:
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), msg="rows claimed to sum to one do not")


def chunked_sink_metric_equals_brute_force(case: dict) -> None:
    m = small_model(**case, n_sink_tokens=1 if "attn_bias" not in case else 0)
    tokens = token_ids(B=3, T=20, seed=1)
    fast, ref = attention_scores(m, tokens, k=3, batch_size=2, chunk=7), brute_force_alpha(m, tokens, k=3)
    torch.testing.assert_close(fast.alpha, ref.alpha, atol=1e-5, rtol=1e-5)
    for name in ("slot", "alpha_star", "slot_star"):
        mine, want = getattr(fast, name), getattr(ref, name)
        assert (mine is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)


def trains_a_step(case: dict) -> None:
    """Two AdamW steps on what training minimises (the next-token loss and the forward's auxiliary losses, e.g. an
    indexer's KL): a finite, non-zero gradient for every parameter, and a lower loss."""
    m = small_model(**case).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    idx = token_ids(B=4, T=25)
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss = loss + sum(m.aux_losses.values())
        opt.zero_grad()
        loss.backward()
        for name, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, \
                f"parameter {name} gets no finite, non-zero gradient"
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], f"losses {losses} do not decrease"


def option_selects(registry: Any, name: str, option: Optional[str] = None) -> None:
    """`model/<group>=<option>` (default: the component's name) composes and selects the component."""
    from omegaconf import OmegaConf

    from sinklab.config import compose

    got = OmegaConf.to_container(compose([f"model/{registry.group}={option or name}"]).model)[registry.key]
    assert got == name, f"model/{registry.group}={option or name} selects model.{registry.key}={got}"


def quantizes(case: dict) -> None:
    """`sinklab quant` can quantize it: every linear layer is called as a module in the forward (its forward
    pre-hook sees its input: calibration records a range), and W4A4 fake quantization gives finite logits."""
    from sinklab.quant.fake import SCHEMES, calibrate, fake_quantized, quantizable_layers

    m = small_model(**case)
    layers = quantizable_layers(m)
    batch = token_ids(B=2, T=25)
    ranges = calibrate(m, layers, [batch])
    missing = sorted(set(layers) - set(ranges))
    assert not missing, f"linear layers never called as modules (computed with their .weight?): {missing}"
    with torch.no_grad(), fake_quantized(layers, SCHEMES["w4a4"], ranges):
        assert torch.isfinite(m(batch[:, :-1])).all(), "W4A4 logits are not finite"


# name -> (check, its cases, inside flex_on_cpu): cases "case" (one run per case), "mask" (per case and mask, every
# mask for the families that meet them), "masked" (the same, for those families only)
CHECKS: dict[str, tuple[Callable, str, bool]] = {
    "fused, chunked and explicit paths agree": (paths_agree, "mask", False),
    "flex and memory-linear paths equal the explicit maps": (flex_and_linear_equal_explicit, "mask", True),
    "decoding with a KV cache gives the full forward": (kv_cache_decoding, "mask", False),
    "flex and linear forms decode with a KV cache": (flex_and_linear_decode, "masked", True),
    "no information from the future": (no_information_from_the_future, "case", False),
    "rows sum to one where claimed": (rows_sum_to_one_where_claimed, "case", False),
    "chunked sink metric equals brute force": (chunked_sink_metric_equals_brute_force, "case", False),
    "trains a step": (trains_a_step, "case", False),
    "quantizes": (quantizes, "case", False),
}


def arguments(cases: list[dict], per: str) -> list[tuple]:
    """The arguments of a check's runs: (case,) or (case, mask)."""
    if per == "case":
        return [(case,) for case in cases]
    return [(c, m) for c, m in with_masks(cases) if per == "mask" or next(iter(c)) in MASK_FAMILIES]


def run_check(name: str, *args: Any) -> None:
    check, _, flex = CHECKS[name]
    if not flex:
        return check(*args)
    with flex_on_cpu() as calls:
        check(*args, calls)


def runs(cls: type) -> Iterator[tuple[str, Callable[[], None]]]:
    """(what, a call running one check) for every contract check of one registered component class."""
    cases = component_cases([cls])
    if not cases:  # every setting refused: the component's own line says why
        yield f"model.{cls.registry.key}={cls.name} builds", \
            lambda: ModelConfig(**{**SMALL, cls.registry.key: cls.name})
    for name, (_, per, _) in CHECKS.items():
        for args in arguments(cases, per):
            where = case_id(args[0]) + (f" [{args[1]} mask]" if len(args) > 1 else "")
            yield f"{name}: {where}", (lambda name=name, args=args: run_check(name, *args))
    yield f"model/{cls.registry.group}={cls.name} selects it", lambda: option_selects(cls.registry, cls.name)
