"""`sinklab eval SUBCOMMAND`: evaluations of a checkpoint, a run dir or a transformers model."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "streaming": ("sinklab.evals.streaming", "perplexity over a long text with a KV cache of x first + y recent tokens"),
    "intervene": ("sinklab.evals.intervene", "perplexity and Sink_1 after zeroing massive channels / masking keys"),
    "quant": ("sinklab.quant.cli", "perplexity with simulated W8A8 / W4A4 / W8A16 quantization (= sinklab quant)"),
}


def usage() -> str:
    lines = ["usage: sinklab eval SUBCOMMAND [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    return "\n".join(lines + ["", "`sinklab eval SUBCOMMAND --help` for its options"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"sinklab eval: unknown subcommand {argv[0]!r}; allowed: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:]) or 0)
