"""The dense matmul FLOP/s that MFU is measured against (training's perf/mfu with peak_flops=auto, and
scripts/bench.py): the datasheet figure of a GPU that Lightning knows at the matmul dtype, else this machine's
measured limit; and the peak tensor memory of a training step (scripts/bench.py memory)."""
from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

# Lightning precision -> the dtype the matmuls of a training step run in (mixed precision: the autocast dtype)
PRECISION_DTYPES = {"64": torch.float64, "64-true": torch.float64, "32": torch.float32, "32-true": torch.float32,
                    "16": torch.float16, "16-mixed": torch.float16, "16-true": torch.float16,
                    "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}


# Dense 16-bit tensor-core FLOP/s where Lightning's table has none or a sparse figure: its H200 rows hold the
# datasheet's "with sparsity" numbers (1,979 TFLOP/s bf16 for the SXM part), and it matches an H200 only when the name
# says "sxm1" / "nvl1", while CUDA names the SXM part plain "NVIDIA H200". The H200 has the H100 SXM's tensor cores:
# dense bf16 / fp16 989.4 TFLOP/s (NVL: 835.5), half the sparse figures of NVIDIA's H200 datasheet.
DENSE_16BIT = {"h200 nvl": 835.5e12, "h200": 989.4e12}


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The datasheet's dense FLOP/s of `device` at `dtype`: `dense_16bit` where it knows the chip, else Lightning's
    table of accelerators (lightning.fabric.utilities.throughput.get_available_flops; its warning that it lacks a
    chip is silenced); None for a CPU and for a chip or dtype neither has, where the caller measures the peak."""
    from lightning.fabric.utilities.throughput import get_available_flops

    device = torch.device(device)
    if device.type != "cuda":
        return None
    known = dense_16bit(torch.cuda.get_device_name(device), dtype)
    if known is not None:
        return known
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FLOPs not found|.* does not support ")
        flops = get_available_flops(device, dtype)
    return None if flops is None else float(flops)


def dense_16bit(name: str, dtype: torch.dtype) -> Optional[float]:
    """DENSE_16BIT's FLOP/s for the GPU CUDA calls `name` at bf16 / fp16; None for other chips and dtypes."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    chip = name.lower()
    for key, flops in DENSE_16BIT.items():  # the most specific name first
        if all(word in chip for word in key.split()):
            return flops
    return None


def matmul_dtype(precision: Optional[str]) -> torch.dtype:
    """The dtype of a training step's matmuls under a Lightning precision (unknown ones: float32)."""
    return PRECISION_DTYPES.get(str(precision), torch.float32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_probe(n: int, device: torch.device, dtype: torch.dtype) -> Callable[..., float]:
    """A callable `run(reps=None)` that times `reps` (n x n) @ (n x n) products and returns their FLOP/s; by default
    as many as make >= ~0.1 s of work on a CPU (20 on a GPU). The operands come from a private generator (probing
    never moves the training RNG); one warm-up product runs here."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    default = max(1, int(2e10 // (2 * n ** 3))) if device.type == "cpu" else 20

    def run(reps: Optional[int] = None) -> float:
        reps = reps or default
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        return reps * 2 * n ** 3 / max(time.perf_counter() - t0, 1e-9)

    run(1)  # warm-up: thread pool / kernel selection
    return run


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.2,
                      max_n: Optional[int] = None) -> float:
    """Dense matmul FLOP/s of `device` at `dtype`, measured for about `seconds` (plus warm-up products).

    Square products of size n are timed in rounds of about seconds / 4. n goes from 256 up to max_n (1024 on a CPU,
    4096 on a GPU: large enough to run near the peak, small enough for several rounds), doubled while a product of
    the next size would take at most seconds / 4, so that a slow dtype (bf16 on a CPU without bf16 units) stays
    within the budget. The fastest round is returned: the peak is what the hardware can reach, and slower rounds
    are interruptions (other processes, clock ramp-up)."""
    device = torch.device(device)
    largest = max_n or (1024 if device.type == "cpu" else 4096)
    n = min(256, largest)
    while True:
        probe = matmul_probe(n, device, dtype)
        one = 2 * n ** 3 / probe(1)  # seconds per product
        if 2 * n > largest or 8 * one > seconds / 4:
            break
        n *= 2
    reps = max(1, int(seconds / 4 / one))
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        best = max(best, probe(reps))
    return best


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes of tensor memory `fn` holds at its worst moment, above what was allocated when it started. CUDA: the
    allocator's peak (max_memory_allocated). CPU, which keeps no such statistics: the allocator's running total that
    torch.profiler records with every allocation and free (profile_memory=True; the `[memory]` events of its Chrome
    trace), which counts what was allocated while profiling, so the baseline is the total before the first event."""
    device = torch.device(device)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - start
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]  # 0: the CPU
    if not events:
        return 0
    first = min(events, key=lambda e: e["ts"])["args"]
    return max(e["args"]["Total Allocated"] for e in events) - (first["Total Allocated"] - first["Bytes"])
