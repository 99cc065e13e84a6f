"""The measurement behind `sinklab measure` (the command: `sinklab.cli.measure`, whose docstring gives the JSON): every
registered metric (`sinklab.metrics.METRICS`) of a model (a `sinklab.targets.Target` of any source) on the chosen token
ids, the result as one object, and its tables.

Each source records as it can: sinklab models through the exact query-chunked maps (memory linear in T), transformers
models through the eager attention maps per batch (`sinklab.targets.transformers_lm`).
"""
from __future__ import annotations

from typing import Any, Sequence

from sinklab.analysis.probe_inputs import InputSpec, choose_tokens
from sinklab.errors import UserError
from sinklab.metrics import METRICS
from sinklab.targets import Target
from sinklab.targets.interface import model_title


# ----------------------------------------------------------------------------------------------------- results
def build_result(metrics, meta: dict) -> dict:
    """The JSON object: `meta`, then each measured metric's part (`Metric.json`), in the registry's order."""
    res: dict[str, Any] = dict(meta)
    for metric in metrics:
        part = metric.json(metric.result())
        if metric.json_key is None:
            res.update(part)
        else:
            res[metric.json_key] = part
    return res


def measure_target(target: Target, inputs: InputSpec, eps: Sequence[float] = (0.3,), k: int = 4,
                   batch_size: int = 25) -> dict:
    """Every registered metric that applies to `target`, on the input `inputs` names (`choose_tokens`), as the
    object `sinklab measure --json` prints: the target's metadata, the input, then each metric's part."""
    tokens, kind, text = choose_tokens(inputs, target)
    check_k(k, tokens.shape[1])
    if inputs.past_context:
        with target.past_context(tokens.shape[1]):
            metrics = target.measure(tokens, eps=eps, k=k, batch_size=batch_size)
    else:
        metrics = target.measure(tokens, eps=eps, k=k, batch_size=batch_size)
    head: dict[str, Any] = target.describe()
    head.update({"input": kind, "seed": inputs.seed, "seq_len": int(tokens.shape[1]), "num_seqs": int(tokens.shape[0]),
                 "model": target.meta.model})
    if inputs.past_context:
        head["past_context"] = {"context": target.meta.context, "seq_len": int(tokens.shape[1])}
    if inputs.tokens_file is not None:
        head["tokens_file"] = str(inputs.tokens_file)
    if text is not None:
        head["text"] = text
    return build_result(metrics, head)


def check_k(k: int, T: int) -> None:
    if k < 1:
        raise UserError(f"--k {k} must be a positive integer")
    if k > T:
        raise UserError(f"--k {k} exceeds the sequence length T={T}; use --k <= {T}")


# ----------------------------------------------------------------------------------------------------- tables
def format_tables(res: dict) -> str:
    """`sinklab measure`'s text: what was measured on which input, then each registered metric's own lines
    (`Metric.text`, from its part of `res`) in the registry's order, a blank line before each."""
    normalised = res.get("row_normalised")
    rows = "" if normalised is None else "; rows sum to 1" if normalised else \
        "; rows do not sum to 1 (Sink* on |A| / sum |A|)"
    lines = [model_title(res),
             f"input {res['input']}: {res['num_seqs']} sequences x {res['seq_len']} tokens{rows}"]
    for metric in METRICS:
        part = metric.part(res)
        block = metric.text(part, res) if part is not None else []
        if block:
            lines += ["", *block]
    return "\n".join(lines)
