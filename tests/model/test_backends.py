"""Attention backends (sinklab/model/backends.py) and memory-linear training (model.attn_memory=linear), beyond the
generic contract (tests/model/test_contracts.py checks every component on both, forward and gradients)."""
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from sinklab.model import ConfigError, ModelConfig, Transformer, backends
from sinklab.model.config import KEPT_MAPS_BUDGET, preset
from tests.helpers import (REPO, SMALL, assert_one_line_error, assert_same_logits_and_grads, logits_and_grads,
                           small_model, token_ids, training_peak)


@pytest.mark.parametrize("bad,message", [
    (dict(attn_backend="triton"), "model.attn_backend='triton' is not supported; allowed: sdpa, flex, explicit"),
    (dict(attn_memory="low"), "model.attn_memory='low' is not supported; allowed: auto, keep_maps, linear"),
    (dict(fused=False, attn_backend="flex"), "model.fused=false (the explicit path) contradicts "
                                             "model.attn_backend=flex; set model.attn_backend=explicit"),
])
def test_a_bad_execution_choice_is_one_line_naming_the_key(bad, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**SMALL, **bad)
    assert_one_line_error(err, starts=message)


def test_the_backend_is_resolved_in_one_place():
    choices = ({}, dict(attn_backend="flex"), dict(fused=False), dict(attn_backend="explicit"))
    assert [ModelConfig(**kw).backend for kw in choices] == ["sdpa", "flex", "explicit", "explicit"]
    assert [type(small_model(**kw).blocks[0].attn.backend).__name__ for kw in choices] == [
        "SDPABackend", "FlexBackend", "ExplicitBackend", "ExplicitBackend"]
    assert ModelConfig(attn_backend="flex", sink_logit="learned").can_fuse
    assert not ModelConfig(sink_logit="zero").can_fuse  # sdpa has no extra logit
    assert ModelConfig(attn_op="kernel", attn_memory="linear").can_fuse
    assert not ModelConfig(attn_op="kernel", attn_memory="linear", window=5, block_size=8).can_fuse


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "attn_backend=flex falls back to sdpa" in str(w.message)]


def test_without_flexattention_flex_falls_back_to_sdpa_with_one_warning(monkeypatch):
    monkeypatch.setattr(backends, "flex_attention", None)  # as on torch < 2.5
    backends.warn_once.cache_clear()
    idx = token_ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = small_model(attn_backend="flex", pos="alibi", window=5)
        outs = [m(idx), m(idx)]  # 2 layers x 2 forwards
    (message,) = fallback_warnings(caught)
    assert "has no torch.nn.attention.flex_attention" in message
    for out in outs:
        torch.testing.assert_close(out, small_model(pos="alibi", window=5)(idx), atol=0, rtol=0)


def test_flex_trains_through_sdpa_where_it_has_no_backward():
    """torch's CPU builds run FlexAttention's forward but not its backward: training falls back (one warning, the
    sdpa gradients; a sink logit takes the explicit path), a forward without autograd still runs flex."""
    if backends.flex_attention is None:
        pytest.skip("this torch has no FlexAttention")
    backends.flex_trains_on.cache_clear()
    backends.warn_once.cache_clear()
    if backends.flex_trains_on("cpu"):
        pytest.skip("this torch has FlexAttention's backward on the CPU")
    idx = token_ids()
    for case in (dict(pos="relative", prefix_len=4), dict(sink_logit="learned", attn_bias="kv")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = logits_and_grads(small_model(attn_backend="flex", **case).train(), idx)
        (message,) = fallback_warnings(caught)
        assert "no FlexAttention backward on cpu" in message
        assert_same_logits_and_grads(got, logits_and_grads(small_model(**case).train(), idx))
        backends.warn_once.cache_clear()


def test_flex_falls_back_under_a_dispatch_mode(flex_on_cpu):
    """Lightning's model summary runs a forward under torch's FlopCounterMode, where eager FlexAttention raises and
    leaves later flex calls of the process broken: flex is not tried there, and runs again afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    backends.warn_once.cache_clear()
    idx = token_ids()
    m = small_model(attn_backend="flex", sink_logit="learned")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), FlopCounterMode(display=False):
        warnings.simplefilter("always")
        outs = [m(idx), m(idx)]
    (message,) = fallback_warnings(caught)
    assert "a torch dispatch mode is active" in message and not flex_on_cpu
    for out in outs:
        torch.testing.assert_close(out, small_model(sink_logit="learned")(idx), atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(m(idx), outs[0], atol=2e-5, rtol=1e-5)
    assert len(flex_on_cpu) == m.cfg.n_layer


@pytest.mark.parametrize("case", [dict(n_kv_head=2), dict(n_head=2, head_dim=6, n_kv_head=1, window=5),
                                  dict(softmax_scale=2.0, sink_logit="learned", pos="alibi"),
                                  dict(n_sink_tokens=2, prefix_len=4, window=3, attn_bias="kv", pos="alibi",
                                       sink_logit="zero"),
                                  dict(pos="relative", prefix_len=4, attn_bias="k", sink_logit="learned")],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_flex_equals_the_explicit_maps_on_combined_switches(case, flex_on_cpu):
    """Switches the contract tests meet one at a time: grouped queries, odd head sizes, scale, a sink logit with
    position biases, bias slots and sink tokens together."""
    idx = token_ids()
    m = small_model(attn_backend="flex", **case).train()
    assert_same_logits_and_grads(logits_and_grads(m, idx),
                                 logits_and_grads(small_model(**case).train(), idx, explicit=True))
    assert len(flex_on_cpu) == m.cfg.n_layer


@pytest.mark.parametrize("op", [dict(attn_op="sigmoid"), dict(attn_op="kernel", attn_normalize=True),
                                dict(sink_logit="learned")], ids=lambda c: c.get("attn_op", "sink_logit"))
def test_memory_linear_training_grows_linearly_in_t(op):
    """Peak training memory from T = 512 to 2048: the explicit maps kept for backward grow ~T^2 (with the linear
    terms, an exponent 1.56 .. 1.79 here), attn_memory=linear (row chunks recomputed in backward, kernel attention in
    its linear form) ~T (1.00)."""
    def exponent(**kw):
        return math.log(training_peak(2048, **op, **kw) / training_peak(512, **op, **kw)) / math.log(4)
    assert exponent(attn_memory="linear") <= 1.2 < 1.4 <= exponent(attn_memory="keep_maps")


def test_attn_memory_auto_is_resolved_in_one_place_against_the_stated_budget():
    """auto (the default): keep_maps while one fp32 map per head and layer of a sequence fits KEPT_MAPS_BUDGET
    (64 MiB), linear above; an explicit choice (an older config or checkpoint) stays what it says."""
    default = preset("tiny3")  # the default run (scale=quick): T = 64, bit for bit as before
    assert (default.attn_memory, default.memory, default.kept_map_bytes) == ("auto", "keep_maps", 4 * 3 * 8 * 64 * 64)
    at_budget = ModelConfig(n_layer=4, n_head=4, block_size=1024)  # 4 B x 4 layers x 4 heads x 1024^2 = 64 MiB
    assert at_budget.kept_map_bytes == KEPT_MAPS_BUDGET and at_budget.memory == "keep_maps"
    assert ModelConfig(n_layer=4, n_head=4, block_size=1025).memory == "linear"
    assert ModelConfig(n_layer=4, n_head=4, block_size=1024, attn_bias="kv").memory == "linear"  # a slot per row
    assert preset("60m").memory == "linear" and preset("14m").memory == "keep_maps"
    for explicit in ("keep_maps", "linear"):
        for T in (64, 2048):
            cfg = ModelConfig.from_dict({**preset("tiny").to_dict(), "block_size": T, "attn_memory": explicit})
            assert cfg.memory == explicit
    # the model runs what was resolved: the explicit path's recomputation, kernel attention's linear form
    big = dict(vocab_size=64, n_layer=4, n_head=4, d_model=32, d_ff=64, block_size=1025)
    assert Transformer(ModelConfig(**big, attn_op="sigmoid")).blocks[0].attn.recompute
    assert not Transformer(ModelConfig(**{**big, "block_size": 1024}, attn_op="sigmoid")).blocks[0].attn.recompute
    assert ModelConfig(**big, attn_op="kernel").can_fuse and not ModelConfig(**SMALL, attn_op="kernel").can_fuse


@pytest.mark.parametrize("op", [dict(attn_op="sigmoid"), dict(attn_op="softpick", attn_bias="kv"),
                                dict(sink_logit="learned", attn_backend="explicit"),
                                dict(attn_op="relu", pos="alibi", n_sink_tokens=2, prefix_len=5)],
                         ids=lambda c: c.get("attn_op", "sink_logit"))
def test_recomputed_rows_equal_the_kept_maps_bit_for_bit(op, monkeypatch):
    """attn_memory=linear recomputes the same row chunks (3 here) in backward: the loss and every gradient equal
    keep_maps' exactly (a learned position table's gradient sums its chunks in another order: test_contracts)."""
    from sinklab.model.attention import Attention

    monkeypatch.setattr(Attention, "row_chunk", 10)
    idx = token_ids()
    runs = [logits_and_grads(small_model(**op, attn_memory=memory).train(), idx) for memory in ("keep_maps", "linear")]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].keys() == runs[1][1].keys()
    assert all(torch.equal(runs[0][1][name], runs[1][1][name]) for name in runs[0][1])


STEP_RSS = """
import json, resource, sys, torch, torch.nn.functional as F
from sinklab.model import ModelConfig, Transformer
torch.set_num_threads(1)
T, B = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
m = Transformer(ModelConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=128, d_ff=352, block_size=T,
                            attn_op="sigmoid", attn_memory="linear"))
opt = torch.optim.AdamW(m.parameters())
idx = torch.randint(0, 1024, (B, T + 1), generator=torch.Generator().manual_seed(0))
for _ in range(3):
    F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


def step_peak_rss(T: int, B: int) -> int:
    """Peak RSS (KiB) of a fresh process that trains 3 steps of a 4-layer sigmoid model at T x B."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # this checkout first, then what PYTHONPATH held (a --target site)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", STEP_RSS, str(T), str(B)], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh processes: 20 .. 50 s on the shared 2-core CPU
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator measured is glibc's (Linux)")
def test_memory_linear_training_keeps_the_process_linear_in_t():
    """The root cause of issue 25 part 6: with torch.utils.checkpoint per row chunk, every chunk's backward made
    new full-size q / k / v gradients between its maps, and glibc's heap kept the holes: 3 steps at T = 2048 x 1
    peaked at 1.40x the resident memory of T = 256 x 8 (same tokens; the live tensors were the same, 111 MiB).
    Recomputed rows with accumulators allocated once: 1.03 .. 1.08x here."""
    assert step_peak_rss(2048, 1) <= 1.2 * step_peak_rss(256, 8)


@pytest.mark.slow
def test_a_whole_memory_linear_run_stays_linear_in_t():
    """Whole sinklab-train runs (validation, sink callback, model summary included): T = 2048 x 1 peaks at most
    1.3x the RSS of T = 256 x 8 (1.36 .. 1.50 before the fix, 1.05 .. 1.17 after, on this 2-core CPU)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_memory

    assert bench_memory.whole_run(lambda *line: print(*line)) <= 1.3
