"""sinklab quant: validation perplexity in fp32 and under simulated W8A16, W8A8, W4A16 and W4A4 quantization.

    sinklab quant RUN_DIR_OR_CKPT [--schemes w8a8 w4a4 ...] [--weights per-tensor|per-channel] [--json]
    sinklab quant CKPT --data RUN_DIR              (validation and calibration data of another run)
    sinklab quant --hf-model NAME_OR_DIR (--data RUN_DIR | --tokens FILE.npy) [--revision R] [--dtype D]
    sinklab quant --sweep SWEEP_DIR [--jobs 0 1 ...] [...]   (every finished job of a sweep -> SWEEP_DIR/quant.csv)
    python -m sinklab quant ...                    (the same; = sinklab eval quant)

Data: a run's validation blocks (its data config in RUN_DIR/.hydra/config.yaml: data.val_num_blocks blocks of
block_size + 1 tokens, all of them unless --val-batches, with the BOS token at position 1 when its training blocks
have one, data.bos) and, for the activation ranges, the first
--calib-batches batches of its training stream (as Bondarenko et al. calibrate on training data). --tokens
FILE.npy (N, T) evaluates these sequences instead (T - 1 predictions each) and calibrates on --calib-tokens, or on
the same sequences when that is not given. What is quantized and how: `sinklab.quant.fake`.

--json prints one object: target, source ("sinklab" | "hf"), data ("run" | "tokens"), val_batches, val_seqs,
seq_len, val_targets (scored predictions), calib_batches, momentum, weights ("per-tensor" | "per-channel"),
quantize_head, dtype (the model's), layers [quantized layer names], ranges {layer: [lo, hi]}, seconds, and
schemes {"fp32" | scheme: {w_bits, a_bits, loss, ppl, bpb, gap (ppl - fp32 ppl), rel_gap (gap / fp32 ppl)}}. bpb: bits
per byte of the validation text (the loss over ln 2 x the bytes of text per scored target, the run's tokenizer
decoding the blocks: `sinklab.model.lm_loss`), null with --tokens (no tokenizer to decode them with).
--sweep SWEEP_DIR writes that object into JOB/quant.json for every finished job, then SWEEP_DIR/quant.csv, one row
per job (its columns: `sinklab.evals.quantization`). User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import Optional, Sequence

import torch

from sinklab.cli.base import (OneLineParser, add_device_json_args, add_sweep_args, add_target_args, check_data_args,
                              check_one_target, command_main, data_run_dir, load_checked_target)
from sinklab.errors import UserError
from sinklab.analysis.probe_inputs import load_tokens, positive
from sinklab.runs.run_data import read_run_data, val_blocks
from sinklab.targets import TargetMeta
from sinklab.targets.interface import model_title
from sinklab.quant.fake import FP32, GRANULARITIES, SCHEMES, evaluate

PROG = "sinklab quant"
SUMMARY = "validation perplexity in fp32 and with simulated W8A8 / W4A4 / W8A16 quantization"
DEFAULT_CALIB_BATCHES = 8
DEFAULT_TOKENS_BATCH = 32


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog=PROG, description="Validation perplexity of a sinklab checkpoint or a local transformers "
                                              "causal LM in fp32 and with fake-quantized linear layers (weights "
                                              "symmetric, inputs asymmetric with static calibrated ranges).")
    add_target_args(ap, "its data", "evaluate a local transformers causal-LM dir")
    ap.add_argument("--data", metavar="RUN_DIR", default=None,
                    help="read validation and calibration blocks through this run's data config (default: TARGET's "
                         "run dir)")
    ap.add_argument("--tokens", metavar="FILE.npy", default=None,
                    help="evaluate these sequences instead: an integer .npy of shape (N, T)")
    ap.add_argument("--calib-tokens", metavar="FILE.npy", default=None,
                    help="with --tokens: calibrate on these sequences (default: the --tokens sequences)")
    ap.add_argument("--schemes", nargs="+", choices=tuple(SCHEMES), default=list(SCHEMES), metavar="SCHEME",
                    help=f"schemes besides fp32, from {', '.join(SCHEMES)} (default: all)")
    ap.add_argument("--weights", choices=GRANULARITIES, default="per-tensor",
                    help="weight scales per tensor (default, Bondarenko et al.'s min-max) or per output channel")
    ap.add_argument("--calib-batches", type=int, default=DEFAULT_CALIB_BATCHES,
                    help=f"calibration batches for the activation ranges (default {DEFAULT_CALIB_BATCHES})")
    ap.add_argument("--momentum", type=float, default=0.9,
                    help="running min-max momentum: range <- m * range + (1 - m) * batch's min/max (default 0.9)")
    ap.add_argument("--val-batches", type=int, default=None,
                    help="evaluate at most this many validation batches (default: all)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help=f"sequences per batch (default: the run's data.batch_size; {DEFAULT_TOKENS_BATCH} with "
                         "--tokens)")
    ap.add_argument("--quantize-head", action="store_true",
                    help="quantize the LM head too (kept in fp32 by default, as Bondarenko et al.)")
    add_sweep_args(ap, "quant")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- data
def token_batches(path: str, flag: str, meta: TargetMeta, batch_size: int) -> list[torch.Tensor]:
    tokens = load_tokens(path, meta.vocab_size)
    if tokens.shape[1] < 2:
        raise UserError(f"{flag} {path}: sequences of {tokens.shape[1]} token have no next token to predict; "
                        "pass sequences of T >= 2 tokens")
    if meta.context is not None and tokens.shape[1] - 1 > meta.context:
        raise UserError(f"{flag} {path}: sequences of {tokens.shape[1]} tokens exceed the model context "
                        f"{meta.context} + 1")
    return list(tokens.split(batch_size))


def run_batches(run_dir: Path, flag: str, args, meta: TargetMeta) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                           Optional[float]]:
    """The run's validation blocks (at most --val-batches batches), its first --calib-batches training batches and
    the bytes of text per scored target of those validation blocks (bits per byte)."""
    def read(dm):
        return (val_blocks(dm, args.val_batches), list(islice(dm.make_train_loader(), args.calib_batches)),
                dm.val_bytes_per_token(args.val_batches, meta.prefix_len))

    val, calib, per_token = read_run_data(run_dir, {"batch_size": args.batch_size, "num_workers": 0}, read, flag,
                                          "the validation and training blocks", "pass --tokens FILE.npy")
    top = max(int(b.max()) for b in val + calib)
    if top >= meta.vocab_size:
        raise UserError(f"{flag} {run_dir}: the blocks have token id {top}, the model's vocabulary is "
                        f"[0, {meta.vocab_size - 1}] (was the model trained on this data?)")
    length = val[0].shape[1] - 1
    if meta.context is not None and length > meta.context:
        raise UserError(f"{flag} {run_dir}: its blocks of {length} tokens exceed the model context {meta.context}")
    return val, calib, per_token


def choose_data(args, meta: TargetMeta, run_dir: Optional[Path]) -> tuple[list, list, str, Optional[float]]:
    """(validation batches, calibration batches, "run" | "tokens", bytes of text per scored target or None)."""
    if args.tokens is not None:
        size = args.batch_size or DEFAULT_TOKENS_BATCH
        val = token_batches(args.tokens, "--tokens", meta, size)[:args.val_batches]
        calib_file, flag = (args.calib_tokens, "--calib-tokens") if args.calib_tokens else (args.tokens, "--tokens")
        return val, token_batches(calib_file, flag, meta, size)[:args.calib_batches], "tokens", None
    data, flag = data_run_dir(args, run_dir)
    val, calib, per_token = run_batches(data, flag, args, meta)
    return val, calib, "run", per_token


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_one_target(args)
    for name, value in (("--calib-batches", args.calib_batches), ("--val-batches", args.val_batches),
                        ("--batch-size", args.batch_size)):
        positive(name, value)
    if not 0 <= args.momentum < 1:
        raise UserError(f"--momentum {args.momentum:g} must be in [0, 1) (0: the last batch's range only)")
    check_data_args(args)
    target, device, t0 = load_checked_target(args)
    meta = target.meta
    val, calib, kind, per_token = choose_data(args, meta, meta.run_dir)
    val, calib = [b.to(device) for b in val], [b.to(device) for b in calib]
    res = {**meta.head(), "data": kind, "val_batches": len(val),
           "val_seqs": sum(b.shape[0] for b in val), "seq_len": int(val[0].shape[1] - 1),
           "calib_batches": len(calib), "momentum": args.momentum, "weights": args.weights,
           "quantize_head": args.quantize_head, "dtype": meta.dtype or "float32"}
    res.update(evaluate(target.model, target.logits, val, calib, [SCHEMES[s] for s in dict.fromkeys(args.schemes)],
                        per_channel=args.weights == "per-channel", momentum=args.momentum,
                        quantize_head=args.quantize_head, prefix_len=meta.prefix_len, bytes_per_token=per_token))
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def format_table(res: dict) -> str:
    import pandas as pd

    rows = []
    for name, r in res["schemes"].items():
        weights, acts = (SCHEMES.get(name) or FP32).describe()
        rows.append({"scheme": name, "weights": weights, "inputs": acts, "loss": r["loss"], "ppl": r["ppl"],
                     **({"bpb": r["bpb"]} if r.get("bpb") is not None else {}), "gap": r["gap"],
                     "gap %": 100 * r["rel_gap"]})
    table = pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.4f}")
    head = "the LM head too; embeddings stay fp32" if res["quantize_head"] else "the LM head and embeddings stay fp32"
    dtype = "" if res.get("dtype", "float32") == "float32" else \
        f" in {res['dtype']} (the fp32 row: the unquantized model in {res['dtype']})"
    return "\n".join([
        model_title(res) + dtype,
        f"validation: {res['val_seqs']} sequences x {res['seq_len']} tokens ({res['val_targets']} targets, "
        f"{res['val_batches']} batches, {'the run' if res['data'] == 'run' else '--tokens'}); calibration: "
        f"{res['calib_batches']} batches, running min-max (momentum {res['momentum']:g})",
        f"quantized: the weights ({res['weights']}, symmetric) and inputs (per-tensor, asymmetric) of "
        f"{len(res['layers'])} linear layers; {head}",
        "", table, "", "gap: perplexity minus the fp32 perplexity" + ("; bpb: bits per byte of the validation text"
                                                                      if "bpb" in rows[0] else "")])


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)
