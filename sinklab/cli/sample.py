"""sinklab sample: generate text from a trained sinklab model, decoding with a KV cache.

    sinklab sample RUN_DIR_OR_CKPT --prompt TEXT [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--seed 0]
    sinklab sample CKPT --data RUN_DIR --prompt TEXT ...          (a bare checkpoint: the tokenizer of a run's data)
    sinklab sample RUN_DIR --prompt TEXT --policy h2o [--budget 32] [--knob recent=0.25]   (another cache policy)

The prompt is tokenised with the run's tokenizer (its data module's), after the BOS token when the run's data puts one
at position 1 (data.bos), prefilled in one forward, and then each new token is one forward of one token through the
cache. When prompt + new tokens exceed the context (model.block_size), the cache evicts as StreamingLLM does (Xiao et
al. 2024, arXiv 2309.17453): it keeps the first 4 tokens and the most recent ones, at most block_size in all,
positions re-indexed inside the cache (`sinklab.evals.sampling.generate`). The paper keeps 4 initial tokens
too; that the cache never holds more than block_size positions, so that every position stays inside the trained
range, is decided here. --policy evicts by another cache policy of `sinklab.model.cache_policies` (H2O, SnapKV, ...)
with --budget text keys kept between steps (default the context - 1). Sampling covers the tokenizer's ids only (the padded rows of the embedding are never drawn).
--temperature 0 is greedy decoding. --json prints one object: target, prompt, prompt_tokens, tokens (the new ids),
text (the new text), bos, temperature, top_k, seed, evicted (whether the cache dropped tokens), keep_first (null
with --policy), policy (null, or the policy and its knobs), seconds, tokens_per_s. User errors are one line on stderr and exit code 2. Decoding: `sinklab.evals.sampling`.
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch

from sinklab.cli.base import (OneLineParser, add_device_json_args, command_main, data_run_dir, knob_value,
                              pick_device)
from sinklab.errors import UserError
from sinklab.evals.sampling import KEEP_FIRST, generate
from sinklab.analysis.probe_inputs import positive
from sinklab.runs.run_data import checkpoint_and_run_dir, read_run_data

PROG = "sinklab sample"
SUMMARY = "generate text from a trained model with a KV cache"  # the line in `sinklab --help`


def build_parser() -> OneLineParser:
    from sinklab.model.cache_policies import CACHE_POLICIES

    ap = OneLineParser(prog=PROG, description="Generate text from a sinklab checkpoint with a KV cache: the prompt in "
                                              "one forward, then one token per step. Past the context "
                                              "(model.block_size) the cache evicts as StreamingLLM: it keeps the first "
                                              f"{KEEP_FIRST} tokens and the most recent ones (block_size in all), "
                                              "positions re-indexed inside the cache.")
    ap.add_argument("target", help="a sinklab .ckpt or a run dir (uses its checkpoints/last.ckpt and its tokenizer)")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    ap.add_argument("--data", metavar="RUN_DIR", default=None,
                    help="tokenize with this run's data config (default: TARGET's run dir)")
    ap.add_argument("--policy", default=None, metavar="NAME",
                    help=f"evict by this cache policy, of: {CACHE_POLICIES.allowed()} (sinklab.model.cache_policies), "
                         f"instead of StreamingLLM's first {KEEP_FIRST} + recent")
    ap.add_argument("--budget", type=int, default=None,
                    help="with --policy: text keys kept between steps (default: the context - 1)")
    ap.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE",
                    help="with --policy: one of its knobs, e.g. recent=0.25 for h2o (repeatable)")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- main
def read_tokenizer(args, run_dir) -> tuple[object, bool, int]:
    """(the run's tokenizer, whether its data starts with BOS, the BOS id)."""
    run, flag = data_run_dir(args, run_dir, hint="pass --data RUN_DIR (a run dir whose data config has the tokenizer)")
    return read_run_data(run, {"num_workers": 0}, lambda dm: (dm.tokenizer, bool(dm.config.bos), int(dm.eos_id)),
                         flag, "the tokenizer", "pass --data RUN_DIR of a run with an LMDataModule")


def sample_policy(args, context: int):
    """--policy NAME [--budget N] [--knob K=V ...] -> the cache policy (None: StreamingLLM's default)."""
    from sinklab.model.cache_policies import build

    if args.policy is None:
        if args.budget is not None or args.knob:
            raise UserError("--budget / --knob go with --policy NAME")
        return None
    knobs = {}
    for item in args.knob:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--knob {item}: allowed: KNOB=VALUE, e.g. recent=0.25")
        knobs[key] = knob_value("--knob", item, value)
    policy = build(args.policy, args.budget or context - 1, **knobs)  # a policy that never evicts takes None
    policy.check(context)
    return policy


def run(args) -> dict:
    from sinklab.runs.checkpoints import load_model
    from sinklab.data.tokenizer import tokenizer_size

    positive("--max-new-tokens", args.max_new_tokens)
    positive("--top-k", args.top_k)
    if not args.temperature >= 0:
        raise UserError(f"--temperature {args.temperature:g}: allowed: >= 0 (0 is greedy)")
    device = pick_device(args.device)
    ckpt, run_dir = checkpoint_and_run_dir(args.target)
    tok, bos, bos_id = read_tokenizer(args, run_dir)
    model = load_model(ckpt).to(device)
    cfg = model.cfg
    if cfg.block_size < 3:
        raise UserError(f"model.block_size={cfg.block_size}: a streaming cache needs a context of at least 3")
    ids = ([bos_id] if bos else []) + tok.encode(args.prompt).ids
    if not ids:
        raise UserError("--prompt '' has no tokens (and the run's data has no BOS token to start from); give a text")
    if max(ids) >= cfg.vocab_size:
        raise UserError(f"--prompt: token id {max(ids)} is outside the model's vocabulary [0, {cfg.vocab_size - 1}] "
                        "(was the model trained with this tokenizer?)")
    if cfg.prefix_len and len(ids) < cfg.prefix_len:
        raise UserError(f"--prompt has {len(ids)} tokens; model.prefix_len={cfg.prefix_len} (a prefix LM) needs a "
                        f"prompt of at least {cfg.prefix_len} tokens")
    policy = sample_policy(args, cfg.block_size)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    out = generate(model, torch.tensor([ids], device=device), args.max_new_tokens, args.temperature, args.top_k,
                   generator, allowed=tokenizer_size(tok), policy=policy)
    seconds = time.perf_counter() - t0
    new = out[0].tolist()
    return {"target": str(ckpt), "prompt": args.prompt, "prompt_tokens": ids, "tokens": new, "text": tok.decode(new),
            "bos": bos, "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed,
            "evicted": len(ids) + len(new) - 1 > (cfg.block_size if policy is None else policy.budget or math.inf),
            "keep_first": min(KEEP_FIRST, cfg.block_size - 2) if policy is None else None,
            "policy": None if policy is None else policy.describe(),
            "seconds": round(seconds, 3), "tokens_per_s": round(len(new) / seconds, 1)}


def format_text(res: dict) -> str:
    """The prompt and its continuation, as one text."""
    return res["prompt"] + res["text"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_text, argv)
