"""sinklab eval intervene: what the sink does, by intervention. Validation perplexity and Sink_1 of a trained model,
unchanged and under each of:

    zero              the massive activations set to zero                             (Sun et al. 2024, "Massive
    mean              the massive activations set to their mean over the probe set     Activations in Large
                                                                                       Language Models", sec. 3)
    mask_first        every query q > 1 no longer sees the first token's key; attention renormalises over the rest
    mask_random       the control: every query q >= 3 no longer sees one random earlier key (not token 1, not itself)
    zero_value_first  the first token's value vector set to 0 in every head; the attention weights stay as they are,
                      so what the heads put on the first token adds nothing to their output

    sinklab eval intervene RUN_DIR_OR_CKPT [--interventions zero mean mask_first mask_random zero_value_first]
                                            [--channels 2] [--layers L,...] [--per-layer] [--per-head]
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
it is reported to show where the attention went (alpha_1 of the other rows is 0). zero_value_first sets that
token's value (every kv head's, as the operation attends with it) to 0: its attention weight stays in every row,
what it carries goes. A recurrent layer (model.attn_op=gated_deltanet) refuses a mask in one line.

Layers (0-based, as every layer number in sinklab's outputs): mask_first, mask_random and zero_value_first act in
the layers of --layers (default: every layer; a layer out of range is refused in one line before any compute), zero
and mean at the massive activations' layer. --per-layer adds each of mask_first and zero_value_first that
--interventions names in each chosen layer alone: validation ppl and dppl per layer (no Sink_1: it would cost a
probe pass each). --per-head adds mask_first in each (layer, query head) of the chosen layers alone: ppl and dppl
per head, the head's alpha_1 in the unchanged model (the probe set's, measured for `none`) and Spearman's rho between
the heads' alpha_1 and their dppl (does masking the first token cost most where a head attends to it most?). A mask
in some layers or heads is a `sinklab.model.masks.LayerMask`; the maps the metrics read are those the model attended
with.

Validation: the run's validation blocks, with the BOS token at position 1 if its training blocks have one
(data.bos), so that token 1 is what the model always saw there (its probe set has it too, data.probe_bos).

--json prints one object: target, val_batches, val_targets, probe (num_seqs, seq_len), massive {layer (from 0, as
in every output), token (from 1), channels, values (mean |h|), mean_values (signed), ratio (top mean |h| / median |h|)},
layers (the chosen layers), rows {name: {ppl, loss, dppl (ppl - the unchanged model's), sink1, alpha1, sink1_star
(operations without row normalisation)}}, with --per-layer per_layer {intervention: [{layer, ppl, dppl}, ...]}, with
--per-head per_head {mask_first: [{layer, head, ppl, dppl, alpha1}, ...], spearman_alpha1_dppl (null under 3 heads
or for a constant column)}, and seconds. The text: the rows' table, with --per-layer one of the layers, with
--per-head the 10 heads whose masking costs most and the correlation. --sweep SWEEP_DIR writes that object into
JOB/intervene.json for every finished job, then SWEEP_DIR/intervene.csv, one row per job (its columns:
`sinklab.evals.interventions.Interventions`). User errors are one line on stderr and exit code 2. The interventions
and their evaluation: `sinklab.evals.interventions`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from sinklab.cli.base import (OneLineParser, add_device_json_args, add_sweep_args, add_target_args, check_data_args,
                              check_one_target, command_main, data_run_dir, int_list, load_checked_target)
from sinklab.errors import UserError
from sinklab.evals.interventions import (IN_LAYERS, INTERVENTIONS, PER_LAYER, evaluate, find_massive, model_shape,
                                         per_head, per_layer)
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
    ap.add_argument("--layers", metavar="L,...", type=int_list, default=None,
                    help=f"apply {', '.join(IN_LAYERS)} in these layers only, 0-based (default: every layer; zero "
                         "and mean act at the massive activations' layer)")
    ap.add_argument("--per-layer", action="store_true",
                    help=f"also each of {', '.join(PER_LAYER)} (those among --interventions) in each chosen layer "
                         "alone: validation ppl and dppl per layer")
    ap.add_argument("--per-head", action="store_true",
                    help="also mask_first in each (layer, query head) of the chosen layers alone: ppl, dppl and the "
                         "head's alpha_1, and Spearman's rho between alpha_1 and dppl")
    add_sweep_args(ap, "intervene")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- main
def chosen_layers(layers: Optional[list[int]], n_layer: int) -> list[int]:
    """The layers the key / value interventions act in (every layer by default); one line for a layer the model
    does not have."""
    if layers is None:
        return list(range(n_layer))
    layers = sorted(layers)
    if layers[-1] >= n_layer:
        raise UserError(f"--layers {','.join(map(str, layers))}: layer {layers[-1]} is out of range; allowed: 0.."
                        f"{n_layer - 1} (the model's {n_layer} layers, 0-based)")
    return layers


def run(args) -> dict:
    check_one_target(args)
    positive("--val-batches", args.val_batches)
    check_data_args(args)
    names = list(dict.fromkeys(args.interventions))
    layered = [name for name in names if name in PER_LAYER]
    if args.per_layer and not layered:
        raise UserError(f"--per-layer applies {' and '.join(PER_LAYER)} layer by layer; --interventions names "
                        "neither")
    target, device, t0 = load_checked_target(args)
    n_layer, n_head = model_shape(target)
    layers = chosen_layers(args.layers, n_layer)
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
    rows, count, alpha1 = evaluate(target, val, probe, names, massive, args.seed,
                                   None if args.layers is None else layers)
    res = {**meta.head(), "val_batches": len(val), "val_targets": count,
           "probe": {"num_seqs": int(probe.shape[0]), "seq_len": int(probe.shape[1])}, "massive": massive,
           "layers": layers, "rows": rows}
    if args.per_layer:
        res["per_layer"] = per_layer(target, val, layered, layers, rows["none"]["ppl"])
    if args.per_head:
        res["per_head"] = per_head(target, val, layers, n_head, alpha1, rows["none"]["ppl"])
    return {**res, "seconds": round(time.perf_counter() - t0, 3)}


def format_table(res: dict) -> str:
    m = res["massive"]
    chans = ", ".join(f"{c} ({v:.2f}, mean {s:+.2f})" for c, v, s in zip(m["channels"], m["values"], m["mean_values"]))
    star = any("sink1_star" in r for r in res["rows"].values())
    width = max(13, *(len(name) + 1 for name in res["rows"]))  # zero_value_first is the longest name
    in_layers = [name for name in res["rows"] if name in IN_LAYERS]
    lines = [f"{model_title(res)}: {res['val_batches']} validation batches, probe set {res['probe']['num_seqs']} x "
             f"{res['probe']['seq_len']}",
             f"massive activations: layer {m['layer']}, token {m['token']}, channels {chans}; top / median "
             f"{m['ratio']:.1f}"]
    if in_layers:
        lines.append(f"{', '.join(in_layers)} in layers {', '.join(map(str, res['layers']))}")
    lines += ["", f"{'intervention':<{width}}{'val ppl':>10}{'d ppl':>10}{'Sink_1 %':>10}{'alpha_1':>9}"
              + (f"{'Sink*_1 %':>11}" if star else "")]
    for name, r in res["rows"].items():
        lines.append(f"{name:<{width}}{ppl_cell(r['ppl'], 10)}{ppl_cell(r['dppl'], 10, '+')}{r['sink1']:>10.2f}"
                     f"{r['alpha1']:>9.3f}"
                     + (f"{r['sink1_star']:>11.2f}" if star else ""))
    return "\n".join(lines + layer_tables(res))


def ppl_cell(value: float, width: int, sign: str = "") -> str:
    """A perplexity (or its change) right-aligned in `width` with 3 decimals, in e-notation where those would leave no
    space before it: masking a sink can send the perplexity past 10^6 (SmolLM2's and the hybrids' first token)."""
    text = f"{value:{sign}.3f}"
    return f"{text if len(text) < width else f'{value:{sign}.2e}':>{width}}"


def layer_tables(res: dict) -> list[str]:
    """The layers' table (--per-layer: val ppl and d ppl of each intervention in each layer alone) and the heads'
    (--per-head: the 10 heads whose masking costs most, and the rank correlation)."""
    lines = []
    if res.get("per_layer"):
        names = list(res["per_layer"])
        lines += ["", "each in one layer alone:",
                  f"{'layer':<7}" + "".join(f"{name + ' ppl':>22}{'d ppl':>10}" for name in names)]
        for i, layer in enumerate(res["per_layer"][names[0]]):
            cells = [res["per_layer"][name][i] for name in names]
            lines.append(f"{layer['layer']:<7}"
                         + "".join(ppl_cell(c["ppl"], 22) + ppl_cell(c["dppl"], 10, "+") for c in cells))
    if "per_head" in res:
        heads, rho = res["per_head"]["mask_first"], res["per_head"]["spearman_alpha1_dppl"]
        top = sorted(heads, key=lambda h: -h["dppl"])[:10]
        lines += ["", f"mask_first in one head alone, the {len(top)} costliest of {len(heads)} heads; Spearman's rho "
                      f"of alpha_1 and d ppl over the heads: {'n/a' if rho is None else f'{rho:+.3f}'}",
                  f"{'layer':<7}{'head':>5}{'val ppl':>10}{'d ppl':>10}{'alpha_1':>9}"]
        lines += [f"{h['layer']:<7}{h['head']:>5}{ppl_cell(h['ppl'], 10)}{ppl_cell(h['dppl'], 10, '+')}"
                  f"{h['alpha1']:>9.3f}" for h in top]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)
