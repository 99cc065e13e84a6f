"""sinklab trajectory: every registered metric over a training, from a run's kept checkpoints or a model's hub
revisions, into one CSV keyed by step and tokens seen, and a plot of chosen metrics against tokens (log x).

    sinklab trajectory RUN_DIR [RUN_DIR ...] [--metrics sink/sink1,entropy] [--csv FILE] [--plot FILE.png]
    sinklab trajectory --hf-model ID --revision R1 R2 ... [--hf-model ID2 --revision ...] --text FILE.txt
    sinklab trajectory --hf-model DIR1 DIR2 DIR3 --input random       (local checkpoint dirs of one training)

A run's points are its kept checkpoints (callbacks.checkpoint.keep: checkpoints/kept/step<S>-tokens<N>.ckpt) and
last.ckpt, measured on the run's probe set (or --input / --tokens); a model's points are its revisions or dirs in
the order given, step and tokens parsed from names like `step143000` or `stage1-step1000-tokens4B` (Pythia's
tokens per step are known; else --tokens-per-step, or what a local export records in trainer_state.json), measured
on --text (through the model's tokenizer, loaded once), --input random|repeat or --tokens. Each series reads its
input once. RUN_DIRs go before --hf-model. A local git repository takes --revision too: `sinklab export-hf RUN DIR
--revisions` writes a run's kept checkpoints as its branches step<N>, read with --hf-model DIR --revision step<N> ...

The CSV has one row per checkpoint: series, checkpoint, step, tokens, input, seconds (load + measure), then every
value the metrics log (the names of metrics.csv: sink/sink1, act/attn_entropy, act/layer0/..., ...). --metrics
chooses what is plotted (and printed): logged names, or a registered metric's name for its headline values
(`sinklab report --metrics` reads them the same way). --json prints {csv, plot, x, metrics, seconds, points:
[{series, checkpoint, step, tokens, input, seconds, values: {metric: value}}], not_measured: [chosen metrics no
checkpoint has, e.g. a gate statistic of a model without gates]}.
"""
from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from sinklab.cli.base import OneLineParser, add_device_json_args, check_files, command_main, pick_device
from sinklab.errors import UserError
from sinklab.io import check_output_file
from sinklab.targets.hub_models import DTYPES, pick_dtype, recorded_progress
from sinklab.analysis.probe_inputs import INPUTS, InputSpec, check_thresholds, positive

PROG = "sinklab trajectory"
SUMMARY = ("every metric over a training: a run's kept checkpoints or a model's hub revisions -> CSV by step and "
           "tokens, and a plot")


class _HFModels(argparse.Action):
    """--hf-model NAME [NAME ...]: starts a series; the --revision list after it belongs to it."""

    def __call__(self, parser, ns, values, option_string=None):
        ns.hf_groups = [*(ns.hf_groups or []), (list(values), [])]


class _Revisions(argparse.Action):
    def __call__(self, parser, ns, values, option_string=None):
        if not ns.hf_groups:
            parser.error("--revision needs an --hf-model ID before it")
        if ns.hf_groups[-1][1]:
            parser.error(f"--revision given twice after --hf-model {' '.join(ns.hf_groups[-1][0])}")
        ns.hf_groups[-1][1].extend(values)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description="Every registered metric of a run's kept checkpoints or a model's "
                                              "hub revisions, into one CSV by step and tokens seen, and a plot.")
    ap.add_argument("runs", nargs="*", metavar="RUN_DIR", help="sinklab-train run dirs (their kept checkpoints)")
    ap.add_argument("--hf-model", nargs="+", metavar="ID_OR_DIR", action=_HFModels, dest="hf_groups", default=None,
                    help="a transformers model (hub id with --revision), or several local checkpoint dirs of one "
                         "training; repeat for more models")
    ap.add_argument("--revision", nargs="+", metavar="REV", action=_Revisions, default=None,
                    help="the revisions of the --hf-model before it (branches, tags or commits of a hub id, or of a "
                         "local git repository written by export-hf --revisions), e.g. step1000")
    ap.add_argument("--tokens-per-step", type=int, default=None,
                    help="tokens seen per step, for revisions named by step only (Pythia's 2,097,152 is known)")
    ap.add_argument("--metrics", nargs="+", default=["sink/sink1"], metavar="NAME",
                    help="what to plot and print: logged names or registered metrics, space or comma separated "
                         "(default sink/sink1; the CSV has every value)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--input", choices=INPUTS, default=None,
                     help="natural: a run's probe set (default for runs); random / repeat: token ids (seeded)")
    src.add_argument("--tokens", metavar="FILE.npy", default=None, help="exactly these sequences (N, T)")
    src.add_argument("--text", metavar="FILE.txt", default=None,
                     help="--hf-model: natural text through the model's own tokenizer, cut into N x T tokens")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence T (default 64)")
    ap.add_argument("--num-seqs", type=int, default=None, help="sequences N (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random / repeat inputs (default 0)")
    ap.add_argument("--eps", type=float, nargs="+", default=[0.3], help="sink thresholds (default 0.3)")
    ap.add_argument("--k", type=int, default=4, help="score the first k tokens (default 4)")
    ap.add_argument("--batch-size", type=int, default=25, help="sequences per forward (default 25)")
    ap.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="--hf-model weights: auto (bfloat16 on CUDA, float32 elsewhere), float32, bfloat16, float16")
    ap.add_argument("--csv", type=Path, default=Path("trajectory.csv"), help="the table (default trajectory.csv)")
    ap.add_argument("--plot", type=Path, default=Path("trajectory.png"), help="the figure (default trajectory.png)")
    add_device_json_args(ap)
    return ap


def metric_keys(names: Sequence[str]) -> list[str]:
    """--metrics: comma or space separated; a registered metric's name -> its headline keys; every key must be a
    name some registered metric logs (its bounds cover it), checked before anything is measured."""
    from sinklab.metrics import METRICS
    from sinklab.report.table import expand_metric_names

    keys = expand_metric_names([n for arg in names for n in arg.split(",") if n])
    for key in keys:
        if not any(re.search(pattern, key) for pattern, _ in METRICS.bounds()):
            near = difflib.get_close_matches(key, [k for metric in METRICS for k in metric.headline], n=1)
            raise UserError(f"--metrics {key}: no registered metric logs it; allowed: a metric name "
                            f"({', '.join(METRICS.names())}) or a logged name such as sink/sink1, sink/alpha1, "
                            "act/attn_entropy, act/layer0/attn_entropy"
                            + (f"; did you mean {near[0]}?" if near else ""))
    if not keys:
        raise UserError("--metrics: name at least one metric, e.g. --metrics sink/sink1")
    return keys


def check_args(args) -> None:
    if not args.runs and not args.hf_groups:
        raise UserError("nothing to measure: pass RUN_DIR(s) and/or --hf-model ID --revision R1 R2 ...")
    if args.text is not None and args.runs:
        raise UserError("--text applies to --hf-model models (their own tokenizer); a run is measured on its probe "
                        "set, --input random|repeat or --tokens")
    if args.hf_groups and args.input in (None, "natural") and args.tokens is None and args.text is None:
        raise UserError("--hf-model has no probe set; choose its input: --text FILE.txt (natural text through the "
                        "model's tokenizer), --input random|repeat or --tokens FILE.npy")
    for flag, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs), ("--batch-size", args.batch_size),
                        ("--tokens-per-step", args.tokens_per_step)):
        positive(flag, value)
    check_thresholds(args.eps, args.k)
    for path, flag in ((args.csv, "--csv"), (args.plot, "--plot")):
        check_output_file(flag, path)


def run(args) -> dict:
    import pandas as pd

    from sinklab.analysis import trajectories as tj
    from sinklab.io import atomic_write

    check_args(args)
    keys = metric_keys(args.metrics)
    check_files(("--tokens", args.tokens), ("--text", args.text))  # before any checkpoint is read
    series = [tj.run_series(r) for r in args.runs]
    series += [tj.hf_series(names, revs, args.tokens_per_step, recorded_progress)
               for names, revs in args.hf_groups or []]
    tj.unique_labels(series)
    device = pick_device(args.device)
    args.dtype = pick_dtype(args.dtype, device)
    rows: list[dict] = []

    def on_point(s, point, kind, shape, values, seconds) -> None:
        rows.append({"series": s.label, "checkpoint": point.where, "step": point.step, "tokens": point.tokens,
                     "input": f"{kind} {shape[0]}x{shape[1]}", "seconds": round(seconds, 3),
                     "order": len([r for r in rows if r["series"] == s.label]) + 1, **values})
        print(f"{s.label} {point.where}: {keys[0]} {values.get(keys[0], float('nan')):.4g} ({seconds:.2f} s)",
              file=sys.stderr)

    inputs = InputSpec(kind="natural" if args.text else args.input, tokens_file=args.tokens, seq_len=args.seq_len,
                       num_seqs=args.num_seqs, seed=args.seed, texts=(args.text,) if args.text else None)
    t0 = time.perf_counter()
    for s in series:
        tj.measure_series(s, inputs, device, on_point, args.dtype, args.eps, args.k, args.batch_size)
    seconds = time.perf_counter() - t0
    table = pd.DataFrame(rows).drop(columns="order")
    atomic_write(args.csv, table.to_csv(index=False))
    shown = [k for k in keys if any(r.get(k) is not None for r in rows)]
    missing = [k for k in keys if k not in shown]
    if not shown:
        raise UserError(f"--metrics {', '.join(keys)}: measured on no checkpoint (the CSV {args.csv} has what was); "
                        "a gate statistic needs a gated model, norm weights a sinklab checkpoint")
    plot, xcol = tj.plot(rows, shown, args.plot)
    return {"csv": str(args.csv), "plot": str(plot), "x": xcol, "metrics": shown, "not_measured": missing,
            "seconds": round(seconds, 3),
            "points": [{**{k: r[k] for k in tj.RUN_KEYS},
                        "values": {k: r.get(k) for k in shown}} for r in rows]}


def _num(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def format_text(res: dict) -> str:
    keys, lines = res["metrics"], []
    for label in dict.fromkeys(p["series"] for p in res["points"]):
        pts = [p for p in res["points"] if p["series"] == label]
        lines += [f"{label} (input {pts[0]['input']})",
                  f"{'step':>9} {'tokens':>14} " + " ".join(f"{k:>{max(12, len(k))}}" for k in keys) + "  seconds"]
        lines += [f"{_num(p['step'], 'd'):>9} {_num(p['tokens'], ',d'):>14} "
                  + " ".join(f"{_num(p['values'][k], '.4g'):>{max(12, len(k))}}" for k in keys)
                  + f"  {p['seconds']:7.2f}" for p in pts]
        lines.append("")
    n = len(res["points"])
    lines += [f"csv: {res['csv']} ({n} checkpoints, every logged value)",
              f"plot: {res['plot']} ({', '.join(keys)} against {res['x']}, log x)",
              f"measured {n} checkpoints in {res['seconds']:.1f} s ({res['seconds'] / max(n, 1):.2f} s each)"]
    if res["not_measured"]:
        lines.append(f"not measured on these models: {', '.join(res['not_measured'])}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_text, argv)
