"""`sinklab eval SUBCOMMAND`: evaluations of a checkpoint, a run dir or a transformers model."""
from __future__ import annotations

from typing import Optional, Sequence

from sinklab.cli.base import dispatch

SUBCOMMANDS = {
    "streaming": ("sinklab.cli.streaming", "perplexity over a long text with a KV cache of x first + y recent tokens"),
    "intervene": ("sinklab.cli.intervene", "perplexity and Sink_1 after zeroing massive channels / masking keys"),
    "quant": ("sinklab.cli.quant", "perplexity with simulated W8A8 / W4A4 / W8A16 quantization (= sinklab quant)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return dispatch("sinklab eval", SUBCOMMANDS, "`sinklab eval SUBCOMMAND --help` for its options", argv)
