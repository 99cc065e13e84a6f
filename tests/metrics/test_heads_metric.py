"""The `heads` metric (sinklab/metrics/heads.py) and the induction metric's split by head type: alpha_1, Sink_1, the
share of the sink heads and the q / k rotary pair maxima of each head type against a brute force over whole maps and
the recorded q and k, the partial- / full-cycle split, a planted outlier found in its pair's class, and what applies
where."""
import json
import math

import pytest
import torch

from sinklab.contracts.metrics import assert_within_bounds
from sinklab.metrics import METRICS, Context, attention_maps, measure_model
from tests.helpers import layer_records, small_model, token_ids

T, EPS = 24, 0.15  # eps near alpha_1 of a uniform head at T = 24 (0.16): some random heads sink, some do not
MIXED = {"nope_every": 2}  # layer 0 RoPE, layer 1 NoPE
PARTIAL = {"rope_fraction": 0.5}  # every head: pair 0 and 1 rotate, 2 and 3 (hd 8) do not
LOGGED = ("sink1", "alpha1", "sink_share", "qk_max_partial_cycle", "qk_max_full_cycle", "qk_max_unrotated")
# (model, eps): eps amid the random heads' alpha_1 (a sink token and the bias slot take some of token 1's share)
CASES = {"nope_every2": (MIXED, EPS), "rope_fraction0.5": (PARTIAL, EPS),
         "nope_every2_sinks_kv": ({**MIXED, "n_sink_tokens": 1, "attn_bias": "kv"}, 0.1)}


def measured(model, tokens, names=("heads", "induction"), eps=EPS):
    """The metrics `names` at `eps`, in batches of 2 and row chunks of 5, with their results."""
    metrics = measure_model(model, tokens, list(names), eps=[eps], k=1, batch_size=2, chunk=5)
    return {m.name: (m, m.result()) for m in metrics}


def expected_types(cfg) -> list[str]:
    """Each layer's type, from the knobs' definitions: NoPE in layers (l + 1) % nope_every == 0, else RoPE, partial
    where rope_fraction leaves pairs unrotated."""
    rotates = [cfg.nope_every is None or (layer + 1) % cfg.nope_every for layer in range(cfg.n_layer)]
    return ["nope" if not r else "rope" if cfg.rope_fraction == 1 else "partial" for r in rotates]


def expected_frequencies(cfg) -> torch.Tensor:
    """(L, hd/2): base^(-2i/hd) for the floor(fraction * hd/2) fastest pairs of a rotating layer, else 0."""
    half = cfg.hd // 2
    out = torch.zeros(cfg.n_layer, half, dtype=torch.float64)
    for layer, t in enumerate(expected_types(cfg)):
        if t != "nope":
            kept = int(cfg.rope_fraction * half)
            out[layer, :kept] = torch.tensor([cfg.rope_base ** (-2 * i / cfg.hd) for i in range(kept)])
    return out


@torch.no_grad()
def brute_force(model, tokens, eps):
    """Per type, by the definitions, head by head: alpha1, sink1, sink_share, qk_max_<class>, pairs; and the per-head
    pair maxima q, k (L, H, hd/2) from the recorded q and k (sink tokens and the bias slot dropped)."""
    cfg = model.cfg
    S, n_extra, half = cfg.n_sink_tokens, cfg.n_slots + cfg.n_sink_tokens, cfg.hd // 2
    N = tokens.shape[0]
    # alpha_1 (N, L, H): the mean over every real query of its attention on token 1
    alpha = torch.stack([a[:, :, S:, n_extra].double().mean(-1) for a in attention_maps(model, tokens)], 1)
    records = layer_records(model, tokens)

    def pair_max(x):  # (N, H, T, hd) -> (H, hd/2)
        return torch.linalg.vector_norm(torch.stack([x[..., :half], x[..., half:]], -1), dim=-1).amax(dim=(0, 2))

    q = torch.stack([pair_max(r["q"][:, :, S:]) for r in records])
    k = torch.stack([pair_max(r["k"][:, :, n_extra:]) for r in records])
    span = S + tokens.shape[1] - 1
    freq = expected_frequencies(cfg)
    classes = ["unrotated" if f == 0 else "full_cycle" if f * span >= 2 * math.pi else "partial_cycle"
               for f in freq.flatten().tolist()]
    types = expected_types(cfg)
    n_sinks = int((alpha > eps).sum())
    out = {}
    for t in dict.fromkeys(types):
        layers = [layer for layer, x in enumerate(types) if x == t]
        heads = [(layer, h) for layer in layers for h in range(cfg.n_head)]
        sinks = [sum(float(alpha[n, layer, h]) > eps for layer, h in heads) for n in range(N)]
        values = {"heads": len(heads), "alpha1": sum(float(alpha[n, l, h]) for n in range(N) for l, h in heads)
                  / (N * len(heads)),
                  "sink1": 100 * sum(s / len(heads) for s in sinks) / N,
                  "sink_share": 100 * sum(sinks) / n_sinks if n_sinks else None,
                  "pairs": {c: 0 for c in ("partial_cycle", "full_cycle", "unrotated")}}
        pair_norms = {c: [] for c in values["pairs"]}
        for layer, h in heads:
            for i in range(half):
                c = classes[layer * half + i]
                values["pairs"][c] += 1
                pair_norms[c].append(max(float(q[layer, h, i]), float(k[layer, h, i])))
        values.update({f"qk_max_{c}": max(v) if v else None for c, v in pair_norms.items()})
        out[t] = values
    return out, q, k


@pytest.mark.parametrize("case, eps", CASES.values(), ids=CASES.keys())
def test_the_values_of_each_type_equal_the_brute_force(case, eps):
    model, tokens = small_model(**case), token_ids(B=5, T=T, seed=4)
    metric, res = measured(model, tokens, eps=eps)["heads"]
    expected, q, k = brute_force(model, tokens, eps)
    by_type = metric.json(res)["by_type"]
    assert list(by_type) == list(expected)  # only the types present, in HEAD_TYPES order
    for t, values in expected.items():
        for key, value in values.items():
            if isinstance(value, float):
                assert by_type[t][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (t, key)
            else:
                assert by_type[t][key] == value, (t, key)
    torch.testing.assert_close(res["q_max"], q, rtol=1e-6, atol=0)
    torch.testing.assert_close(res["k_max"], k, rtol=1e-6, atol=0)
    logs = metric.log(res)
    assert logs == {f"heads/{t}/{key}": values[key] for t, values in by_type.items() for key in LOGGED
                    if values[key] is not None}  # a value that does not exist is not logged (no NaN)
    assert any(0 < v["sink1"] < 100 for v in expected.values())  # some heads sink, some do not
    assert sum(logs[f"heads/{t}/sink_share"] for t in expected) == pytest.approx(100.0)
    assert_within_bounds(logs, "heads")


def test_a_single_type_model_gives_the_sink_metric_s_values():
    """Every head RoPE: heads/rope/sink1 and alpha1 are sink/sink1 and sink/alpha1, its share 100% of the sinks."""
    model, tokens = small_model(), token_ids(B=5, T=T, seed=1)
    m = measure_model(model, tokens, ["sink", "heads"], eps=[EPS], k=1, batch_size=2, chunk=5)
    sink, heads = (x.log(x.result()) for x in m)
    assert heads["heads/rope/sink1"] == pytest.approx(sink["sink/sink1"], abs=1e-9)
    assert heads["heads/rope/alpha1"] == pytest.approx(sink["sink/alpha1"], rel=1e-6)
    assert sink["sink/sink1"] > 0 and heads["heads/rope/sink_share"] == 100.0


@pytest.mark.parametrize("case, seq_len, counts", [
    # hd 8, base 1e4: wavelengths 2 pi (1, 10, 100, 1000) = 6.3, 63, 628, 6283 positions
    (MIXED, 24, {"rope": (12, 4, 0), "nope": (0, 0, 16)}),  # span 23: pair 0 completes a turn, 1-3 do not
    (MIXED, 64, {"rope": (8, 8, 0), "nope": (0, 0, 16)}),  # span 63 >= 62.8: pair 1 turns too
    (PARTIAL, 24, {"partial": (8, 8, 16)}),  # pairs 2 and 3 unrotated, pair 1 partial, pair 0 full
], ids=["nope_every2_T24", "nope_every2_T64", "rope_fraction0.5_T24"])
def test_pairs_split_by_cycles_within_the_context(case, seq_len, counts):
    """(partial-cycle, full-cycle, unrotated) (head, pair) counts per type; a class a type has no pair of is not
    logged (no rotating pair on a NoPE head, none unrotated on a RoPE head)."""
    model = small_model(**case, block_size=64)
    metric, res = measured(model, token_ids(B=3, T=seq_len, seed=2), ["heads"])["heads"]
    part = metric.json(res)
    assert part["span"] == seq_len - 1
    got = {t: tuple(v["pairs"][c] for c in ("partial_cycle", "full_cycle", "unrotated"))
           for t, v in part["by_type"].items()}
    assert got == counts
    logs = metric.log(res)
    for t, (partial, full, unrotated) in counts.items():
        for c, n in (("partial_cycle", partial), ("full_cycle", full), ("unrotated", unrotated)):
            assert (f"heads/{t}/qk_max_{c}" in logs) == (n > 0), (t, c)


@pytest.mark.parametrize("case, layer, head, pair, cls", [
    (MIXED, 0, 1, 2, "partial_cycle"),  # a RoPE layer's slow pair
    (MIXED, 0, 3, 0, "full_cycle"),  # its fastest pair
    (PARTIAL, 1, 0, 3, "unrotated"),  # p-RoPE's unrotated pair, in the last layer
], ids=["rope_partial_cycle", "rope_full_cycle", "partial_unrotated"])
def test_a_planted_query_outlier_shows_in_its_type_and_pair_class(case, layer, head, pair, cls):
    """Scaling the q projection's row of one channel of one head's pair makes that pair's norm the largest in its
    class of its type, and leaves the layer's other classes (its keys and other q channels) as they were."""
    model, tokens = small_model(**case), token_ids(B=3, T=T, seed=5)
    before = measured(model, tokens, ["heads"])["heads"]
    hd = model.cfg.hd
    with torch.no_grad():
        model.blocks[layer].attn.q_proj.weight[head * hd + pair] *= 100.0
    metric, res = measured(model, tokens, ["heads"])["heads"]
    t = expected_types(model.cfg)[layer]
    planted = res["q_max"][layer, head, pair].item()
    logs, old = metric.log(res), before[0].log(before[1])
    assert logs[f"heads/{t}/qk_max_{cls}"] == planted > 20 * old[f"heads/{t}/qk_max_{cls}"]
    vector = metric.json(res)["by_type"][t]["q_pair_max"]
    assert vector[pair] == planted == max(vector)
    # the planted layer is the type's only one (MIXED's layer 0) or the last (its q moves no later layer): its keys
    # and other q channels are as they were, and so is every other class of the type
    for other in {"partial_cycle", "full_cycle", "unrotated"} - {cls}:
        assert logs.get(f"heads/{t}/qk_max_{other}") == old.get(f"heads/{t}/qk_max_{other}"), other


def test_induction_and_previous_token_scores_by_type_are_the_best_head_s():
    model = small_model(**MIXED)
    metric, res = measured(model, token_ids(B=5, T=T, seed=4))["induction"]
    logs = metric.log(res)
    for layer, t in enumerate(expected_types(model.cfg)):
        for name in ("induction", "prev_token"):
            heads = res["by_head"][name][layer]
            assert logs[f"heads/{t}/{name}"] == max(heads)
            assert res["by_type"][t][f"{name}_mean"] == pytest.approx(sum(heads) / len(heads))
    assert_within_bounds(logs, "induction")


def test_the_json_part_is_strict_and_shaped_by_layer_head_and_pair():
    model = small_model(**MIXED, n_layer=3)  # layers RoPE, NoPE, RoPE
    metric, res = measured(model, token_ids(B=3, T=T, seed=2), ["heads"])["heads"]
    part = json.loads(json.dumps(metric.json(res), allow_nan=False))
    L, H, P = 3, model.cfg.n_head, model.cfg.hd // 2
    assert part["types"] == [["rope"] * H, ["nope"] * H, ["rope"] * H]
    for name in ("frequency", "q_pair_max", "k_pair_max"):
        assert torch.tensor(part["by_head"][name]).shape == (L, H, P), name
    assert torch.tensor(part["by_head"]["frequency"])[1].eq(0).all()  # the NoPE layer's pairs do not rotate
    assert all(len(v["q_pair_max"]) == len(v["k_pair_max"]) == P for v in part["by_type"].values())
    by_layer = part["by_layer"]
    assert [x is None for x in by_layer["nope"]["alpha1"]] == [True, False, True]
    assert by_layer["rope"]["qk_max_unrotated"] == [None] * 3 and by_layer["nope"]["qk_max_full_cycle"] == [None] * 3
    assert max(by_layer["rope"]["qk_max_partial_cycle"][0::2]) == part["by_type"]["rope"]["qk_max_partial_cycle"]
    text = METRICS.get("heads").text(part, {})
    assert text[2].split()[:2] == ["rope", str(2 * H)] and text[3].split()[:2] == ["nope", str(H)]


def test_it_applies_to_sinklab_models_only():
    """A Hugging Face model gives no config of head types (its context has no sinklab model): the metric does not
    apply, and the induction metric logs no split by type."""
    ctx = Context(n_layer=1, n_head=2)
    assert not METRICS.get("heads").applies(ctx) and "heads" not in [m.name for m in METRICS.build(ctx)]
    (induction,) = METRICS.build(ctx, ["induction"])
    induction.repeat = 2  # as own_input sets it for an input of 5 tokens
    uniform = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6)[:, None]
    induction.update_maps(0, torch.arange(5), uniform.expand(3, 2, 5, 5))
    induction.end_batch()
    res = induction.result()
    assert "by_type" not in res and not any(key.startswith("heads/") for key in induction.log(res))
    assert res["prev_token"] == pytest.approx(sum(1 / (i + 1) for i in range(1, 5)) / 4)
