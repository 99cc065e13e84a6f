#!/usr/bin/env python
"""Training throughput of sinklab against a minimal plain-PyTorch LLaMA, MFU against this machine's measured
matmul peak, the sink callback's share of training time, the metric's memory, and data loading's share; on its own,
peak training memory against T per attention operation (`--section memory`, scripts/bench_memory.py), and the
peak resident memory of whole `sinklab-train` runs at T = 2048 x 1 against T = 256 x 8 (`--section run-memory`).

    python scripts/bench.py --config tiny|14m|60m [--steps N] [--threads N] [--batch B] [--compile]
                            [--device cpu|cuda] [--dtype fp32|bf16] [--quick] [--skip NAME ...]
                            [--set OVERRIDE ...] [--data corpus|random] [--vocab V] [--json PATH]
    python scripts/bench.py --section memory [--memory-T T ...] [--memory-speed-T T ...] [--memory-ops OP ...]
    python scripts/bench.py --section run-memory [--run-memory-set OVERRIDE ...]

Prints one line per figure (`name: value  (details)`); see docs/performance.md for measured figures and method.
`--set` takes Hydra overrides of the composed config (an attention path: `--set model/attn=sink_logit
model.attn_backend=flex`); `--data random --vocab 50432` times the paper's shape (its padded GPT-NeoX vocabulary) on
random tokens, with no corpus. On a GPU that Lightning knows, MFU is also given against the datasheet's dense peak at
the dtype (sinklab.train.throughput.datasheet_peak).
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sinklab.train.throughput import datasheet_peak, matmul_probe  # noqa: E402  (shared with training's peak_flops=auto)

# sequences per step: 2048 tokens in every config (tiny: the data default of 32 blocks), so that a CPU step takes
# seconds, not minutes; --batch 32 gives the data default for 14m / 60m too
DEFAULT_BATCH = {"tiny3": 16, "tiny": 32, "14m": 8, "60m": 1}  # tiny3: the default run (scale=quick)
SECTIONS = ("peak", "callback", "data", "lightning", "compile", "metric")  # --skip; the training loop always runs


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


def median_ci(xs) -> str:
    """Distribution-free 95% confidence interval of the median: the order statistics that scipy's quantile test
    (binomial, p = 0.5) puts around it; at least 6 rounds are needed."""
    from scipy.stats import quantile_test

    if not xs:
        return "n/a (too few rounds)"
    ci = quantile_test(xs, p=0.5).confidence_interval(0.95)
    if math.isnan(ci.low) or math.isnan(ci.high):
        return "n/a (too few rounds)"
    return f"{ci.low:.3f}..{ci.high:.3f}"


FIGURES: dict[str, dict[str, str]] = {}  # every emitted line, for --json


def emit(name: str, value: str, detail: str = "") -> None:
    FIGURES[name] = {"value": value, "detail": detail}
    print(f"{name}: {value}" + (f"  ({detail})" if detail else ""), flush=True)


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16: autocast with fp32 master weights, as Lightning's bf16-mixed; fp32: nothing."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# ====================================================================== figures
def pick_peak_size(device, dtype, quick: bool) -> tuple[int, dict]:
    """The matmul size with the highest FLOP/s (median of a few repeats each)."""
    sizes = [1024, 2048] if device.type == "cpu" else [4096, 8192]  # a probe runs in every round: keep it short
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


def alternate(runs: list[Run], steps: int, warmup: int, extra: Optional[Callable[[int], None]] = None):
    """Time single steps of each run alternately (ABBA order, so drift in the machine's load hits all alike).
    Returns {name: [seconds per step]}; `extra(round)` (e.g. a matmul probe) runs once per round too."""
    for r in runs:
        for _ in range(warmup):
            r.step()
    times = {r.name: [] for r in runs}
    for i in range(steps):
        for r in (runs if i % 2 == 0 else runs[::-1]):
            times[r.name].append(r.timed())
        if extra is not None:
            extra(i)
    return times


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round a / b."""
    return [x / y for x, y in zip(a, b)]


# ====================================================================== setup
def compose_cfg(config: str, batch: int, device: torch.device, overrides: tuple[str, ...] = ()):
    from sinklab.config import compose

    return compose([f"model={config}", f"data.batch_size={batch}",
                    "trainer.accelerator=" + ("gpu" if device.type == "cuda" else "cpu"), *overrides])


class RandomTokens:
    """Uniform random token blocks in the shape of LMDataModule's batches ((B, T + 1) int64), for timing the paper's
    shape without a corpus; a LightningDataModule for the Lightning section, with the probe set of the sink callback."""

    def __init__(self, vocab: int, batch: int, T: int, seed: int = 0):
        import lightning as L

        self.vocab_size, self.batch, self.T, self.num_workers = vocab, batch, T, 0
        gen = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, vocab, (8 * batch, T + 1), generator=gen)
        self.probe = torch.randint(0, vocab, (100, 64), generator=gen)
        outer = self

        class Module(L.LightningDataModule):
            def train_dataloader(self):
                return outer.make_train_loader()

            def probe_tokens(self):
                return outer.probe

        self.module = Module()

    def make_train_loader(self, step: int = 0):
        def batches():
            i = step
            while True:
                j = (i % 8) * self.batch
                yield self.blocks[j:j + self.batch]
                i += 1

        return batches()

    def probe_tokens(self) -> torch.Tensor:
        return self.probe


def build_datamodule(cfg, data: str = "corpus", vocab: int = 50432, batch: int = 1):
    """The real LMDataModule of the composed config (Shakespeare, cached), or random tokens (--data random, or where
    the corpus cannot be prepared)."""
    from hydra.utils import instantiate

    if data == "random":
        emit("data", f"random tokens, vocab {vocab}", "--data random: no corpus")
        return RandomTokens(vocab, batch, cfg.model.block_size)
    try:
        dm = instantiate(cfg.data, _recursive_=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm.prepare()
        return dm
    except Exception as err:  # e.g. an offline machine without the corpus in the cache
        emit("data", "unavailable", f"{type(err).__name__}: {str(err).splitlines()[0][:120]}; random tokens used")
        return None


def make_runs(cfg, dm, B: int, device, dtype, peak_flops=None, vocab: int = 50432):
    from omegaconf import OmegaConf

    from sinklab.train.module import LitLM

    mc = OmegaConf.to_container(cfg.model, resolve=True)
    mc["vocab_size"] = dm.vocab_size if dm is not None else vocab
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    torch.manual_seed(0)
    lit = LitLM(model={**mc, "compile": False}, optim=optim, max_steps=cfg.trainer.max_steps,
                peak_flops=peak_flops).to(device)
    ref = ref_from_sinklab(lit.net).to(device)
    T = lit.cfg.block_size
    if dm is not None:
        it = iter(dm.make_train_loader())
        batches = [next(it).to(device) for _ in range(4)]
    else:
        batches = [torch.randint(0, mc["vocab_size"], (B, T + 1), device=device) for _ in range(4)]
    with torch.no_grad(), autocast(device, dtype):
        diff = (lit.loss(batches[0]).float() - ref_loss(ref, batches[0]).float()).abs().item()
    sched_opt = lit.configure_optimizers()
    sink = Run("sinklab", lit.loss, lit.parameters(), sched_opt["optimizer"],
               sched_opt["lr_scheduler"]["scheduler"], batches, device, dtype)
    o = optim
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                weight_decay=o["weight_decay"])
    plain = Run("reference", lambda b: ref_loss(ref, b), ref.parameters(), ref_opt, None, batches, device, dtype)
    return lit, ref, sink, plain, batches, mc, optim, diff


# ====================================================================== main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(DEFAULT_BATCH))
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per model (default: tiny 40, 14m 16, 60m 6; a quarter with --quick)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--batch", type=int, default=None, help=f"sequences per step (default: {DEFAULT_BATCH})")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of sinklab's model vs eager")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and metric lengths: a smoke check")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="OVERRIDE",
                    help="a Hydra override of the composed config, e.g. model/attn=sink_logit (repeatable)")
    ap.add_argument("--data", choices=["corpus", "random"], default="corpus",
                    help="corpus: the composed data module (Shakespeare by default); random: random tokens")
    ap.add_argument("--vocab", type=int, default=50432,
                    help="vocabulary of --data random (default 50432, the paper's padded GPT-NeoX one)")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    ap.add_argument("--metric-T", type=int, nargs="+", default=None,
                    help="metric lengths (default 64 1024 4096 8192; 64 1024 with --quick)")
    ap.add_argument("--section", choices=["all", "memory", "run-memory"], default="all",
                    help="memory: only peak training memory vs T per attention operation (scripts/bench_memory.py); "
                         "run-memory: only the peak RSS of whole sinklab-train runs, T=2048 x 1 against T=256 x 8")
    ap.add_argument("--run-memory-set", nargs="*", default=[], metavar="OVERRIDE",
                    help="extra sinklab-train overrides of the run-memory section, e.g. callbacks.sink=null")
    ap.add_argument("--memory-T", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                    help="sequence lengths of the memory section (at least two)")
    ap.add_argument("--memory-speed-T", type=int, nargs="*", default=[1024, 4096],
                    help="lengths at which the memory section times the new path against the explicit one")
    ap.add_argument("--memory-rounds", type=int, default=3, help="alternating timed rounds per length")
    ap.add_argument("--memory-ops", nargs="+", default=None, help="operations of the memory section (default all)")
    args = ap.parse_args(argv)
    if args.section == "memory":
        return memory_section(args)
    if args.section == "run-memory":
        import bench_memory

        emit("setup", "run-memory section on the CPU", f"{_cpu_name()}; torch {torch.__version__}; OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average {os.getloadavg()[0]:.2f}")
        bench_memory.whole_run(emit, tuple(args.run_memory_set))
        return 0

    t_start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.dtype == "bf16" and args.device == "cpu":
        print("error: --dtype bf16 is for --device cuda (bf16 on this CPU is far slower than fp32)", file=sys.stderr)
        return 2
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    B = args.batch or DEFAULT_BATCH[args.config]
    default_steps = {"tiny3": 40, "tiny": 40, "14m": 16, "60m": 6}[args.config]
    steps = max(2, args.steps or default_steps // (4 if args.quick else 1))
    skip = set(args.skip)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    load0 = os.getloadavg()[0]

    cfg = compose_cfg(args.config, B, device, tuple(args.overrides))
    dm = build_datamodule(cfg, args.data, args.vocab, B)
    lit, ref, sink, plain, batches, mc, optim, diff = make_runs(cfg, dm, B, device, dtype, vocab=args.vocab)
    T = lit.cfg.block_size
    tokens = B * T
    fpt = lit.net.flops_per_token(T)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    emit("setup", f"config={args.config} B={B} T={T} ({tokens} tokens/step) {args.dtype} on {args.device}",
         f"{dev_name}; {threads} threads of {os.cpu_count()} cores; torch {torch.__version__}; "
         f"{lit.net.num_params() / 1e6:.2f}M non-embedding params; vocab {lit.cfg.vocab_size}; "
         f"{fpt / 1e6:.1f} MFLOP/token (6N + 12 L H hd T); "
         f"{'random tokens' if dm is None or isinstance(dm, RandomTokens) else 'train loader of ' + cfg.data.corpus}"
         + (f"; overrides: {' '.join(args.overrides)}" if args.overrides else ""))
    emit("reference check", f"|loss difference| {diff:.1e}", "same weights copied into the plain reference"
         + ("; --set changes the model, so the plain LLaMA is a timing reference only" if args.overrides else ""))
    if device.type == "cpu" and load0 >= 1.0:
        emit("warning", f"load average {load0:.2f} on {os.cpu_count()} cores before the benchmark",
             "other processes may compete for the cores: absolute figures are low and noisy; read the ratios "
             "(timed alternately), and compare with --threads 1, which suffers less from a busy core")

    # ---- one alternating loop: sinklab step, reference step, then the cheap probes of this round (matmul peak,
    # a train-loader batch, on some rounds a sink measurement), so that every ratio compares times taken together
    size, found = pick_peak_size(device, dtype, args.quick) if "peak" not in skip else (0, {})
    probe = matmul_probe(size, device, dtype) if size else None
    loader = iter(dm.make_train_loader(step=10_000)) if dm is not None and "data" not in skip else None
    if loader is not None:
        next(loader)
    meter = SinkMeter(cfg, dm, lit) if "callback" not in skip else None
    n_cb = 3 if args.quick else 6
    cb_rounds = {round(1 + i * (steps - 2) / max(1, n_cb - 1)) for i in range(n_cb)} if meter else set()
    peaks, data_t, cb_t = {}, {}, {}

    def extras(i: int) -> None:
        if probe is not None:
            peaks[i] = probe()
        if loader is not None:
            t0 = time.perf_counter()
            next(loader)
            data_t[i] = time.perf_counter() - t0
        if i in cb_rounds:
            cb_t[i] = meter.measure()

    times = alternate([sink, plain], steps, warmup=2, extra=extras)
    ts, tr = times["sinklab"], times["reference"]
    share = ratios(tr, ts)  # reference time / sinklab time: sinklab's speed as a share of the reference's
    emit("train tokens/s sinklab", f"{tokens / med(ts):,.0f}", f"median of {len(ts)} steps, {med(ts) * 1e3:.0f} ms/step")
    emit("train tokens/s reference", f"{tokens / med(tr):,.0f}", f"median of {len(tr)} steps, {med(tr) * 1e3:.0f} ms/step")
    emit("sinklab / reference speed", f"{med(share):.3f}x",
         f"median of {len(share)} per-round ratios (reference step time / sinklab step time), 95% CI "
         f"{median_ci(share)}, IQR {spread(share)}; ratio of median steps {med(tr) / med(ts):.3f}x, of fastest "
         f"steps {min(tr) / min(ts):.3f}x; target >= 0.95")
    peak = med(list(peaks.values())) if peaks else None
    if peaks:
        mfu = [fpt * tokens / ts[i] / p for i, p in peaks.items()]
        mfu_ref = [fpt * tokens / tr[i] / p for i, p in peaks.items()]
        emit(f"matmul peak {args.dtype}", f"{peak / 1e9:,.1f} GFLOP/s",
             f"{size}x{size} @ {size}x{size}, {threads} threads, median of {len(peaks)} probes between steps; at start "
             + ", ".join(f"{n}: {v / 1e9:.1f}" for n, v in found.items()) + " GFLOP/s")
        c = lit.cfg
        causal = 1 - 6 * c.n_layer * c.n_head * c.hd * T / fpt  # causal SDPA skips about half the attention square
        emit("MFU sinklab", f"{100 * med(mfu):.1f}% of the measured peak",
             f"per round: model FLOP/s / that round's matmul probe, IQR {spread(mfu)}; reference "
             f"{100 * med(mfu_ref):.1f}%; counting half the attention square (what causal attention computes): "
             f"{100 * causal * med(mfu):.1f}%; train with peak_flops={peak:.3g} to log perf/mfu")
    sheet = datasheet_peak(device, dtype)
    if sheet is not None:
        emit("MFU sinklab (datasheet)", f"{100 * fpt * tokens / med(ts) / sheet:.1f}% of {sheet / 1e12:.1f} TFLOP/s",
             f"{dev_name}'s dense {args.dtype} datasheet peak (Lightning's get_available_flops); reference "
             f"{100 * fpt * tokens / med(tr) / sheet:.1f}%")
    if meter is not None:
        meter.report({i: t / ts[i] for i, t in cb_t.items()}, med(ts))
    if data_t:
        dshare = [d / (d + ts[i]) for i, d in data_t.items()]
        emit("data loading share of step time", f"{100 * med(dshare):.2f}%",
             f"next(train loader) {med(list(data_t.values())) * 1e3:.2f} ms vs step {med(ts) * 1e3:.0f} ms; "
             f"real LMDataModule loader, num_workers={dm.num_workers} (loads in the training process)")

    # ---- the whole sinklab training step under Lightning (loop, logging, clipping, scheduler, data loading)
    if "lightning" not in skip:
        lightning_section(cfg, dm.module if isinstance(dm, RandomTokens) else dm, mc, optim, plain,
                          max(4, steps // 2) if args.quick else steps, device, dtype, peak, tokens)

    if args.compile and "compile" not in skip:
        compile_section(lit, mc, optim, cfg, sink, steps, device, dtype, tokens, fpt)

    if "metric" not in skip:
        metric_section(args.metric_T or ([64, 1024] if args.quick else [64, 1024, 4096, 8192]), device)

    emit("total", f"{time.perf_counter() - t_start:.0f} s",
         f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at the end")
    if args.json is not None:
        import json

        args.json.write_text(json.dumps({"argv": sys.argv[1:], "figures": FIGURES}, indent=1))
    return 0


def memory_section(args) -> int:
    import bench_memory

    ops = args.memory_ops or list(bench_memory.OPS)
    unknown = sorted(set(ops) - set(bench_memory.OPS))
    if unknown or len(args.memory_T) < 2:
        print(f"error: --memory-ops {' '.join(unknown)} unknown (allowed: {', '.join(bench_memory.OPS)})" if unknown
              else "error: --memory-T needs at least two lengths (the growth exponent is a slope)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    emit("setup", f"memory section on {args.device}",
         f"{_cpu_name() if args.device == 'cpu' else torch.cuda.get_device_name()}; torch {torch.__version__}; "
         f"load average {os.getloadavg()[0]:.2f}")
    device = torch.device(args.device)
    bench_memory.run(emit, Timer(device), sorted(args.memory_T), args.memory_speed_T, args.memory_rounds, device, ops)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


class SinkMeter:
    """SinkCallback as configured (conf/callbacks/default.yaml): `measure()` times one measurement (attention_scores
    + activation_stats on the probe set, through the callback's own measure and its `.seconds`); the heatmap it
    draws at each validation (also every 250 steps by default) is timed in `report`.
    Share of training time = (measurement + heatmap) / (every_n_steps x step time)."""

    def __init__(self, cfg, dm, lit):
        from types import SimpleNamespace

        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        self.cb = instantiate(OmegaConf.to_container(cfg.callbacks.sink, resolve=True))
        self.val_every = cfg.trainer.val_check_interval
        if dm is None:
            probe = torch.randint(0, lit.cfg.vocab_size, (100, 64))
            dm = SimpleNamespace(probe_tokens=lambda: probe)
        self.trainer, self.lit = SimpleNamespace(datamodule=dm, global_step=0), lit
        self.probe_shape = tuple(dm.probe_tokens().shape)
        self.cold = self.measure()  # the first call also warms up

    def measure(self) -> float:
        before = self.cb.seconds
        self.logged = self.cb.measure(self.trainer, self.lit)  # what the callback logs, for the heatmap's labels
        return self.cb.seconds - before

    def report(self, per_step: dict[int, float], step_time: float) -> None:
        import tempfile

        from sinklab.train.callbacks import save_heatmap

        cb, every = self.cb, self.cb.every_n_steps
        heat = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(4):  # the first imports matplotlib: reported apart
                t0 = time.perf_counter()
                save_heatmap(cb._alpha1, Path(tmp), i, self.logged)
                heat.append(time.perf_counter() - t0)
        measure_steps = med(list(per_step.values()))  # one measurement, in training steps of the same round
        heat_steps = med(heat[1:]) / step_time
        heat_every = self.val_every if isinstance(self.val_every, int) and cb.heatmap else None
        share = measure_steps / every + (heat_steps / heat_every if heat_every else 0.0)
        emit("sink callback share of training time", f"{100 * share:.2f}%",
             f"measurement every {every} steps = {measure_steps:.2f} steps of training (median of {len(per_step)}; "
             f"first call {self.cold:.2f} s), heatmap every {heat_every} steps = {heat_steps:.2f} steps "
             f"({med(heat[1:]):.2f} s; first {heat[0]:.2f} s with the matplotlib import); probe "
             f"{self.probe_shape[0]} x {self.probe_shape[1]}; target <= 2%")


def lightning_section(cfg, dm, mc, optim, plain: Run, steps: int, device, dtype, peak, tokens) -> None:
    """A real Trainer.fit of sinklab (trainer config as composed, CSV logger, no callbacks, no validation) with one
    plain reference step run inside each on_train_batch_end: sinklab's full step (data, Lightning loop,
    training_step and its logging, clipping, AdamW, scheduler) = time from the end of one reference step to the
    next hook."""
    import tempfile

    import lightning as L
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from sinklab.train.module import LitLM

    class Interleave(L.Callback):
        def __init__(self):
            self.mark: Optional[float] = None
            self.sink: list[float] = []
            self.ref: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            plain.timer.sync()
            now = time.perf_counter()
            if self.mark is not None and trainer.global_step > 2:
                self.sink.append(now - self.mark)
                self.ref.append(plain.timed())
            self.mark = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
        log_every = min(int(tcfg.get("log_every_n_steps") or 10), max(1, steps // 2))  # some rows in a short fit
        tcfg.update(default_root_dir=tmp, max_steps=steps + 3, limit_val_batches=0, enable_checkpointing=False,
                    log_every_n_steps=log_every,
                    enable_progress_bar=False, enable_model_summary=False,
                    precision="bf16-mixed" if dtype == torch.bfloat16 else "32-true",
                    accelerator="gpu" if device.type == "cuda" else "cpu")
        cb = Interleave()
        logger = L.pytorch.loggers.CSVLogger(tmp, name="", version="")
        torch.manual_seed(0)
        module = LitLM(model={**mc, "compile": False}, optim=optim, max_steps=cfg.trainer.max_steps, peak_flops=peak)
        trainer = instantiate(tcfg, callbacks=[cb], logger=[logger])
        with contextlib.redirect_stdout(sys.stderr):
            trainer.fit(module, datamodule=dm)
        logged = _read_metrics(Path(tmp) / "metrics.csv")
    share = ratios(cb.ref, cb.sink)
    emit("lightning tokens/s sinklab", f"{tokens / med(cb.sink):,.0f}",
         f"Trainer.fit incl. data loading and logging, median of {len(cb.sink)} steps, {med(cb.sink) * 1e3:.0f} ms/step")
    emit("lightning sinklab / reference speed", f"{med(share):.3f}x",
         f"full Lightning step vs the plain loop's step, interleaved; 95% CI {median_ci(share)}, IQR {spread(share)}")
    cols = {k: v for k, v in logged.items() if k.startswith("perf/")}
    emit("logged perf/*", ", ".join(f"{k} (median {med(v):.4g})" for k, v in cols.items()) or "none",
         f"metrics.csv of that fit (log_every_n_steps={tcfg.get('log_every_n_steps')}); its wall clock includes the "
         "interleaved reference step")


def _read_metrics(path: Path) -> dict[str, list[float]]:
    import csv

    out: dict[str, list[float]] = {}
    if not path.exists():
        return out
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None):
                    with contextlib.suppress(ValueError):
                        out.setdefault(k, []).append(float(v))
    return out


def compile_section(lit, mc, optim, cfg, eager: Run, steps: int, device, dtype, tokens, fpt: float) -> None:
    """torch.compile of sinklab's model through LitLM(model.compile=true), timed alternately with eager."""
    from sinklab.train.module import LitLM

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        litc = LitLM(model={**mc, "compile": True}, optim=optim, max_steps=cfg.trainer.max_steps).to(device)
        litc.net.load_state_dict(lit.net.state_dict())
        so = litc.configure_optimizers()
        comp = Run("compiled", litc.loss, litc.parameters(), so["optimizer"], so["lr_scheduler"]["scheduler"],
                   eager.batches, device, dtype)
        t0 = time.perf_counter()
        try:
            comp.step()
            comp.step()
        except Exception as err:
            emit("compile", "failed", f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}")
            return
        t_compile = time.perf_counter() - t0
    compiled = litc.model is not litc.net
    notes = "; ".join(dict.fromkeys(str(w.message).splitlines()[0][:160] for w in caught
                                    if "model.compile" in str(w.message)))  # sinklab's fallback warning, if any
    times = alternate([eager, comp], steps, warmup=1)
    speed = ratios(times["sinklab"], times["compiled"])
    emit("compile speed-up (eager time / compiled time)", f"{med(speed):.3f}x",
         f"{'torch.compile active' if compiled else 'fell back to eager'}; first two steps (compiling) {t_compile:.0f} s; "
         f"compiled {tokens / med(times['compiled']):,.0f} tokens/s; 95% CI {median_ci(speed)}, IQR {spread(speed)}"
         + (f"; warnings: {notes}" if notes else ""))
    sheet = datasheet_peak(device, dtype)
    if sheet is not None:
        emit("MFU compiled (datasheet)", f"{100 * fpt * tokens / med(times['compiled']) / sheet:.1f}% of "
             f"{sheet / 1e12:.1f} TFLOP/s", f"eager {100 * fpt * tokens / med(times['sinklab']) / sheet:.1f}% in the "
             f"same rounds; {torch.cuda.get_device_name(device)}'s dense {str(dtype).replace('torch.', '')} "
             "datasheet peak")


def metric_section(Ts: list[int], device: torch.device) -> None:
    """Runs scripts/bench_metric.py (a fresh subprocess per route and T, peak RSS above the pre-call RSS) from a
    small parent process: Linux carries ru_maxrss across fork + exec, so a worker forked straight from this
    (large) process would report this process's RSS as its peak."""
    import re
    import subprocess

    cmd = [sys.executable, str(REPO / "scripts" / "bench_metric.py"), "--T", *map(str, Ts)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the workers use --threads too
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        emit("metric", "failed", proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "")
        return
    if device.type != "cpu":
        emit("metric note", "on the CPU", "bench_metric.py measures host RSS; GPU memory is not measured here")
    peaks: dict[str, dict[int, float]] = {"efficient": {}, "materialise": {}}
    for line in proc.stdout.splitlines():
        m = re.match(r"T=\s*(\d+)\s+(efficient|materialise)\s+peak\s+([\d.]+) MB", line)
        if m:
            peaks[m.group(2)][int(m.group(1))] = float(m.group(3))
        print("metric " + line.strip(), flush=True)
    parts = []
    for route, mb in peaks.items():
        big = [T for T in sorted(mb) if T >= 1024]  # below, fixed costs dominate
        if len(big) >= 2:
            steps = [f"{math.log(mb[b] / mb[a]) / math.log(b / a):.2f}" for a, b in zip(big, big[1:])]
            overall = math.log(mb[big[-1]] / mb[big[0]]) / math.log(big[-1] / big[0])
            parts.append(f"{route} {overall:.2f} over T={big[0]}..{big[-1]} (steps {', '.join(steps)})")
    if parts:
        emit("metric memory growth exponent", "; ".join(parts),
             "d log(peak MB) / d log(T): 1 = linear, 2 = quadratic")


if __name__ == "__main__":
    sys.exit(main())
