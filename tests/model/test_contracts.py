"""The contract every registered component passes (sinklab/model/registry.py). A newly registered attention
operation, positional encoding, norm, FFN, gate or attention bias is tested here without new test code: its fused,
chunked and explicit paths agree (forward and gradients), and so do FlexAttention (model.attn_backend=flex) and the
memory-linear training paths (model.attn_memory=linear), decoding with a KV cache gives the full forward's logits,
it is causal, its rows sum to one where it says so, the
chunked sink metric equals the brute-force one, it trains a step, `sinklab quant` can quantize it (every
linear layer called as a module, so calibration sees its input), and a file of its config group selects it
(tests/model/test_model_zoo.py, which composes every switch file once).
The checks live in sinklab/contracts/component_checks.py, where `sinklab check-component` runs them on a user's module.

The default suite runs every component with every value of each of its knobs (tests.helpers.covering); the full
product of the knobs (`component_cases`) runs with the `slow` tests, as does the product of components and masks
in the KV-cache decoding of the flex and linear forms (the default suite meets every component and every mask).
"""

import pytest

from sinklab.contracts import component_checks as contract
from sinklab.model import FAMILIES
from tests.helpers import REPO, case_id, component_cases, covering, run_cli

CASES = component_cases()
# the default suite: every registered component and every value of each of its knobs (covering); the rest of the
# knobs' full product (gate position x activation x sharing, ...) is marked slow
CORE = covering(CASES)
WITH_MASKS = contract.arguments(CASES, "mask")
NEW_PATH_CASES = contract.arguments(CASES, "masked")


def one_mask_each(pairs: list[tuple]) -> list[tuple]:
    """Of (case, mask) pairs: each CORE case with one of its masks, the least used so far, so that every mask is
    met too (every value of both knobs, not their product)."""
    used: dict[str, int] = {}
    chosen = []
    for case in [c for i, (c, _) in enumerate(pairs) if c in CORE and all(c != d for d, _ in pairs[:i])]:
        mask = min((m for c, m in pairs if c == case), key=lambda m: used.get(m, 0))
        used[mask] = used.get(mask, 0) + 1
        chosen.append((case, mask))
    return chosen


def cases(items=CASES, core=None) -> list:
    """pytest params of `items` (cases, or (case, mask) pairs), those outside CORE (or outside `core`, a list of
    pairs) marked slow."""
    out = []
    for item in items:
        case, args, name = (item[0], item, f"{case_id(item[0])}-{item[1]}") if isinstance(item, tuple) else \
            (item, (item,), case_id(item))
        fast = case in CORE if core is None else item in core
        out.append(pytest.param(*args, id=name, marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_fused_chunked_and_explicit_paths_agree(case, mask):
    contract.paths_agree(case, mask)


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_flex_and_memory_linear_paths_equal_the_explicit_maps(case, mask, flex_on_cpu):
    """FlexAttention for every softmax variant (model.attn_backend=flex), with model.attn_memory=linear for the
    others (the explicit path's row chunks, 5 rows each, recomputed in backward; kernel attention in its causal linear
    form): the explicit maps' logits and gradients."""
    contract.flex_and_linear_equal_explicit(case, mask, flex_on_cpu)


@pytest.mark.parametrize("case,mask", cases(WITH_MASKS))
def test_decoding_with_a_kv_cache_gives_the_full_forward_logits(case, mask):
    """A 6-token prompt (it covers the prefix LM's 4), a 3-token chunk, then one token at a time; odd steps through
    the explicit maps, even ones through the fused kernel where the op has one."""
    contract.kv_cache_decoding(case, mask)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("case,mask", cases(NEW_PATH_CASES, core=one_mask_each(NEW_PATH_CASES)))
def test_flex_and_linear_forms_decode_with_a_kv_cache(case, mask, flex_on_cpu):
    """FlexAttention and kernel attention's causal linear form see a KV cache's earlier keys and the bias slots
    (for the operations, positions and biases, which meet the cache's key layout). The default suite decodes each
    component with one mask, every mask met (one_mask_each: a flex kernel is compiled per mask, ~0.4 s a case);
    the product of components and masks runs with the slow tests."""
    contract.flex_and_linear_decode(case, mask, flex_on_cpu)


@pytest.mark.parametrize("case", cases())
def test_no_information_from_the_future(case):
    contract.no_information_from_the_future(case)


@pytest.mark.parametrize("case", cases())
def test_rows_sum_to_one_where_claimed(case):
    contract.rows_sum_to_one_where_claimed(case)


@pytest.mark.parametrize("case", cases())
def test_chunked_sink_metric_equals_brute_force(case):
    contract.chunked_sink_metric_equals_brute_force(case)


@pytest.mark.parametrize("case", cases())
def test_trains_a_step(case):
    contract.trains_a_step(case)


@pytest.mark.parametrize("case", cases())
def test_quantizes(case):
    contract.quantizes(case)


def test_every_contract_check_runs_here():
    """The checks `sinklab check-component` runs on a user's component are the ones this file runs."""
    tested = {f.__code__.co_names for name, f in globals().items() if name.startswith("test_")}
    called = set().union(*tested)
    assert {check.__name__ for check, _, _ in contract.CHECKS.values()} <= called


def test_components_command_lists_every_registered_component(capsys):
    import json

    rc, out, err = run_cli("sinklab", "components", "--json", capsys=capsys)
    assert rc == 0, err
    listed = {(e["key"], e["name"]): e for e in json.loads(out)}
    for registry in FAMILIES:
        for name in registry.names():
            entry = listed[(f"model.{registry.key}", name)]
            assert entry["files"] and entry["about"], entry
    assert listed[("model.attn_op", "sigmoid")]["knobs"] == {"attn_normalize": False, "sigmoid_bias": 0.0}
    rc, table, err = run_cli("sinklab", "components", capsys=capsys)  # the table the README points to
    assert rc == 0, err
    assert "model.attn_op=sigmoid" in table and "knobs: attn_normalize=False, sigmoid_bias=0.0" in table


def test_extending_md_names_every_registry():
    """docs/extending.md, which says how the model is put together, names each family's registry with the key that
    selects it: a new family cannot go undocumented."""
    from sinklab.model import registry

    text = (REPO / "docs" / "extending.md").read_text()
    names = {id(value): name for name, value in vars(registry).items() if isinstance(value, registry.Registry)}
    missing = [f"`{names[id(r)]}` (`model.{r.key}`)" for r in FAMILIES
               if f"`{names[id(r)]}` (`model.{r.key}`" not in " ".join(text.split())]
    assert not missing, f"docs/extending.md does not name {missing}"


def test_the_default_suite_has_every_component_and_every_knob_value():
    """CORE, what the default suite runs, leaves out combinations only: every registered component and every value
    of each of its knobs is in it."""
    assert {next(iter(c.items())) for c in CORE} == {(r.key, cls.name) for r in FAMILIES for cls in r}
    assert {kv for c in CORE for kv in c.items()} == {kv for c in CASES for kv in c.items()}
    assert len(CORE) < len(CASES)
