#!/usr/bin/env python
"""Gated DeltaNet (sinklab/model/ops/recurrent.py) against a softmax layer of the same width: a training step's time
and the memory autograd keeps against T, and a decoding step's time against the context.

    python scripts/bench_recurrent.py [--lengths 256,1024] [--contexts 256,1024,4096] [--repeats 5] [--threads 1]

Training: one attention layer (`sinklab.model.attention.Attention`, the CPU recipe's width: 8 heads, d 128, batch 4)
of each op, forward and backward of the sum of its output on random input: the lower quartile of `--repeats` timed
steps after one warm-up, in ms, and the ratio Gated DeltaNet / softmax (softmax through SDPA, the default backend;
Gated DeltaNet's chunked form, chunks of 64). Memory: the bytes of the tensors autograd saves for backward in that
step (`torch.autograd.graph.saved_tensors_hooks`; each stored tensor counted once), per T: softmax's SDPA saves no
T x T map either, so both are linear in T, the ratio between lengths says so.
Decoding: a 4-layer model of the recipe's width, all softmax or all Gated DeltaNet, random weights, fed the context
in one forward through a dense KV cache, then 32 single-token steps timed (lower quartile, ms); the softmax model
attends to all n cached keys (its cost grows with n), Gated DeltaNet reads its fixed-size memory (flat). Contexts past
block_size: the model is told to read past its context (RoPE extrapolates; random weights, only the time counts).
Not part of the unit tests; see docs/performance.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from sinklab.model import ModelConfig, Transformer  # noqa: E402
from sinklab.model.attention import Attention  # noqa: E402

WIDTH = dict(vocab_size=1024, n_layer=4, n_head=8, d_model=128, d_ff=352)
OPS = ("softmax", "gated_deltanet")


def config(op: str, block_size: int) -> ModelConfig:
    return ModelConfig(**WIDTH, block_size=block_size, attn_op=op)


def train_step(op: str, T: int, repeats: int, batch: int = 4) -> tuple[float, int]:
    """(lower-quartile ms of a forward + backward of one layer, bytes autograd saved in it)."""
    torch.manual_seed(0)
    model = Transformer(config(op, T))
    layer: Attention = model.blocks[0].attn.train()
    x = torch.randn(batch, T, WIDTH["d_model"], requires_grad=True)
    layout = model.layout(T, x.device)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, layout).sum().backward()  # warm-up, and the memory count
    times = []
    for _ in range(repeats):
        layer.zero_grad()
        x.grad = None
        t0 = time.perf_counter()
        layer(x, layout).sum().backward()
        times.append(1e3 * (time.perf_counter() - t0))
    return quartile(times), sum(saved.values())


@torch.no_grad()
def decode_step(op: str, n: int, steps: int = 32) -> float:
    """Lower-quartile ms of a single-token decoding step after n tokens in a dense KV cache."""
    torch.manual_seed(0)
    model = Transformer(config(op, 64)).eval()
    model.past_context = True
    tokens = torch.randint(0, WIDTH["vocab_size"], (1, n + steps), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    model(tokens[:, :n], cache=cache)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        model(tokens[:, n + i:n + i + 1], cache=cache)
        times.append(1e3 * (time.perf_counter() - t0))
    return quartile(times)


def quartile(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024", help="training lengths T")
    ap.add_argument("--contexts", default="256,1024,4096", help="decoding contexts n")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(v) for v in args.lengths.split(",")]
    contexts = [int(v) for v in args.contexts.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); width: {WIDTH}")
    print("training step of one layer (batch 4): ms (lower quartile), MiB saved for backward")
    mem: dict[str, list[int]] = {op: [] for op in OPS}
    for T in lengths:
        (ms_s, b_s), (ms_g, b_g) = (train_step(op, T, args.repeats) for op in OPS)
        mem["softmax"].append(b_s)
        mem["gated_deltanet"].append(b_g)
        print(f"  T={T:5d}  softmax {ms_s:8.2f} ms {b_s / 2**20:7.2f} MiB | gated_deltanet {ms_g:8.2f} ms "
              f"{b_g / 2**20:7.2f} MiB | time ratio gdn/softmax {ms_g / ms_s:5.2f}x")
    if len(lengths) > 1:
        grow = lengths[-1] / lengths[0]
        print(f"  memory T={lengths[-1]} / T={lengths[0]} ({grow:g}x longer): "
              + ", ".join(f"{op} {m[-1] / m[0]:.2f}x" for op, m in mem.items()))
    print("decoding step after n tokens (4 layers, dense cache): ms (lower quartile of 32 steps)")
    for op in OPS:
        row = [decode_step(op, n) for n in contexts]
        print(f"  {op:15s} " + "  ".join(f"n={n}: {ms:6.2f}" for n, ms in zip(contexts, row))
              + f"  | n={contexts[-1]} / n={contexts[0]}: {row[-1] / row[0]:.2f}x")


if __name__ == "__main__":
    main()
