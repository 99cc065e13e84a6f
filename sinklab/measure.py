"""The measurement behind `sinklab measure` (the command: `sinklab.cli.measure`, whose docstring gives the JSON): every
registered metric (`sinklab.metrics.METRICS`) of a sinklab checkpoint or a local Hugging Face causal LM on the
chosen token ids, the result as one object, and its tables.

sinklab checkpoints use the exact query-chunked metric (`attention_scores`, memory linear in T) and
`activation_stats`; Hugging Face models materialise the eager attention maps per batch (`sinklab.hf`).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Optional

import numpy as np
import torch

from sinklab.errors import UserError
from sinklab.probe_inputs import checkpoint_and_run_dir, choose_tokens

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


def measure_hf(args, device: torch.device, name: Optional[str] = None, model=None) -> dict:
    """Every metric of the transformers model `name` (default args.hf_model) on args.input / args.tokens; `model`:
    already loaded (`sinklab.hf.load_hf_model`), e.g. for several inputs of one model."""
    from sinklab import hf
    from sinklab.metrics import METRICS, measure_all

    name = name if name is not None else args.hf_model
    model = model if model is not None else hf.load_hf_model(name, device, args.dtype, args.revision)
    tokens, kind, text = hf_tokens(args, name, model)
    check_k(args.k, tokens.shape[1])
    target = hf.HFTarget(model)
    metrics = METRICS.build(target.context(args.eps, args.k))
    measure_all(target, tokens, metrics, batch_size=args.batch_size)
    tcfg = hf.text_config(model)
    meta = {"target": str(name), "source": "hf", "revision": args.revision,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "input": kind, "seed": args.seed,
            "seq_len": int(tokens.shape[1]), "num_seqs": int(tokens.shape[0]),
            "model": {"model_type": getattr(tcfg, "model_type", None), "n_layer": target.n_layer,
                      "n_head": target.n_head, "sink_logits": target.sink_logits}}
    if args.tokens is not None:
        meta["tokens_file"] = str(args.tokens)
    if text is not None:
        meta["text"] = text
    return build_result(metrics, meta)


def hf_tokens(args, name: str, model) -> tuple[torch.Tensor, str, Optional[str]]:
    """(tokens (N, T), input name, where natural text came from or None) for a transformers model: natural text
    through the model's own tokenizer (`sinklab.probe_inputs.text_tokens`), else `choose_tokens`."""
    from sinklab import hf
    from sinklab.probe_inputs import (DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, natural_texts, positive, special_prefix,
                                      text_tokens)

    vocab, context = hf.vocab_size(model), hf.context_length(model)
    if args.input != "natural" or args.tokens is not None:
        return (*choose_tokens(args, vocab, context, None), None)
    seq_len = args.seq_len or (min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN)
    if context is not None and seq_len > context:
        raise UserError(f"--seq-len {seq_len} exceeds the model context {context}")
    positive("--seq-len", seq_len)
    tokenizer = hf.load_hf_tokenizer(name, args.revision)
    texts, where = natural_texts(args.text)
    tokens = text_tokens(tokenizer, texts, args.num_seqs or DEFAULT_NUM_SEQS, seq_len, vocab, where)
    first = f" ({tokenizer.convert_ids_to_tokens(special_prefix(tokenizer))[0]!r} first)" \
        if special_prefix(tokenizer) else ""
    return tokens, "natural", where + first


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
    sec, noop, ind = res.get("secondary_sinks"), res.get("noop"), res.get("induction")
    if sec and noop and ind:
        lines += ["", f"sinks at any position k <= {sec['scored_positions']} (alpha_k > {sec['eps']:g}), the no-op "
                      f"signature and the best head's scores on repeated random tokens, per layer",
                  f"{'layer':>5} {'2nd sink%':>9} {'positions':>9} {'v drain':>8} {'out ratio':>9} {'induction':>9} "
                  f"{'prev tok':>8}"]
        cols = (sec["by_layer"]["secondary_sink_heads"], sec["by_layer"]["sink_positions"],
                noop["by_layer"]["value_drain_ratio"], noop["by_layer"]["sink_output_ratio"],
                ind["by_layer"]["induction"], ind["by_layer"]["prev_token"])
        for layer, row in enumerate(zip(*cols)):
            lines.append(f"{layer:>5} " + " ".join(_fmt(x, w, p) for x, (w, p) in
                                                   zip(row, ((9, 2), (9, 2), (8, 3), (9, 3), (9, 3), (8, 3)))))
    extra = [key for key in ("k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj") if key in n]
    if extra:
        lines += ["", "first-token keys and values (mean over layers): "
                  + ", ".join(f"{key} {float(np.mean(n[key])):.3f}" for key in extra)]
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m sinklab.measure ...` is `sinklab measure ...`
    from sinklab.cli.measure import main

    sys.exit(main())
