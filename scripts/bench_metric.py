#!/usr/bin/env python
"""Peak memory and time of the sink metric: the efficient exact route (`attention_scores`, query chunks, memory
linear in T) against materialising every attention map (`brute_force_alpha`, memory quadratic in T).

    python scripts/bench_metric.py [--T 64 1024 4096 8192] [--batch 1] [--limit-gb 8]

Method: each (route, T) runs in a fresh subprocess (so earlier runs cannot lend it their peak); it builds the
model and tokens, reads its current RSS (/proc/self/statm), runs the route twice under torch.no_grad(), then reads
its peak RSS (getrusage ru_maxrss). Peak memory = peak RSS - RSS before the calls, i.e. everything the route
allocated at its worst moment (tensors, allocator overhead), which torch's CPU allocator hides from tracemalloc.
Time = wall clock of the second call (the first warms up kernels and the allocator). The materialising route is
skipped where its estimated peak, (2 L + 3) * B * H * T^2 * 4 bytes, exceeds --limit-gb. Both routes' alpha
(N, L, H, k) are compared, so the figures are for equal results.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MODEL = dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, d_ff=176, block_size=8192)
K = 4


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(route: str, T: int, batch: int) -> None:
    import torch

    from sinklab.metrics import attention_scores, brute_force_alpha
    from sinklab.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).eval()
    tokens = torch.randint(0, MODEL["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(0))
    fn = (lambda: attention_scores(model, tokens, k=K)) if route == "efficient" else \
        (lambda: brute_force_alpha(model, tokens, k=K))
    before, peak_before = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        fn()
        t0 = time.perf_counter()
        scores = fn()
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"route": route, "T": T, "rss_before_kb": before, "peak_before_kb": peak_before,
                      "peak_kb": peak, "seconds": seconds, "alpha": scores.alpha.tolist(),
                      "threads": torch.get_num_threads()}))


def run_worker(route: str, T: int, batch: int) -> dict:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, __file__, "--worker", route, str(T), str(batch)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"worker {route} T={T} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[64, 1024, 4096, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--worker", nargs=3, metavar=("ROUTE", "T", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0
    L, H, B = MODEL["n_layer"], MODEL["n_head"], args.batch
    print(f"model: {L} layers, {H} heads, d_model {MODEL['d_model']}, block_size {MODEL['block_size']}; "
          f"batch {B}; k={K}")
    print("memory: peak RSS (getrusage ru_maxrss) minus RSS just before the calls, fresh subprocess per figure; "
          "time: wall clock of the 2nd of two calls")
    t_start = time.perf_counter()
    for T in args.T:
        eff = run_worker("efficient", T, B)
        eff_mb = (eff["peak_kb"] - eff["rss_before_kb"]) / 1024
        print(f"T={T:5d}  efficient    peak {eff_mb:9.1f} MB  time {eff['seconds']:8.3f} s"
              + ("  (below the process's earlier peak: an upper bound)" if eff["peak_kb"] == eff["peak_before_kb"]
                 else ""), flush=True)
        est_gb = (2 * L + 3) * B * H * T * T * 4 / 1e9
        if est_gb > args.limit_gb:
            print(f"T={T:5d}  materialise  skipped: estimated peak {est_gb:.1f} GB > --limit-gb {args.limit_gb:g}")
            continue
        mat = run_worker("materialise", T, B)
        mat_mb = (mat["peak_kb"] - mat["rss_before_kb"]) / 1024
        import numpy as np

        diff = float(np.abs(np.array(eff["alpha"]) - np.array(mat["alpha"])).max())
        print(f"T={T:5d}  materialise  peak {mat_mb:9.1f} MB  time {mat['seconds']:8.3f} s"
              + ("  (below the process's earlier peak: an upper bound)" if mat["peak_kb"] == mat["peak_before_kb"]
                 else ""))
        print(f"T={T:5d}  ratio materialise / efficient: memory x{mat_mb / max(eff_mb, 1e-3):.1f}, "
              f"time x{mat['seconds'] / max(eff['seconds'], 1e-9):.2f}; max |alpha difference| {diff:.1e}",
              flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s; torch threads {eff['threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
