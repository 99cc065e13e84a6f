"""sinklab atlas: every head's attention map as one self-contained HTML page (no network; open it from disk).

    sinklab atlas RUN_DIR [--out atlas.html] [--metric sink/alpha] [--last]    (a slider over its kept checkpoints)
    sinklab atlas CKPT [--input natural|random|repeat] [--seq-len T] [--num-seqs N]
    sinklab atlas --hf-model NAME_OR_DIR [--revision R] [--dtype D] [--text FILE ...]

The page: an L x H grid of thumbnails of each head's map, coloured by a per-head value (--metric, default sink/alpha:
alpha_1; a dropdown offers every layer x head grid a registered metric gives, e.g. entropy, induction/induction);
a click opens the head's full map with the probe tokens on its axes and its values beside it; a slider over a run
dir's kept checkpoints (checkpoints/kept/, then last.ckpt; a run without kept ones draws last.ckpt alone and says
so). The maps are of the first probe sequence (BOS first where the run's data puts one), the values over all
sequences, as `sinklab measure` gives them (`sinklab.analysis.atlas`). Each checkpoint costs one measurement.

--json prints {out, bytes, metric, metrics, n_layer, n_head, input, note, seconds, checkpoints: [{label, step,
tokens, where, seconds}]}. User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from sinklab.analysis import atlas as at
from sinklab.analysis.probe_inputs import INPUTS, InputSpec, positive
from sinklab.cli.base import (OneLineParser, add_device_json_args, add_target_args, check_files, check_one_target,
                              command_main, pick_device, target_spec)
from sinklab.errors import UserError
from sinklab.io import check_output_file
from sinklab.targets import TargetSpec

PROG = "sinklab atlas"
SUMMARY = "every head's attention map as one self-contained HTML page, with a slider over a run's kept checkpoints"


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description="Every head's attention map as one self-contained HTML page: an L x H "
                                              "grid coloured by alpha_1 (or any per-head metric), a head's full map "
                                              "with the probe tokens, a slider over a run's kept checkpoints.")
    add_target_args(ap, "its kept checkpoints (checkpoints/kept/) for the slider, and its probe set",
                    "draw a transformers causal LM instead")
    ap.add_argument("--out", type=Path, default=Path("atlas.html"), help="the page (default atlas.html)")
    ap.add_argument("--metric", default=at.DEFAULT_METRIC,
                    help="the per-head value the grid is coloured by first (the page's dropdown has every one): "
                         "sink/alpha (alpha_1, default), entropy, induction/induction, ...")
    ap.add_argument("--last", action="store_true", help="a run dir: draw last.ckpt alone (no slider)")
    ap.add_argument("--input", choices=INPUTS, default=None,
                    help="natural: the run's probe set (default; for --hf-model, text through its tokenizer); "
                         "random / repeat: token ids (seeded)")
    ap.add_argument("--text", nargs="+", metavar="FILE", default=None,
                    help="--hf-model: UTF-8 text files for natural input (default: the validation plays of "
                         "sinklab's Shakespeare corpus)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence T (default 64, within the context)")
    ap.add_argument("--num-seqs", type=int, default=None,
                    help="sequences the values are measured over (default 100; the maps are of the first)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random / repeat inputs (default 0)")
    ap.add_argument("--batch-size", type=int, default=25, help="sequences per forward (default 25)")
    add_device_json_args(ap)
    return ap


def check_args(args) -> None:
    """Everything that needs no model: one target, sizes, the page's name, the files named, the metric's name."""
    check_one_target(args)
    for flag, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs), ("--batch-size", args.batch_size)):
        positive(flag, value)
    check_output_file("--out", args.out, (".html", ".htm"))
    if args.text and (args.hf_model is None or args.input not in (None, "natural")):
        raise UserError("--text goes with --hf-model (natural text through the model's tokenizer)")
    if args.last and args.hf_model is not None:
        raise UserError("--last applies to a run dir (its last.ckpt); an --hf-model is one model")
    check_files(*(("--text", f) for f in args.text or []))
    at.check_metric(args.metric)


def run(args) -> dict:
    check_args(args)
    device = pick_device(args.device)
    if args.hf_model is not None:
        spec = target_spec(args, device)
        specs, note, title = [(spec, None, None)], None, spec.name + (f" @ {spec.revision}" if spec.revision else "")
        kind = args.input or "natural"
    else:
        points, note = at.checkpoints_of(args.target, args.last)
        specs = [(TargetSpec(name, "sinklab", device=device), step, tokens) for name, step, tokens in points]
        title, kind = str(args.target), args.input
    inputs = InputSpec(kind=kind, seq_len=args.seq_len, num_seqs=args.num_seqs, seed=args.seed,
                       texts=tuple(args.text) if args.text else None)
    done: list[dict] = []

    def on_frame(frame, seconds: float) -> None:
        done.append({"label": frame.label, "step": frame.step, "tokens": frame.tokens, "where": frame.where,
                     "seconds": round(seconds, 3)})
        print(f"{frame.label}: {args.metric} measured ({seconds:.2f} s)", file=sys.stderr)

    atlas = at.build_atlas(title, specs, inputs, args.metric, batch_size=args.batch_size, note=note,
                           on_frame=on_frame)
    try:
        path = at.write_atlas(atlas, args.out)
    except OSError as err:  # checked before measuring; what changed since (a full disk, a dir removed)
        raise UserError(f"--out {args.out}: cannot write it ({err.strerror or err})") from None
    frame = atlas.frames[0]
    return {"out": str(path), "bytes": path.stat().st_size, "metric": atlas.metric, "metrics": atlas.metrics,
            "n_layer": int(frame.map.shape[0]), "n_head": int(frame.map.shape[1]), "input": atlas.input,
            "note": atlas.note, "seconds": round(sum(c["seconds"] for c in done), 3), "checkpoints": done}


def format_text(res: dict) -> str:
    n = len(res["checkpoints"])
    lines = [f"atlas: {res['out']} ({n} checkpoint{'s' if n > 1 else ''}, {res['n_layer']} layers x "
             f"{res['n_head']} heads, {res['input']}; {res['bytes'] / 1024:.0f} KB, {res['seconds']:.1f} s)"]
    if res["note"]:
        lines.append(f"note: {res['note']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_text, argv)
