#!/usr/bin/env python
"""Training throughput of sinklab against a minimal plain-PyTorch LLaMA, MFU against this machine's measured
matmul peak, the sink callback's share of training time, the metric's memory, and data loading's share.

    python scripts/bench.py --config tiny|14m|60m [--steps N] [--threads N] [--batch B] [--compile]
                            [--device cpu|cuda] [--dtype fp32|bf16] [--quick] [--skip NAME ...]

Prints one line per figure (`name: value  (details)`); see docs/performance.md for measured figures and method.
Timings are wall clock; on a shared machine read the ratios (each taken within one round of alternating runs in
the same process), not the absolute tokens/s. Not part of the unit tests.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# batch size per config: the data default (32) where a CPU step takes < ~10 s, smaller for the 2048 context
DEFAULT_BATCH = {"tiny": 32, "14m": 32, "60m": 2}
SECTIONS = ("peak", "train", "compile", "callback", "metric", "data")


# ====================================================================== the plain reference (LLaMA, ~60 lines)
def rope_tables(hd: int, T: int, base: float = 10000.0, device=None, dtype=torch.float32):
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    f = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    f = torch.cat([f, f], -1)
    return f.cos().to(device, dtype), f.sin().to(device, dtype)


def rope(x, cos, sin):  # rotate-half, x (B, H, T, hd)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RefAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.h, self.hd = n_head, d // n_head
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        B, T, d = x.shape
        q, k, v = (w(x).view(B, T, self.h, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, d))


class RefBlock(nn.Module):
    def __init__(self, d, n_head, d_ff, eps):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.attn = RefAttention(d, n_head)
        self.w1, self.w3 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RefLLaMA(nn.Module):
    def __init__(self, vocab, n_layer, n_head, d, d_ff, T, eps=1e-5, base=10000.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(RefBlock(d, n_head, d_ff, eps) for _ in range(n_layer))
        self.norm, self.head = nn.RMSNorm(d, eps=eps), nn.Linear(d, vocab, bias=False)
        cos, sin = rope_tables(d // n_head, T, base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        cos, sin = self.cos[: idx.shape[1]], self.sin[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def ref_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def ref_from_sinklab(net) -> RefLLaMA:
    """A reference of the same shape, with sinklab's weights copied in (so both compute the same function)."""
    c = net.cfg
    ref = RefLLaMA(c.vocab_size, c.n_layer, c.n_head, c.d_model, c.d_ff, c.block_size, c.norm_eps, c.rope_base)
    src = net.state_dict()
    names = {"emb.weight": "tok_emb.weight", "norm.weight": "norm.weight", "head.weight": "lm_head.weight"}
    for i in range(c.n_layer):
        for a, b in (("n1", "norm1"), ("n2", "norm2")):
            names[f"blocks.{i}.{a}.weight"] = f"blocks.{i}.{b}.weight"
        for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            names[f"blocks.{i}.attn.{a}.weight"] = f"blocks.{i}.attn.{b}.weight"
        for w in ("w1", "w2", "w3"):
            names[f"blocks.{i}.{w}.weight"] = f"blocks.{i}.ffn.{w}.weight"
    ref.load_state_dict({k: src[v].clone() for k, v in names.items()}, strict=True)
    return ref


# ====================================================================== helpers
class Timer:
    """Wall clock with the device synchronised; also process CPU time (less sensitive to other processes)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    """Interquartile range as 'q1..q3' (how noisy a median is)."""
    if len(xs) < 4:
        return "n/a"
    q = statistics.quantiles(xs, n=4)
    return f"{q[0]:.3f}..{q[2]:.3f}"


def emit(name: str, value: str, detail: str = "") -> None:
    print(f"{name}: {value}" + (f"  ({detail})" if detail else ""), flush=True)


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16: autocast with fp32 master weights, as Lightning's bf16-mixed; fp32: nothing."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# ====================================================================== figures
def matmul_probe(n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], float]:
    """A callable that times one (n x n) @ (n x n) product and returns its FLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = Timer(device)
    reps = max(1, int(2e10 // (2 * n ** 3))) if device.type == "cpu" else 20  # >= ~0.1 s of work on a CPU

    def run() -> float:
        return reps * 2 * n ** 3 / timer(lambda: [a @ b for _ in range(reps)])

    run()
    return run


def pick_peak_size(device, dtype, quick: bool) -> tuple[int, dict]:
    """The matmul size with the highest FLOP/s (median of a few repeats each)."""
    sizes = ([1024, 2048] if quick else [1024, 2048, 4096]) if device.type == "cpu" else [4096, 8192]
    found = {}
    for n in sizes:
        probe = matmul_probe(n, device, dtype)
        found[n] = med([probe() for _ in range(3 if quick else 5)])
    return max(found, key=found.get), found


class Run:
    """One training setup (model, loss, optimizer) whose single steps can be timed."""

    def __init__(self, name, loss_fn, params, opt, sched, batches, device, dtype):
        self.name, self.loss_fn, self.params, self.opt, self.sched = name, loss_fn, list(params), opt, sched
        self.batches, self.i = batches, 0
        self.timer, self.device, self.dtype = Timer(device), device, dtype

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        with autocast(self.device, self.dtype):
            loss = self.loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)  # trainer.gradient_clip_val=1.0, as in conf/trainer
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self) -> float:
        return self.timer(self.step)


def alternate(runs: list[Run], steps: int, warmup: int, extra: Optional[Callable[[], None]] = None):
    """Time single steps of each run alternately (ABBA order, so drift in the machine's load hits all alike).
    Returns {name: [seconds per step]}; `extra` (e.g. a matmul probe) runs once per round too."""
    for r in runs:
        for _ in range(warmup):
            r.step()
    times = {r.name: [] for r in runs}
    for i in range(steps):
        for r in (runs if i % 2 == 0 else runs[::-1]):
            times[r.name].append(r.timed())
        if extra is not None:
            extra()
    return times


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round a / b."""
    return [x / y for x, y in zip(a, b)]
