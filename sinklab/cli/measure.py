"""sinklab measure: the attention-sink metric (Gu et al., ICLR 2025) and activation statistics of one model.

    sinklab measure RUN_DIR_OR_CKPT [--tokens FILE.npy | --input natural|random|repeat] [--eps E ...] [--json]
    sinklab measure --hf-model DIR (--tokens FILE.npy | --input random|repeat) [--json]
    sinklab measure --eps 0.3 0.5 RUN_DIR_OR_CKPT ...                   (TARGET may follow --eps's values)
    python -m sinklab.measure ...                                       (the same)

Inputs: ``natural`` (default for a training run) is the run's probe set, read through the data config saved in
``RUN_DIR/.hydra/config.yaml``; ``random`` draws uniform token ids (seeded); ``repeat`` repeats one random token
T times per sequence (the paper's Table 1); ``--tokens`` measures exactly the sequences of an int .npy (N, T).

What is measured and how: `sinklab.measure`. User errors are one line on stderr and exit code 2.

--json prints one object (sink values in percent, alpha in [0, 1] for row-normalised ops):
    target, source ("sinklab" | "hf"), input ("natural" | "random" | "repeat" | "tokens"), tokens_file (with
    --tokens), seed, seq_len, num_seqs, model {...}, eps [e1, ...], k, row_normalised, seconds,
    sink {"1": Sink_1 at e1, ..., "k": ...}, sink_by_eps {"<e>": {"1": ...}} for every eps,
    sink_star, sink_star_by_eps (Sink*: the metric on |A| / sum |A|; always present, equal to sink and
        sink_by_eps for row-normalised ops), alpha_star (only when rows do not sum to one),
    alpha [[alpha_1 per head] per layer] (mean over sequences), alpha_mean {"1": mean alpha_1, ...},
    sink1_by_layer [Sink_1 per layer at e1],
    slot {"bias" | "token0" ...: rate at e1}, slot_by_eps, slot_alpha {name: [[score per head] per layer]}
        (the K/KV bias slot and learned sink tokens, scored apart from token 1; slot_star* when not normalised),
    massive {top, median, ratio, token, channel: per-layer lists}, norms {h1_norm_ratio, k1_norm_ratio,
        v1_norm_ratio, cos_q_k1, cos_q_kj: per-layer lists; for HF models the last four only when
        `sinklab.hf.project_qkv` knows the attention layout (LLaMA, Mistral, GPT-2, GPT-NeoX, ...)},
    first_token_attn {mean, by_layer}: Qwen's first-token attention, mean over queries of A[i, 1]; equal to
        alpha_mean["1"] and to alpha's per-layer means (it is alpha_1 under Qwen's name),
    outliers {resid_inf_norm, resid_kurtosis, attn_inf_norm, attn_kurtosis, attn_top_median: per-layer lists}
        (Bondarenko et al. 2023; the residual stream's top / median is massive.ratio),
    residual_sinks {h_avg [[mean |h_j| per channel] per layer], top, channel, ratio (per-layer lists: the top
        channel of h_avg, its index and its ratio to the median channel), channel_share (share of layers whose top
        channel is the most common one), attn_norm_min, ffn_norm_min (per layer), final_norm_min: min |weight|
        of each norm; the norm minima for sinklab checkpoints only} (see sinklab.metrics.outliers),
    gates {mean, low_share, first_token: over all layers; by_layer {mean, low_share, first_token: per-layer lists}}:
        the gate scores act(X W_theta) of a model with `model.gate` (Qwen's gated attention): their mean, the share
        below 0.1 and the mean on token 1, from the same forwards (sinklab.metrics.gates); {} without a gate,
    entropy {mean, by_layer, by_head}: attention entropy in nats (sinklab.metrics.entropy),
    and the part of any other registered metric (`sinklab.metrics.METRICS`) under its json_key.
Non-finite values (a norm ratio with T = 1) are null.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import torch

from sinklab import measure
from sinklab.cli.base import (OneLineParser, add_device_json_args, add_target_args, check_one_target, command_main,
                              pick_device)
from sinklab.probe_inputs import DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, INPUTS, check_measure_args

PROG = "sinklab measure"


class _Parser(OneLineParser):
    """`sinklab measure`'s parser: one-line errors, and TARGET may follow --eps's values."""

    def parse_args(self, args=None, namespace=None):
        """--eps takes one or more values; a value after them that is not a number is TARGET (argparse's nargs
        would swallow it): `--eps 0.3 0.5 RUN` is read as `RUN --eps 0.3 0.5`."""
        ns = super().parse_args(args, namespace)
        values = list(ns.eps)
        eps = []
        while values and _number(values[0]):
            eps.append(float(values.pop(0)))
        if values:
            if ns.target is not None or len(values) > 1 or not eps:
                self.error(f"argument --eps: invalid float value: {values[0]!r}")
            ns.target = values[0]
        ns.eps = eps
        return ns


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Attention-sink metric (Sink_k, alpha_k, bias-slot / sink-token scores) "
                                        "and massive-activation statistics of a sinklab checkpoint or a local "
                                        "Hugging Face causal LM.")
    add_target_args(ap, "its probe set",
                    "measure a local transformers causal-LM dir instead (LLaMA, Mistral, GPT-2, GPT-NeoX, ...)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tokens", metavar="FILE.npy", default=None,
                     help="measure exactly these sequences: an integer .npy of shape (N, T)")
    src.add_argument("--input", choices=INPUTS, default=None,
                     help="natural: the run's probe set (default for runs); random: uniform token ids; "
                          "repeat: one random token repeated T times per sequence")
    ap.add_argument("--seq-len", type=int, default=None,
                    help=f"tokens per sequence T (default {DEFAULT_SEQ_LEN}, at most the model context)")
    ap.add_argument("--num-seqs", type=int, default=None, help=f"number of sequences N (default {DEFAULT_NUM_SEQS})")
    ap.add_argument("--eps", nargs="+", default=["0.3"], metavar="EPS",
                    help="sink thresholds: head h of layer l is a sink on token k when alpha_k > eps (default 0.3); "
                         "several as --eps 0.3 0.5, before or after TARGET")
    ap.add_argument("--k", type=int, default=4, help="score the first k tokens (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random / repeat inputs (default 0)")
    ap.add_argument("--batch-size", type=int, default=25, help="sequences per forward (default 25)")
    add_device_json_args(ap, "print one JSON object instead of tables: sink, sink_star (Sink* on the renormalised map "
                         "|A| / sum |A|; equal to sink for row-normalised ops such as softmax), alpha, massive, "
                         "norms, seq_len, num_seqs, eps, ... (see the module docstring)")
    return ap


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_one_target(args)
    check_measure_args(args)
    device = pick_device(args.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        measure_target = measure.measure_hf if args.hf_model is not None else measure.measure_checkpoint
        res = measure_target(args, device)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, measure.format_tables, argv)


if __name__ == "__main__":
    sys.exit(main())
