"""sinklab measure: the attention-sink metric (Gu et al., ICLR 2025) and activation statistics of one model.

    sinklab measure RUN_DIR_OR_CKPT [--tokens FILE.npy | --input natural|random|repeat] [--eps E ...] [--json]
    sinklab measure --hf-model NAME_OR_DIR [--revision R] [--dtype D] (--tokens FILE.npy | --input INPUT) [--json]
    sinklab measure --hf-model A B C --input natural random repeat [--csv T.csv] [--markdown T.md]   (the table)
    sinklab measure --eps 0.3 0.5 RUN_DIR_OR_CKPT ...                   (TARGET may follow --eps's values)
    python -m sinklab measure ...                                       (the same)

Inputs: ``natural`` (default for a training run) is the run's probe set, read through the data config saved in
``RUN_DIR/.hydra/config.yaml``; ``random`` draws uniform token ids (seeded); ``repeat`` repeats one random token
T times per sequence (the paper's Table 1); ``--tokens`` measures exactly the sequences of an int .npy (N, T).
For a transformers model, ``natural`` is text (``--text FILE ...``, default the validation plays of sinklab's
Shakespeare corpus) through the model's own tokenizer, in consecutive pieces of T tokens, each starting with the
special tokens its tokenizer puts first (LLaMA's BOS, nothing for GPT-2); random and repeat ids have none.

--hf-model takes a local dir or a hub id (``--revision`` a branch, tag or commit), loaded in ``--dtype`` (auto:
bfloat16 on CUDA): `sinklab.targets.hub_models`; or a GGUF file, dequantized (`sinklab.targets.gguf`). Several
models and/or several inputs make one table in the layout of the paper's Table 1, with its numbers beside ours
(`sinklab.analysis.model_table`); --csv and --markdown write it; --json prints {models, inputs, eps, rows: [{model,
revision, input, sink1, paper_sink1, alpha1, first_token_attn, massive_ratio, massive_top, slot_sink_logit, seq_len,
num_seqs, dtype, weights_note, seconds}], written, seconds}.

What is measured and how: `sinklab.analysis.measurement`. User errors are one line on stderr and exit code 2.

--json prints one object (sink values in percent, alpha in [0, 1] for row-normalised ops):
    target, source ("sinklab" | "hf"), weights_note (a GGUF's quantization, dequantized; only then), input
    ("natural" | "random" | "repeat" | "tokens"), tokens_file (with --tokens), seed, seq_len, num_seqs, model {...},
    eps [e1, ...], k, row_normalised, seconds,
    sink {"1": Sink_1 at e1, ..., "k": ...}, sink_by_eps {"<e>": {"1": ...}} for every eps,
    sink_star, sink_star_by_eps (Sink*: the metric on |A| / sum |A|; always present, equal to sink and
        sink_by_eps for row-normalised ops), alpha_star (only when rows do not sum to one),
    alpha [[alpha_1 per head] per layer] (mean over sequences), alpha_mean {"1": mean alpha_1, ...},
    sink1_by_layer [Sink_1 per layer at e1],
    slot {"bias" | "token0" ...: rate at e1}, slot_by_eps, slot_alpha {name: [[score per head] per layer]}
        (the K/KV bias slot and learned sink tokens, scored apart from token 1; slot_star* when not normalised),
    massive {top, median, ratio, token, channel: per-layer lists}, norms {h1_norm_ratio, k1_norm_ratio,
        v1_norm_ratio, cos_q_k1, cos_q_kj: per-layer lists; for HF models the last four only when
        `sinklab.targets.transformers_recorder.project_qkv` knows the attention layout (LLaMA, Mistral, GPT-2, GPT-NeoX, ...)},
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
    secondary_sinks {eps, min_queries, scored_positions, secondary_sink_heads, sink_positions, first_layer,
        last_layer, by_layer, by_head, positions [{"k": {share, alpha}} per layer]}: sinks at any position
        (sinklab.metrics.secondary_sinks),
    noop {value_drain_ratio, sink_query_share, sink_output_ratio, ..., by_layer}: the no-op signature
        (sinklab.metrics.noop),
    heads {eps, span, types, by_type {<type>: {heads, alpha1, sink1, sink_share, qk_max_partial_cycle,
        qk_max_full_cycle, qk_max_unrotated, pairs, q_pair_max, k_pair_max}}, by_layer, by_head}: alpha_1, Sink_1,
        the share of the sink heads and the q / k rotary pair maxima by head type, for sinklab models only
        (sinklab.metrics.heads),
    induction {seq_len, repeat, num_seqs, seed, induction, prev_token, by_layer, by_head, by_type}: induction and
        previous-token scores on repeated random tokens, by_type for sinklab models (sinklab.metrics.induction),
    sparse {eps, k, sink_vis, alpha_vis, alpha1_vis_uniform, visible, select1, select1_uniform, select1_ratio,
        by_layer, by_head}: the sink metric on the keys each query can see (and a uniform head's alpha_1 there) and
        the selection of token 1, for sinklab models with a window or a sparse operation only (sinklab.metrics.sparse),
    and the part of any other registered metric (`sinklab.metrics.METRICS`) under its json_key.
Non-finite values (a norm ratio with T = 1) are null.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from sinklab.analysis import measurement as measure
from sinklab.analysis.probe_inputs import (DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, INPUTS, InputSpec, check_thresholds,
                                          positive)
from sinklab.cli.base import (OneLineParser, add_device_json_args, add_target_args, check_files, check_one_target,
                              command_main, pick_device)
from sinklab.errors import UserError
from sinklab.io import check_output_file
from sinklab.targets import TargetSpec, load_target

PROG = "sinklab measure"
SUMMARY = "sink and activation metrics of a checkpoint, run dir or transformers model"  # the line in `sinklab --help`


class _Parser(OneLineParser):
    """`sinklab measure`'s parser: one-line errors, and TARGET may follow --eps's values."""

    def parse_args(self, args=None, namespace=None):
        """--eps and --input take one or more values; a value after them that is not one of theirs is TARGET
        (argparse's nargs would swallow it): `--eps 0.3 0.5 RUN` is read as `RUN --eps 0.3 0.5`."""
        ns = super().parse_args(args, namespace)
        ns.eps = self._values(ns, "--eps", list(ns.eps), _number, "invalid float value")
        ns.eps = [float(e) for e in ns.eps]
        if ns.input is not None:
            ns.input = self._values(ns, "--input", list(ns.input), INPUTS.__contains__,
                                    f"invalid choice (choose from {', '.join(INPUTS)})")
        return ns

    def _values(self, ns, flag: str, values: list, valid, what: str) -> list:
        taken = []
        while values and valid(values[0]):
            taken.append(values.pop(0))
        if values:
            if ns.target is not None or ns.hf_model is not None or len(values) > 1 or not taken:
                self.error(f"argument {flag}: {what}: {values[0]!r}")
            ns.target = values[0]
        return taken


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Attention-sink metric (Sink_k, alpha_k, bias-slot / sink-token scores) "
                                        "and massive-activation statistics of a sinklab checkpoint or a local "
                                        "Hugging Face causal LM.")
    add_target_args(ap, "its probe set", "measure transformers causal LMs instead, one or more (LLaMA, Mistral, "
                    "Qwen, Gemma, OLMo, Phi, GPT-2, GPT-NeoX, OPT, gpt-oss, ...)", many=True)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tokens", metavar="FILE.npy", default=None,
                     help="measure exactly these sequences: an integer .npy of shape (N, T)")
    src.add_argument("--input", nargs="+", default=None, metavar="|".join(INPUTS),
                     help="natural: the run's probe set (default for runs; for --hf-model, text through the "
                          "model's tokenizer, see --text); random: uniform token ids; repeat: one random token "
                          "repeated T times per sequence; several: the model table")
    ap.add_argument("--text", nargs="+", metavar="FILE", default=None,
                    help="--hf-model with --input natural: UTF-8 text files to tokenize (default: the validation "
                         "plays of sinklab's Shakespeare corpus)")
    ap.add_argument("--csv", metavar="PATH", default=None, help="write the model table as CSV")
    ap.add_argument("--markdown", metavar="PATH", default=None, help="write the model table as markdown")
    ap.add_argument("--seq-len", type=int, default=None,
                    help=f"tokens per sequence T (default {DEFAULT_SEQ_LEN}, at most the model context)")
    ap.add_argument("--past-context", action="store_true",
                    help="allow --seq-len above the training context: a length-extrapolation measurement of a "
                         "sinklab checkpoint with relative positions (RoPE's tables extend, ALiBi / NoPE need none)")
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
def input_spec(args, kind: Optional[str]) -> InputSpec:
    """The input options as the library's `InputSpec` (one input kind of --input's list)."""
    return InputSpec(kind=kind, tokens_file=args.tokens, seq_len=args.seq_len, num_seqs=args.num_seqs, seed=args.seed,
                     texts=tuple(args.text) if args.text else None, past_context=args.past_context)


def run(args) -> dict:
    check_one_target(args)
    for flag, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs), ("--batch-size", args.batch_size)):
        positive(flag, value)
    check_thresholds(args.eps, args.k)
    for flag, path, suffix in (("--csv", args.csv, ".csv"), ("--markdown", args.markdown, ".md")):
        if path is not None:
            check_output_file(flag, path, (suffix,))
    if args.text and (args.hf_model is None or "natural" not in (args.input or [])):
        raise UserError("--text goes with --hf-model and --input natural (the text the model's tokenizer reads)")
    names = list(dict.fromkeys(args.hf_model)) if args.hf_model is not None else [args.target]
    inputs = list(dict.fromkeys(args.input)) if args.input else [None]
    if args.tokens is not None and len(names) > 1:
        raise UserError("--tokens holds ids of one vocabulary: measure one --hf-model with it, or use --input")
    check_inputs(args, inputs)
    device = pick_device(args.device)
    source = "hf" if args.hf_model is not None else "sinklab"
    specs = [TargetSpec(str(name), source, args.revision, args.dtype, device) for name in names]
    t0 = time.perf_counter()
    with torch.no_grad():
        if len(specs) == 1 and len(inputs) == 1 and args.csv is None and args.markdown is None:
            res = measure.measure_target(load_target(specs[0]), input_spec(args, inputs[0]), args.eps, args.k,
                                         args.batch_size)
        else:
            res = model_table(args, specs, inputs)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def check_inputs(args, inputs: list) -> None:
    """Before any model is loaded: the files named exist, and each input has what it reads (a run's probe set for
    natural, by default for a run; a transformers model reads natural text through its tokenizer instead)."""
    from sinklab.runs.run_data import checkpoint_and_run_dir
    from sinklab.targets.interface import no_natural_input
    from sinklab.targets.native import no_run_config

    check_files(("--tokens", args.tokens), *(("--text", f) for f in args.text or []))
    if args.tokens is not None or args.hf_model is not None:
        return
    if checkpoint_and_run_dir(args.target)[1] is not None:
        return
    for kind in inputs:
        if kind in (None, "natural"):
            raise no_natural_input(kind, no_run_config(args.target))


def model_table(args, specs: list[TargetSpec], inputs: list) -> dict:
    """Every model on every input, each model loaded once (`sinklab.analysis.model_table`)."""
    from sinklab.analysis import model_table as mt

    records = []
    for spec in specs:
        t0 = time.perf_counter()
        target = load_target(spec)
        for kind in inputs:
            res = measure.measure_target(target, input_spec(args, kind), args.eps, args.k, args.batch_size)
            res["seconds"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            records.append(mt.row(res, mt.paper_sink1(spec.name)))
        del target
    res = {"models": [spec.name for spec in specs], "inputs": [r["input"] for r in records[:len(inputs)]],
           "eps": args.eps[0], "rows": records}
    res["written"] = mt.write(mt.wide(records), args.csv, args.markdown)
    return res


def format_text(res: dict) -> str:
    if "rows" in res:
        from sinklab.analysis.model_table import format_table

        return format_table(res)
    return measure.format_tables(res)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_text, argv)
