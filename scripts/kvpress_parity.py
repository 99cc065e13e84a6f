"""The keys NVIDIA kvpress keeps, for sinklab's parity test (tests/model/test_kvpress_parity.py): run in a venv of its
own with kvpress 0.5.5 (whose transformers pin, < 5.3, differs from sinklab's), never importing sinklab.

    python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5
    .venv-kvpress/bin/python scripts/kvpress_parity.py OUT_DIR          # .ci/run does this, OUT_DIR .ci-kvpress
    SINKLAB_KVPRESS_PARITY=OUT_DIR python -m pytest -m kvpress tests/model/test_kvpress_parity.py

It builds a tiny random LlamaForCausalLM (seed 0: 4 layers, 4 query heads sharing 2 kv heads of 16 dims, every
layer's queries and keys scaled up for sharper maps than the random init's) with a planted sink on the first token
(`plant_sink`: weak in some heads, strong in others, so that a rule's treatment of the first key shows), saves it to
OUT_DIR/model (save_pretrained), and compresses each of 4 random prompts of 64 tokens (seeded, token 0 first) at
prefill with each press below, at budgets of 16 and 32 keys (compression ratios 0.75 and 0.5: kvpress keeps int(64 (1 - ratio))), with
the eager attention (ObservedAttentionPress needs its maps; the others read them too). The keys a press keeps are
found in the dense forward's keys of the same layer (each kept key is a copy of one of them: its position), and
OUT_DIR/kept.json records, per case (press, its arguments, budget), per prompt, per layer, per kv head, the kept
positions in ascending order, with the versions of kvpress, transformers and torch, and the prompts.
"""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import torch

SEED, N_PROMPTS, LENGTH, BUDGETS = 0, 4, 64, (16, 32)
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
              attention_bias=True)
SHARPEN = 3.0  # every layer's q_proj and k_proj weights: logits x 9, so scores rarely tie
SINK = (0.25, 0.5, 0.75, 1.0)  # per query head, its pull toward the first token's key (logit 2 x this)
# (press class name, its arguments besides compression_ratio): each case of kept.json, for every budget
PRESSES = [
    ("StreamingLLMPress", {"n_sink": 4}),
    ("StreamingLLMPress", {"n_sink": 0}),
    ("KnormPress", {}),
    ("SnapKVPress", {"window_size": 8, "kernel_size": 5}),
    ("PyramidKVPress", {"window_size": 4, "kernel_size": 5, "beta": 2}),  # a pyramid at both budgets
    ("PyramidKVPress", {"window_size": 8, "kernel_size": 5, "beta": 20}),  # kvpress's beta: its uniform fallback
    ("ObservedAttentionPress", {}),
    ("TOVAPress", {}),
]


def build_model(out: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
        plant_sink(model)
    model.save_pretrained(str(out / "model"))
    return model


def plant_sink(model) -> None:
    """Token 0 alone has hidden dim 0 (its embedding, 10 there; nothing writes that dim: o_proj's and down_proj's
    row 0 are zero), every layer's k_proj maps it onto dim 7 of each kv head's key (8 after the RMSNorm), the pair of
    RoPE's slowest frequency (3e-4 rad a position: a key that barely turns), and query head h has a bias SINK[h] on
    that dim: its logit on token 0 is about 2 SINK[h] above chance, at every distance. v_proj ignores dim 0, so
    token 0's value is near zero (a no-op sink, as trained sinks are)."""
    hd = CONFIG["head_dim"]
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 0.0
    emb[0, 0] = 10.0
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, 0] = 0.0
        for h in range(CONFIG["num_key_value_heads"]):
            attn.k_proj.weight[h * hd + 7, 0] = 1.0
        for h, pull in enumerate(SINK):
            attn.q_proj.bias[h * hd + 7] = pull
        attn.o_proj.weight[0] = 0.0
        attn.o_proj.bias[0] = 0.0
        layer.mlp.down_proj.weight[0] = 0.0


def prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(1, CONFIG["vocab_size"], (N_PROMPTS, LENGTH), generator=g)
    ids[:, 0] = 0  # one first token for every prompt, as a BOS token
    return ids


@torch.no_grad()
def prefill(model, ids: torch.Tensor, press=None) -> list[torch.Tensor]:
    """Each layer's cached keys (1, Hkv, n, hd) after a prefill of ids (1, T), compressed by `press` (None: dense)."""
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=ids, past_key_values=cache)
    return [layer.keys for layer in cache.layers]


def positions(kept: torch.Tensor, dense: torch.Tensor) -> list[list[int]]:
    """Per kv head, the positions (ascending) of the dense keys that the kept keys (1, Hkv, n, hd) are copies of."""
    out = []
    for h in range(kept.shape[1]):
        same = (kept[0, h][:, None] == dense[0, h][None]).all(-1)  # (n, T): bit for bit
        if not bool((same.sum(-1) == 1).all()):
            raise SystemExit("a kept key is no copy of exactly one dense key: kvpress changed the keys it kept")
        out.append(sorted(same.int().argmax(-1).tolist()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory for model/ and kept.json")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    import kvpress
    import transformers
    from kvpress.utils import compute_n_kept

    model, ids = build_model(out), prompts()
    dense = [prefill(model, ids[p:p + 1]) for p in range(N_PROMPTS)]
    cases = []
    for name, args in PRESSES:
        for budget in BUDGETS:
            ratio = 1 - budget / LENGTH
            assert compute_n_kept(LENGTH, ratio) == budget, (budget, ratio)
            press = getattr(kvpress, name)(compression_ratio=ratio, **args)
            kept = [[positions(k, d) for k, d in zip(prefill(model, ids[p:p + 1], press), dense[p])]
                    for p in range(N_PROMPTS)]
            cases.append({"press": name, "args": args, "budget": budget, "compression_ratio": ratio, "kept": kept})
            print(f"{name} {args} budget {budget}: per-layer kept {[len(layer[0]) for layer in kept[0]]}")
    record = {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__,
              "model": "model", "prompts": ids.tolist(), "cases": cases}
    (out / "kept.json").write_text(json.dumps(record) + "\n")
    print(f"wrote {out / 'kept.json'}: {len(cases)} cases x {N_PROMPTS} prompts")


if __name__ == "__main__":
    main()
