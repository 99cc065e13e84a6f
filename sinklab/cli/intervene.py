"""sinklab eval intervene: what the sink does, by intervention. Validation perplexity and Sink_1 of a trained model,
unchanged and under each of:

    zero         the massive activations set to zero                        (Sun et al. 2024, "Massive Activations
    mean         the massive activations set to their mean over the probe set  in Large Language Models", sec. 3)
    mask_first   every query q > 1 no longer sees the first token's key; attention renormalises over the rest
    mask_random  the control: every query q >= 3 no longer sees one random earlier key (not token 1, not itself)

    sinklab eval intervene RUN_DIR_OR_CKPT [--interventions zero mean mask_first mask_random] [--channels 2]
                                            [--val-batches N] [--json]
    sinklab eval intervene --hf-model NAME_OR_DIR (--data RUN_DIR | --tokens FILE.npy) [--revision R] [--dtype D]
    sinklab eval intervene --sweep SWEEP_DIR [--jobs 0 1 ...] [options]   (every finished job of a sweep, one CSV)

A transformers model has no run: --data RUN_DIR takes that run's validation blocks and probe set (a model exported
from it with `sinklab export-hf`, or one with the same tokenizer), --tokens FILE.npy (N, T) sequences that are the
validation set and, their first 100, the probe set. Its interventions: `sinklab.targets.transformers_masking`.

The massive activations: on the run's probe set, mean |h| of every (token position, channel) of each layer's
residual stream (the block output, real tokens); the layer is the first whose largest mean entry reaches half the
largest over layers ("where they appear": Sun et al. intervene there), the position is that entry's token t*, and
the channels are the --channels largest mean |h| at t* in that layer. `zero` / `mean` write 0 / the probe set's mean
signed value into h[t*, channels] at that layer's output, for every sequence (Sun et al. set the activations to
zero or to their mean over many sequences). Decided here: one position (theirs are the starting token and a
delimiter), and the top channels by a fixed count (theirs are the two or so that stand out by ~1000x; at sinklab's
scale the ratio is reported, not thresholded).

Masking: a mask function composed with the model's own (`sinklab.model.masks`), so every attention operation and
path sees it; softmax renormalises over the remaining keys, an operation without row normalisation just loses the
key. Query 1 keeps its only key. Learned sink tokens and a K / KV bias slot are not masked: "the first token" is
the first token of the text. Sink_1 under mask_first is near 0 by construction (only query 1 attends to token 1);
it is reported to show where the attention went (alpha_1 of the other rows is 0).

Validation: the run's validation blocks, with the BOS token at position 1 if its training blocks have one
(data.bos), so that token 1 is what the model always saw there (its probe set has it too, data.probe_bos).

--json prints one object: target, val_batches, val_targets, probe (num_seqs, seq_len), massive {layer (from 0, as
in every output), token (from 1), channels, values (mean |h|), mean_values (signed), ratio (top mean |h| / median |h|)}, seconds,
and rows {name: {ppl, loss, dppl (ppl - the unchanged model's), sink1, alpha1, sink1_star (operations without row
normalisation)}}. --sweep SWEEP_DIR writes that object into JOB/intervene.json for every finished job, then
SWEEP_DIR/intervene.csv, one row per job (its columns: `sinklab.evals.interventions.Interventions`). User errors are
one line on stderr and exit code 2. The interventions and their evaluation: `sinklab.evals.interventions`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from sinklab.cli.base import (OneLineParser, add_device_json_args, add_sweep_args, add_target_args, check_data_args,
                              check_one_target, command_main, data_run_dir, load_checked_target)
from sinklab.errors import UserError
from sinklab.evals.interventions import INTERVENTIONS, evaluate, find_massive
from sinklab.analysis.probe_inputs import DEFAULT_NUM_SEQS, load_tokens, positive
from sinklab.runs.run_data import probe_tokens, read_run_data, val_blocks
from sinklab.targets.interface import model_title

PROG = "sinklab eval intervene"


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_target_args(ap, "its data: the validation blocks and the probe set",
                    "evaluate a transformers causal LM instead, with --data RUN_DIR or --tokens FILE.npy")
    ap.add_argument("--data", metavar="RUN_DIR", default=None,
                    help="read the validation blocks and the probe set from this run (default: TARGET's run dir)")
    ap.add_argument("--tokens", metavar="FILE.npy", default=None,
                    help="sequences (N, T) to validate on; their first 100 are the probe set")
    ap.add_argument("--interventions", nargs="+", default=list(INTERVENTIONS), choices=INTERVENTIONS, metavar="NAME",
                    help=f"which to run, besides the unchanged model (default: all of {', '.join(INTERVENTIONS)})")
    ap.add_argument("--channels", type=int, default=2, help="massive channels to set (default 2)")
    ap.add_argument("--val-batches", type=int, default=None, help="validation batches (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="the random keys of mask_random (default 0)")
    add_sweep_args(ap, "intervene")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_one_target(args)
    positive("--val-batches", args.val_batches)
    check_data_args(args)
    target, device, t0 = load_checked_target(args)
    meta = target.meta
    if args.tokens is not None:
        tokens = load_tokens(args.tokens, meta.vocab_size)
        if meta.context is not None and tokens.shape[1] - 1 > meta.context:
            raise UserError(f"--tokens {args.tokens}: sequences of {tokens.shape[1]} tokens exceed the model context "
                            f"{meta.context} + 1")
        val = list(tokens.split(32))[:args.val_batches]
        probe = tokens[:DEFAULT_NUM_SEQS, :-1]
    else:
        run_dir, flag = data_run_dir(args, meta.run_dir)
        val = read_run_data(Path(run_dir), {"num_workers": 0}, lambda dm: val_blocks(dm, args.val_batches),
                            flag, "the validation blocks", "check the run's data config")
        probe = probe_tokens(Path(run_dir), None, None)
        top = max(int(probe.max()), *(int(b.max()) for b in val))
        if top >= meta.vocab_size:
            raise UserError(f"{flag} {run_dir}: token id {top}, the model's vocabulary is [0, {meta.vocab_size - 1}]"
                            " (was the model trained on this data?)")
    val, probe = [b.to(device) for b in val], probe.to(device)
    massive = find_massive(target, probe, args.channels)
    rows, count = evaluate(target, val, probe, list(dict.fromkeys(args.interventions)), massive, args.seed)
    return {**meta.head(), "val_batches": len(val), "val_targets": count,
            "probe": {"num_seqs": int(probe.shape[0]), "seq_len": int(probe.shape[1])}, "massive": massive,
            "rows": rows, "seconds": round(time.perf_counter() - t0, 3)}


def format_table(res: dict) -> str:
    m = res["massive"]
    chans = ", ".join(f"{c} ({v:.2f}, mean {s:+.2f})" for c, v, s in zip(m["channels"], m["values"], m["mean_values"]))
    star = any("sink1_star" in r for r in res["rows"].values())
    lines = [f"{model_title(res)}: {res['val_batches']} validation batches, probe set {res['probe']['num_seqs']} x "
             f"{res['probe']['seq_len']}",
             f"massive activations: layer {m['layer']}, token {m['token']}, channels {chans}; top / median "
             f"{m['ratio']:.1f}", "",
             f"{'intervention':<13}{'val ppl':>10}{'d ppl':>10}{'Sink_1 %':>10}{'alpha_1':>9}"
             + (f"{'Sink*_1 %':>11}" if star else "")]
    for name, r in res["rows"].items():
        lines.append(f"{name:<13}{r['ppl']:>10.3f}{r['dppl']:>+10.3f}{r['sink1']:>10.2f}{r['alpha1']:>9.3f}"
                     + (f"{r['sink1_star']:>11.2f}" if star else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)
