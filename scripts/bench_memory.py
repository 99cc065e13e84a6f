"""Peak training memory against the sequence length per attention operation, and its speed against the explicit
path (issue 17): `python scripts/bench.py --section memory [--memory-T 256 512 1024 2048 4096] [--threads 1]`.

For each operation, two paths of the same model (same weights, same tokens, batch 1):
  explicit  model.attn_backend=explicit, attn_memory=keep_maps: every op through its maps, each row chunk's map
            kept for backward (the reference, and what the non-softmax ops trained with before);
  new       model.attn_backend=sdpa, attn_memory=linear: softmax fused by SDPA, the others' row chunks recomputed
            in backward, kernel attention in its causal linear form;
  flex      model.attn_backend=flex (softmax variants only), where FlexAttention has a backward on the device.
One step is forward, cross-entropy, backward (the optimizer is the same for both and left out). Memory: the step's
peak tensor bytes above what was allocated before it (`sinklab.train.throughput.peak_memory`: torch.profiler's allocation events
on the CPU, the allocator's peak on CUDA), after a warm-up step has allocated the gradients. The growth exponent is
the least-squares slope of log(peak) on log(T), over every T and over the last doubling. Speed: steps of the two
paths alternate (`--memory-rounds` rounds at each T of --memory-speed-T); the figure is the median of the per-round
ratios explicit step time / new step time, so > 1 means the new path is faster.

Whole runs (`python scripts/bench.py --section run-memory [--run-memory-set OVERRIDE ...]`): the peak resident memory
of real `sinklab-train` processes at T = 2048 x batch 1 and T = 256 x batch 8 (the same tokens per step), each in a
fresh process (`os.wait4`'s ru_maxrss of the child: everything the run held at its worst moment, the allocator's
heap included, which the tensor figures above do not see), with the commands and their ratio.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

MODEL = dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, d_ff=176)
OPS = {  # name -> the model's attention overrides
    "softmax": {},
    "sink_logit": dict(sink_logit="learned"),
    "clipped_softmax": dict(attn_op="clipped_softmax"),
    "sigmoid": dict(attn_op="sigmoid"),
    "sigmoid_norm": dict(attn_op="sigmoid", attn_normalize=True),
    "elu": dict(attn_op="elu"),
    "relu": dict(attn_op="relu"),
    "softpick": dict(attn_op="softpick"),
    "kernel_elu_norm": dict(attn_op="kernel", kernel_map="elu", attn_normalize=True),
    "kernel_mlp": dict(attn_op="kernel", kernel_map="mlp"),
}
PATHS = {"explicit": dict(attn_backend="explicit", attn_memory="keep_maps"),
         "new": dict(attn_backend="sdpa", attn_memory="linear"),
         "flex": dict(attn_backend="flex", attn_memory="linear")}


def build(op: str, path: str, T: int, device: torch.device):
    from sinklab.model import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(**MODEL, block_size=T, **OPS[op], **PATHS[path])).to(device)


def what_runs(model) -> str:
    """The path the model's attention takes in training, in words."""
    attn, cfg = model.blocks[0].attn, model.cfg
    if cfg.can_fuse:
        return {"sdpa": "SDPA", "flex": "FlexAttention"}[cfg.backend] if cfg.attn_op == "softmax" else "linear form"
    return "maps recomputed in backward" if attn.recompute else "maps kept for backward"


def train_step(model, idx: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    return step


def slope(Ts: list[int], peaks: list[float]) -> float:
    """Least-squares slope of log(peak) on log(T)."""
    x, y = [math.log(t) for t in Ts], [math.log(max(p, 1.0)) for p in peaks]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def run(emit, timer, Ts: list[int], speed_Ts: list[int], rounds: int, device: torch.device, ops: list[str]) -> None:
    """Prints the figures through `emit(name, value, detail)`; `timer(fn)` times one call (bench.Timer)."""
    from sinklab.model import backends
    from sinklab.train.throughput import peak_memory

    t_start = time.perf_counter()
    flex_ok = backends.flex_attention is not None and backends.flex_trains_on(device.type)
    emit("memory setup", f"{MODEL['n_layer']} layers x {MODEL['n_head']} heads, d_model {MODEL['d_model']}, batch 1, "
         f"T = {', '.join(map(str, Ts))}", f"{torch.get_num_threads()} threads; peak tensor bytes of forward + "
         "backward above the allocation before the step; explicit = attn_backend=explicit attn_memory=keep_maps, "
         "new = attn_backend=sdpa attn_memory=linear" + ("; flex = attn_backend=flex" if flex_ok else
                                                         "; flex not measured: no FlexAttention backward here"))
    for op in ops:
        paths = ["explicit", "new"] + (["flex"] if flex_ok and "attn_op" not in OPS[op] else [])
        peaks: dict[str, list[float]] = {p: [] for p in paths}
        ratios: dict[int, list[float]] = {}
        runs = ""
        for T in Ts:
            idx = torch.randint(0, MODEL["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(0))
            idx = idx.to(device)
            steps = {}
            for path in paths:
                model = build(op, path, T, device)
                steps[path] = train_step(model, idx)
                if T == Ts[-1]:
                    runs += f"{path}: {what_runs(model)}; "
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's note that eager flex is unfused
                    steps[path]()  # warm-up: gradients allocated, kernels chosen
                    peaks[path].append(peak_memory(steps[path], device) / 2 ** 20)
            if T in speed_Ts:
                ratios[T] = alternate(timer, steps["explicit"], steps["new"], rounds)
        for path in paths:
            emit(f"memory {op} {path}", f"exponent {slope(Ts, peaks[path]):.2f}",
                 f"last doubling {math.log2(peaks[path][-1] / peaks[path][-2]):.2f}; peak MiB "
                 + ", ".join(f"T={T}: {p:,.1f}" for T, p in zip(Ts, peaks[path])) if len(Ts) > 1 else "")
        speed = "; ".join(f"T={T}: {statistics.median(r):.2f}x ({len(r)} rounds, {min(r):.2f}..{max(r):.2f})"
                          for T, r in ratios.items())
        emit(f"memory {op} speed new / explicit", speed or "not timed", runs.rstrip("; "))
    emit("memory total", f"{time.perf_counter() - t_start:.0f} s")


def alternate(timer, explicit: Callable[[], None], new: Callable[[], None], rounds: int) -> list[float]:
    """Per-round explicit step time / new step time, the two alternating (ABBA)."""
    out = []
    for i in range(rounds):
        if i % 2:
            b, a = timer(new), timer(explicit)
        else:
            a, b = timer(explicit), timer(new)
        out.append(a / b)
    return out


# the whole-run figure: model=tiny (4 layers x 4 heads, d 128) with sigmoid attention, 4 steps with a validation and
# a sink measurement every 2; T x batch pairs with the same tokens per step
RUN = ("model=tiny", "model/attn=sigmoid", "model.attn_memory=linear", "trainer.max_steps=4",
       "trainer.val_check_interval=2", "callbacks.sink.every_n_steps=2", "trainer.enable_progress_bar=false")
RUN_SHAPES = ((2048, 1), (256, 8))


def run_command(T: int, batch: int, out_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    train = shutil.which("sinklab-train") or os.path.join(os.path.dirname(sys.executable), "sinklab-train")
    return [train, *RUN, f"model.block_size={T}", f"data.batch_size={batch}", *extra, f"hydra.run.dir={out_dir}"]


def peak_rss_mib(command: list[str]) -> float:
    """Peak resident memory of a command run in a fresh child process (MiB), from os.wait4's rusage."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    proc.stderr.close()
    if status:
        raise RuntimeError(f"{' '.join(command)} failed:\n{err[-2000:]}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def whole_run(emit, extra: tuple[str, ...] = ()) -> float:
    """Emits the peak RSS of whole training runs at each of RUN_SHAPES and their ratio; returns the ratio."""
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for T, batch in RUN_SHAPES:
            command = run_command(T, batch, os.path.join(tmp, f"T{T}"), extra)
            peaks[T, batch] = peak_rss_mib(command)
            emit(f"run memory T={T} x batch {batch}", f"peak RSS {peaks[T, batch]:,.0f} MiB",
                 " ".join(["sinklab-train", *command[1:-1]]))
    (long, short) = (peaks[shape] for shape in RUN_SHAPES)
    emit("run memory ratio", f"{long / short:.2f}", f"peak RSS T={RUN_SHAPES[0][0]} x batch {RUN_SHAPES[0][1]} / "
         f"T={RUN_SHAPES[1][0]} x batch {RUN_SHAPES[1][1]} (same tokens per step)")
    return long / short
