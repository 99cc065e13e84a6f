"""sinklab's cache policies against NVIDIA kvpress 0.5.5 (sinklab.model.cache_policies: each policy's `reference` and
`differences`): the keys kvpress's presses kept, per prompt, layer and kv head, recorded by scripts/kvpress_parity.py
in a venv of its own (kvpress pins transformers < 5.3), against the keys sinklab's policy keeps on the same saved
model and prompts, under the prefill protocol (compress the prompt once), read through sinklab's transformers path
(`HFDecoder`: the eager maps, the cache's post-RoPE keys).

Where the methods coincide the kept sets are identical: StreamingLLM (and the window, n_sink 0), key norms, SnapKV with
pooling=reference, PyramidKV with schedule=kvpress (a pyramid at window 4, beta 2; kvpress's uniform fallback at
window 8, beta 20), H2O with recent=0 normalize=true (kvpress's ObservedAttentionPress) and TOVA with keep_last=true.
Where a documented knob is left at sinklab's default they differ, only as its difference says: SnapKV with
pooling=sinklab, H2O's sum (normalize=false), TOVA without keep_last (only where the latest key is not among its own
top scores), PyramidKV's schedule=pyramidkv (the per-layer sizes). Marked `kvpress` and `slow`: .ci/run makes the
record (OUT_DIR .ci-kvpress) and runs this, failing on a skip; elsewhere it is skipped without the record
(SINKLAB_KVPRESS_PARITY=OUT_DIR names another)."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from sinklab.model import cache_policies as cp
from tests.helpers import REPO

pytestmark = [pytest.mark.kvpress, pytest.mark.slow]
RECORD = Path(os.environ.get("SINKLAB_KVPRESS_PARITY", REPO / ".ci-kvpress"))

# (kvpress press, its arguments) -> sinklab's policy and the knobs that make it the same method
SAME = [
    (("StreamingLLMPress", {"n_sink": 4}), ("streaming", {"first": 4})),
    (("StreamingLLMPress", {"n_sink": 0}), ("window", {})),
    (("KnormPress", {}), ("keynorm", {})),
    (("SnapKVPress", {"window_size": 8, "kernel_size": 5}), ("snapkv", {"window": 8, "kernel": 5})),
    (("PyramidKVPress", {"window_size": 4, "kernel_size": 5, "beta": 2}),
     ("pyramidkv", {"window": 4, "kernel": 5, "beta": 2, "schedule": "kvpress"})),
    (("PyramidKVPress", {"window_size": 8, "kernel_size": 5, "beta": 20}),
     ("pyramidkv", {"window": 8, "kernel": 5, "beta": 20, "schedule": "kvpress"})),
    (("ObservedAttentionPress", {}), ("h2o", {"recent": 0.0, "normalize": True})),
    (("TOVAPress", {}), ("tova", {"keep_last": True})),
]


@lru_cache(maxsize=1)
def record() -> dict:
    if not (RECORD / "kept.json").is_file():
        pytest.skip(f"no kvpress record in {RECORD}: run scripts/kvpress_parity.py {RECORD} in a venv with kvpress "
                    "0.5.5 (.ci/run does), or set SINKLAB_KVPRESS_PARITY")
    return json.loads((RECORD / "kept.json").read_text())


@lru_cache(maxsize=1)
def model():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(RECORD / record()["model"]),
                                                             attn_implementation="eager").eval()


def kvpress_kept(press: str, args: dict, budget: int) -> list:
    """kept[prompt][layer][kv head]: the sorted positions the press kept."""
    (case,) = [c for c in record()["cases"] if (c["press"], c["args"], c["budget"]) == (press, args, budget)]
    return case["kept"]


@torch.no_grad()
def sinklab_kept(name: str, budget: int, knobs: dict) -> list:
    """kept[prompt][layer][kv head] of sinklab's policy at prefill: the prompt through `HFDecoder` (prefill), then
    compressed. PyramidKV's per-layer sizes need a mask per layer, which a transformers model does not take, so
    its layers are picked from the same decoder's state with its own `capacity` and `keep` (as `KVCache.evict`)."""
    from sinklab.model.cache_policies.snapkv import PyramidKV
    from sinklab.targets.transformers_cache import HFDecoder

    policy = cp.build(name, budget, **knobs)
    out = []
    for prompt in record()["prompts"]:
        ids = torch.tensor([prompt])
        if isinstance(policy, PyramidKV):
            same = cp.build("snapkv", budget, window=policy.window, kernel=policy.kernel, pooling=policy.pooling)
            dec = HFDecoder(model(), same, evict="prefill")  # the state PyramidKV observes: SnapKV's
            dec(ids)
            layers = dec.cache.layers
            kept = [policy.keep(dec.states[i], layer.keys, i, min(policy.capacity(i, len(layers), ids.shape[1]),
                                                                     ids.shape[1]))
                    for i, layer in enumerate(layers)]
        else:
            dec = HFDecoder(model(), policy, evict="prefill")
            dec(ids)
            dec.compress()
            kept = dec.kept()
        out.append([[sorted(head.tolist()) for head in layer[0]] for layer in kept])
    return out


def compare(a: list, b: list) -> tuple[int, int]:
    """(kept sets equal, kept sets) over prompts x layers x kv heads."""
    pairs = [(x, y) for pa, pb in zip(a, b) for la, lb in zip(pa, pb) for x, y in zip(la, lb)]
    return sum(x == y for x, y in pairs), len(pairs)


def test_the_record_is_kvpress_0_5_5_on_the_saved_model():
    rec = record()
    assert rec["kvpress"] == "0.5.5" and len(rec["prompts"]) == 4
    assert model().config.num_hidden_layers == 4 and model().config.num_key_value_heads == 2


@pytest.mark.parametrize("budget", [16, 32])
@pytest.mark.parametrize("press,policy", SAME, ids=[f"{p[0]}-{q[0]}" for (p, q) in SAME])
def test_where_the_methods_coincide_the_kept_keys_are_kvpresss(press, policy, budget):
    equal, total = compare(sinklab_kept(policy[0], budget, policy[1]), kvpress_kept(*press, budget))
    assert total == 4 * 4 * 2
    assert equal == total, f"{policy}: {equal} of {total} kept sets equal kvpress's {press}"


@pytest.mark.parametrize("budget", [16, 32])
def test_snapkvs_own_pooling_keeps_other_keys(budget):
    """pooling=sinklab (every key pooled, the padding left out of the mean) changes some kept sets, and keeps the
    first token (the planted sink) in more of them than the reference rule does."""
    press = kvpress_kept("SnapKVPress", {"window_size": 8, "kernel_size": 5}, budget)
    own = sinklab_kept("snapkv", budget, {"window": 8, "kernel": 5, "pooling": "sinklab"})
    equal, total = compare(own, press)
    assert equal < total, "pooling=sinklab kept kvpress's keys in every set: the knob changes nothing"
    first = [sum(0 in head for prompt in kept for layer in prompt for head in layer) for kept in (own, press)]
    assert first[0] > first[1], f"token 1 kept in {first[0]} sets (sinklab's rule), {first[1]} (reference)"


@pytest.mark.parametrize("budget", [16, 32])
def test_h2os_sum_keeps_other_keys_than_kvpresss_mean(budget):
    press = kvpress_kept("ObservedAttentionPress", {}, budget)
    equal, total = compare(sinklab_kept("h2o", budget, {"recent": 0.0}), press)
    assert equal < total, "the summed attention kept kvpress's keys in every set: normalize changes nothing"


@pytest.mark.parametrize("budget", [16, 32])
def test_tova_differs_from_kvpress_only_where_it_drops_the_latest_key(budget):
    press = kvpress_kept("TOVAPress", {}, budget)
    own = sinklab_kept("tova", budget, {})
    last = len(record()["prompts"][0]) - 1
    for pa, pb in zip(own, press):
        for la, lb in zip(pa, pb):
            for x, y in zip(la, lb):
                assert x == y or (last not in x and last in y), (x, y)


def test_pyramidkvs_own_schedule_is_the_pyramidkv_codes_sizes():
    """schedule=pyramidkv: beyond the window (on top), layer l keeps max - l * step, max + min = 2 (budget - window),
    min = (budget - window) // beta; kvpress's sizes put the window inside the pyramid."""
    for budget in (16, 32):
        press = kvpress_kept("PyramidKVPress", {"window_size": 4, "kernel_size": 5, "beta": 2}, budget)
        own = sinklab_kept("pyramidkv", budget, {"window": 4, "kernel": 5, "beta": 2})
        spare = budget - 4
        low, high = spare // 2, 2 * spare - spare // 2
        want = [4 + round(high - layer * (high - low) / 3) for layer in range(4)]
        assert [len(layer[0]) for layer in own[0]] == want
        assert [len(layer[0]) for layer in press[0]] != want
