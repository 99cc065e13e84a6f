"""The measurement behind `sinklab measure` (the command: `sinklab.cli.measure`, whose docstring gives the JSON): every
registered metric (`sinklab.metrics.METRICS`) of a model (a `sinklab.targets.Target` of any source) on the chosen token
ids, the result as one object, and its tables.

Each source records as it can: sinklab models through the exact query-chunked maps (memory linear in T), transformers
models through the eager attention maps per batch (`sinklab.targets.transformers_lm`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from sinklab.analysis.probe_inputs import InputSpec, choose_tokens
from sinklab.errors import UserError
from sinklab.targets import Target


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
    metrics = target.measure(tokens, eps=eps, k=k, batch_size=batch_size)
    head: dict[str, Any] = target.describe()
    head.update({"input": kind, "seed": inputs.seed, "seq_len": int(tokens.shape[1]), "num_seqs": int(tokens.shape[0]),
                 "model": target.meta.model})
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
