"""sinklab measure: the attention-sink metric (Gu et al., ICLR 2025) and activation statistics of one model.

    sinklab measure RUN_DIR_OR_CKPT [--tokens FILE.npy | --input natural|random|repeat] [--eps E ...] [--json]
    sinklab measure --hf-model DIR (--tokens FILE.npy | --input random|repeat) [--json]
    sinklab measure --eps 0.3 0.5 RUN_DIR_OR_CKPT ...                   (TARGET may follow --eps's values)
    python -m sinklab.measure ...                                       (the same)

Inputs: ``natural`` (default for a training run) is the run's probe set, read through the data config saved in
``RUN_DIR/.hydra/config.yaml``; ``random`` draws uniform token ids (seeded); ``repeat`` repeats one random token
T times per sequence (the paper's Table 1); ``--tokens`` measures exactly the sequences of an int .npy (N, T).

sinklab checkpoints use the exact query-chunked metric (`attention_scores`, memory linear in T) and
`activation_stats`; Hugging Face models materialise the eager attention maps per batch (`sinklab.hf`).
User errors are one line on stderr and exit code 2.

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
import contextlib
import json
import math
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sinklab.errors import UserError
from sinklab.probe_inputs import (DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, INPUTS, checkpoint_and_run_dir, choose_tokens,
                                  positive)

PROG = "sinklab measure"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (and exit code 2, as argparse's own)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object instead of tables: sink, sink_star (Sink* on the renormalised map "
                         "|A| / sum |A|; equal to sink for row-normalised ops such as softmax), alpha, massive, "
                         "norms, seq_len, num_seqs, eps, ... (see the module docstring)")
    return ap


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
    res.setdefault("gates", {})
    return res


def measure_checkpoint(args, device: torch.device) -> dict:
    from sinklab.checkpoint import load_model
    from sinklab.metrics import METRICS, SinklabTarget, measure_all

    ckpt, run_dir = checkpoint_and_run_dir(args.target)
    model = load_model(ckpt).to(device)
    cfg = model.cfg
    tokens, kind = choose_tokens(args, cfg.vocab_size, cfg.block_size, run_dir)
    check_k(args.k, tokens.shape[1])
    target = SinklabTarget(model)
    metrics = METRICS.build(target.context(args.eps, args.k))
    measure_all(target, tokens.to(device), metrics, batch_size=args.batch_size)
    meta = {"target": str(ckpt), "source": "sinklab", "input": kind, "seed": args.seed,
            "seq_len": int(tokens.shape[1]), "num_seqs": int(tokens.shape[0]),
            "model": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "attn_op": cfg.attn_op, "pos": cfg.pos,
                      "attn_bias": cfg.attn_bias, "n_sink_tokens": cfg.n_sink_tokens, "gate": cfg.gate,
                      "gate_act": cfg.gate_act}}
    if args.tokens is not None:
        meta["tokens_file"] = str(args.tokens)
    return build_result(metrics, meta)


def measure_hf(args, device: torch.device) -> dict:
    from sinklab import hf
    from sinklab.metrics import METRICS, measure_all

    model = hf.load_hf_model(args.hf_model, device)
    tokens, kind = choose_tokens(args, hf.vocab_size(model), hf.context_length(model), None)
    check_k(args.k, tokens.shape[1])
    target = hf.HFTarget(model)
    metrics = METRICS.build(target.context(args.eps, args.k))
    measure_all(target, tokens, metrics, batch_size=args.batch_size)
    tcfg = hf.text_config(model)
    meta = {"target": str(args.hf_model), "source": "hf", "input": kind, "seed": args.seed,
            "seq_len": int(tokens.shape[1]), "num_seqs": int(tokens.shape[0]),
            "model": {"model_type": getattr(tcfg, "model_type", None), "n_layer": target.n_layer,
                      "n_head": target.n_head}}
    if args.tokens is not None:
        meta["tokens_file"] = str(args.tokens)
    return build_result(metrics, meta)


def check_k(k: int, T: int) -> None:
    if k < 1:
        raise UserError(f"--k {k} must be a positive integer")
    if k > T:
        raise UserError(f"--k {k} exceeds the sequence length T={T}; use --k <= {T}")


# ----------------------------------------------------------------------------------------------------- tables
def _fmt(x: float, width: int = 7, prec: int = 2) -> str:
    return f"{x:{width}.{prec}f}" if isinstance(x, (int, float)) and math.isfinite(x) else f"{'-':>{width}}"


def format_tables(res: dict, max_heads: int = 16) -> str:
    K = res["k"]
    lines = [f"{res['source']} model {res['target']}",
             f"input {res['input']}: {res['num_seqs']} sequences x {res['seq_len']} tokens; "
             f"{'rows sum to 1' if res['row_normalised'] else 'rows do not sum to 1 (Sink* on |A| / sum |A|)'}",
             ""]
    head = f"{'':<14}" + "".join(f"{'k=' + str(j + 1):>9}" for j in range(K))
    lines += ["Sink_k (%): heads with alpha_k > eps, per sequence, averaged", head]
    for e, r in res["sink_by_eps"].items():
        lines.append(f"{'eps=' + e:<14}" + "".join(f"{r[str(j + 1)]:9.2f}" for j in range(K)))
    for e, r in (res["sink_star_by_eps"] if not res["row_normalised"] else {}).items():  # else equal to Sink
        lines.append(f"{'Sink* eps=' + e:<14}" + "".join(f"{r[str(j + 1)]:9.2f}" for j in range(K)))
    lines.append(f"{'mean alpha_k':<14}" + "".join(f"{res['alpha_mean'][str(j + 1)]:9.4f}" for j in range(K)))
    for name in ("slot", "slot_star"):
        if f"{name}_by_eps" not in res:
            continue
        lines += ["", f"{'bias slot / sink tokens' if name == 'slot' else 'slots, renormalised (Sink*)'} (%):"]
        for e, r in res[f"{name}_by_eps"].items():
            lines.append(f"{'eps=' + e:<14}" + "".join(f"{n}={v:.2f}  " for n, v in r.items()))
        lines.append(f"{'mean score':<14}" + "".join(f"{n}={float(np.mean(grid)):.4f}  "
                                                     for n, grid in res[f"{name}_alpha"].items()))
    alpha = res["alpha"]
    H = len(alpha[0]) if alpha else 0
    shown = min(H, max_heads)
    which = "" if shown == H else f"; first {shown} of {H} heads"
    lines += ["", f"alpha_1 per layer and head (mean over sequences{which})",
              f"{'layer':>5} {'mean':>7} {'Sink_1%':>7} |" + "".join(f"{'h' + str(h):>6}" for h in range(shown))]
    for layer, row in enumerate(alpha):
        lines.append(f"{layer:>5} {float(np.mean(row)):7.3f} {res['sink1_by_layer'][layer]:7.1f} |"
                     + "".join(f"{a:6.2f}" for a in row[:shown]))
    m, n = res["massive"], res["norms"]
    if m:
        lines += ["", "massive activations per layer (residual stream of the real tokens; token 1-indexed)",
                  f"{'layer':>5} {'top |h|':>10} {'median':>9} {'ratio':>9} {'token':>6} {'channel':>8} "
                  f"{'||h1||/mean':>11}"]
        for layer in range(len(m["top"])):
            h1 = n.get("h1_norm_ratio", [float("nan")] * len(m["top"]))[layer]
            lines.append(f"{layer:>5} {m['top'][layer]:10.3f} {m['median'][layer]:9.4f} {m['ratio'][layer]:9.1f} "
                         f"{m['token'][layer]:>6} {m['channel'][layer]:>8} {_fmt(h1, 11, 3)}")
    o, r = res["outliers"], res["residual_sinks"]
    if "channel" in r:
        n_layers = len(r["channel"])
        cols = [o.get(key) or [None] * n_layers for key in ("resid_inf_norm", "resid_kurtosis", "attn_inf_norm",
                                                              "attn_kurtosis")]
        cols += [r.get(key) or [None] * n_layers for key in ("attn_norm_min", "ffn_norm_min")]
        lines += ["", "residual sinks (top channel of H_avg = mean |h_j| over tokens) and outliers per layer",
                  f"{'layer':>5} {'channel':>8} {'top/med':>8} {'|h| inf':>9} {'kurt h':>8} {'|a| inf':>9} "
                  f"{'kurt a':>8} {'min|w| attn':>11} {'min|w| ffn':>10}"]
        for layer in range(n_layers):
            widths = ((9, 3), (8, 1), (9, 3), (8, 1), (11, 4), (10, 4))
            lines.append(f"{layer:>5} {r['channel'][layer]:>8} {r['ratio'][layer]:8.1f} "
                         + " ".join(_fmt(col[layer], w, p) for col, (w, p) in zip(cols, widths)))
        lines.append(f"top channel shared by {100 * r['channel_share']:.0f}% of layers; first-token attention "
                     f"(alpha_1) {res['first_token_attn']['mean']:.4f}")
    g = res.get("gates")
    if g:
        kind = f"model.gate={res['model'].get('gate')}, gate_act={res['model'].get('gate_act')}"
        lines += ["", f"gate scores act(X W_theta) per layer ({kind}; real tokens)",
                  f"{'layer':>5} {'mean':>8} {'< 0.1 %':>8} {'token 1':>8}"]
        rows = zip(*(g["by_layer"][key] for key in ("mean", "low_share", "first_token")))
        for layer, (mean, low, first) in enumerate(rows):
            lines.append(f"{layer:>5} {mean:8.4f} {100 * low:8.1f} {first:8.4f}")
        lines.append(f"{'all':>5} {g['mean']:8.4f} {100 * g['low_share']:8.1f} {g['first_token']:8.4f}")
    extra = [key for key in ("k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj") if key in n]
    if extra:
        lines += ["", "first-token keys and values (mean over layers): "
                  + ", ".join(f"{key} {float(np.mean(n[key])):.3f}" for key in extra)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- main
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return dev


def add_target_args(parser: argparse.ArgumentParser, uses: str, hf_help: str) -> None:
    """TARGET (a checkpoint or run dir, of which the command `uses` ...) and --hf-model DIR: one of the two
    (`check_one_target`)."""
    parser.add_argument("target", nargs="?", default=None,
                        help=f"a sinklab .ckpt or a run dir (uses its checkpoints/last.ckpt and {uses})")
    parser.add_argument("--hf-model", metavar="DIR", default=None, help=hf_help)


def check_one_target(args) -> None:
    if (args.target is None) == (args.hf_model is None):
        raise UserError("pass either TARGET (a sinklab checkpoint or run dir) or --hf-model DIR, not "
                        + ("both" if args.target else "neither"))


def run(args) -> dict:
    check_one_target(args)
    for name, value in (("--seq-len", args.seq_len), ("--num-seqs", args.num_seqs),
                        ("--batch-size", args.batch_size)):
        positive(name, value)
    for e in args.eps:
        if not math.isfinite(e) or e < 0:
            raise UserError(f"--eps {e:g} must be a finite threshold >= 0")
    if args.k < 1:
        raise UserError(f"--k {args.k} must be a positive integer")
    device = pick_device(args.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        res = measure_hf(args, device) if args.hf_model is not None else measure_checkpoint(args, device)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def finite(obj: Any) -> Any:
    """NaN / inf (e.g. a norm ratio with T = 1) -> null, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def command_main(prog: str, parser: argparse.ArgumentParser, run: Callable[[Any], dict],
                 text: Callable[[dict], str], argv: Optional[Sequence[str]]) -> int:
    """Parse argv, res = run(args), print res as one JSON object (--json) or as text(res); a UserError is one line
    on stderr and exit code 2 (the `sinklab measure` and `sinklab quant` mains)."""
    args = parser.parse_args(argv)
    try:
        # in JSON mode stdout carries exactly one object: anything printed while running goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            res = run(args)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(finite(res), allow_nan=False) if args.json else text(res))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_tables, argv)


if __name__ == "__main__":
    sys.exit(main())
