#!/usr/bin/env python
"""A cache policy's decoding step against the length of the text read so far, at a fixed budget: the step attends
to the budget's keys, so its time stays flat while a dense cache's grows with the context.

    python scripts/bench_cache_policies.py [--budget 32] [--lengths 512,4096,16384] [--steps 64] [--threads 1]
                                           [--policies dense,streaming,h2o,...]

Model: the CPU recipe's width and depth (scale=cpu: 4 layers of 8 heads, d 128, FFN 352, vocab 1024, RoPE), random
weights (the work does not depend on their values), context 64: past it only an evicting cache (positions re-indexed
inside it) or a dense one with RoPE reads on. For each policy and length n, the cache is filled with n random tokens
(in one forward for dense, in forwards of `--budget` tokens otherwise, each evicting back to the budget), then
`--steps` more single-token steps are timed; the figure is the lower quartile of the steps in ms (on a shared
machine a step preempted by another process is an outlier above). Each line prints the policy's steps
at every length and the ratio of the longest to the shortest (flat: ~1.0x; dense grows). Lengths and policies
alternate in the same process, so machine load affects them alike. The default policies: every registered one
whose layers and heads keep as many keys (`CachePolicy.uniform`). Not part of the unit tests; see
docs/performance.md.
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
from sinklab.model.cache_policies import CACHE_POLICIES, build  # noqa: E402

RECIPE = dict(vocab_size=1024, n_layer=4, n_head=8, d_model=128, d_ff=352, block_size=64)


@torch.no_grad()
def step_ms(model: Transformer, policy_name: str, budget: int, n: int, steps: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, RECIPE["vocab_size"], (1, n + steps), generator=g)
    policy = build(policy_name, budget)  # a policy that never evicts takes None
    cache = model.new_cache(policy=policy)
    if policy.capacity(0, model.cfg.n_layer) is None:  # it keeps every key: read past the context in one forward
        model.past_context = True
        model(tokens[:, :n], cache=cache)
    else:  # chunks of `budget` tokens, each forward evicting back to the budget (the step timed is the same)
        for t in range(0, n, budget):
            model(tokens[:, t:min(t + budget, n)], cache=cache)
    times = []
    for t in range(n, n + steps):
        t0 = time.perf_counter()
        model(tokens[:, t:t + 1], cache=cache)
        times.append(time.perf_counter() - t0)
    model.past_context = False
    return 1e3 * statistics.quantiles(times, n=4)[0]  # the lower quartile: a step preempted by another job drops out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", default=",".join(c.name for c in CACHE_POLICIES if c.uniform()))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**RECIPE)).eval()
    lengths = [int(v) for v in args.lengths.split(",")]
    policies = args.policies.split(",")
    res = {p: {} for p in policies}
    for n in lengths:  # every policy at one length, then the next: load drifts over all alike
        for p in policies:
            res[p][n] = step_ms(model, p, args.budget, n, args.steps, seed=n)
    print(f"decoding step (lower quartile, ms, of {args.steps} steps), budget {args.budget} keys, scale=cpu model, "
          f"{args.threads} thread(s)")
    for p in policies:
        steps = "  ".join(f"n={n}: {res[p][n]:.3f}" for n in lengths)
        print(f"{p:>10}: {steps}   longest / shortest {res[p][lengths[-1]] / res[p][lengths[0]]:.2f}x")


if __name__ == "__main__":
    main()
