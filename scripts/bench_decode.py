#!/usr/bin/env python
"""Decoding with the KV cache against recomputing the prefix for every new token, and the streaming evaluation's
time for a long text.

    python scripts/bench_decode.py [--new-tokens 512] [--rounds 3] [--stream-tokens 10000] [--threads 1]
                                   [--skip-stream] [--device cpu|cuda]

Model: the CPU recipe's width and depth (scale=cpu: 4 layers of 8 heads, d 128, FFN 352, vocab 1024), random
weights (the work does not depend on their values), with block_size 1024 for the decoding figure (so that 512 new
tokens stay inside the context and the cache never evicts) and the recipe's 64 for the streaming one.

decode: `sinklab.evals.sampling.generate` from a 1-token prompt, greedy, `--new-tokens` tokens: cached (one forward of
one token per step) and recomputed (a forward over the whole prefix per step, the LM head on the last position
only, as nanoGPT's generate). Rounds alternate the two (ABBA) in the same process; the ratio is the median of the
per-round ratios (recompute time / cached time), printed with its min and max. The issue's goal is >= 5x.
stream: `sinklab.evals.streaming_ppl` over `--stream-tokens` random ids, one setting per line: x=4 y=60 (the recipe's
whole context), dense (no eviction) and the recompute baseline (context 64, 32 windows per forward).
Prints one line per figure (`name: value  (details)`); see docs/performance.md. Not part of the unit tests.
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

from sinklab.evals import streaming_ppl as pp  # noqa: E402
from sinklab.evals.sampling import generate  # noqa: E402
from sinklab.model import ModelConfig, Transformer  # noqa: E402

RECIPE = dict(vocab_size=1024, n_layer=4, n_head=8, d_model=128, d_ff=352)  # scale=cpu's model (conf/scale/cpu.yaml)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_decode(args, device: torch.device) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**RECIPE, block_size=max(1024, args.new_tokens + 1))).to(device).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    same = torch.equal(generate(model, prompt, 32, cached=True), generate(model, prompt, 32, cached=False))
    cached, recomputed, ratios = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)  # ABBA
        times = {c: timed(lambda c=c: generate(model, prompt, args.new_tokens, cached=c)) for c in order}
        cached.append(times[True])
        recomputed.append(times[False])
        ratios.append(times[False] / times[True])
    n = args.new_tokens
    print(f"decode cached tokens/s: {n / statistics.median(cached):,.0f}  (median of {args.rounds} rounds, "
          f"{statistics.median(cached):.2f} s for {n} tokens)")
    print(f"decode recompute tokens/s: {n / statistics.median(recomputed):,.0f}  "
          f"({statistics.median(recomputed):.2f} s for {n} tokens)")
    print(f"decode speed-up cached / recompute: {statistics.median(ratios):.2f}x  (per-round min "
          f"{min(ratios):.2f}x, max {max(ratios):.2f}x; goal >= 5x; greedy tokens equal: {same})")


def bench_stream(args, device: torch.device) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**RECIPE, block_size=64)).to(device).eval()
    tokens = torch.randint(0, RECIPE["vocab_size"], (args.stream_tokens,), device=device)
    n = args.stream_tokens
    runs = {"x=4 y=60": lambda: pp.stream_nll(pp.sinklab_step(model, pp.streaming_cache(model, 4, 60)), tokens),
            "dense": lambda: pp.stream_nll(pp.sinklab_step(model, model.new_cache()), tokens),
            "recompute 64": lambda: pp.recompute_nll(pp.sinklab_logits(model), tokens, 64)}
    for name, fn in runs.items():
        with torch.no_grad():
            seconds = timed(fn)
        print(f"stream {name} seconds: {seconds:.1f}  ({n:,} tokens, {n / seconds:,.0f} tokens/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"threads: {torch.get_num_threads()}  device: {device}  torch {torch.__version__}")
    bench_decode(args, device)
    if not args.skip_stream:
        bench_stream(args, device)


if __name__ == "__main__":
    main()
