"""sinklab eval intervene: what the sink does, by intervention. Validation perplexity and Sink_1 of a trained model,
unchanged and under each of:

    zero         the massive activations set to zero                        (Sun et al. 2024, "Massive Activations
    mean         the massive activations set to their mean over the probe set  in Large Language Models", sec. 3)
    mask_first   every query q > 1 no longer sees the first token's key; attention renormalises over the rest
    mask_random  the control: every query q >= 3 no longer sees one random earlier key (not token 1, not itself)

    sinklab eval intervene RUN_DIR_OR_CKPT [--interventions zero mean mask_first mask_random] [--channels 2]
                                            [--val-batches N] [--json]

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

--json prints one object: target, val_batches, val_targets, probe (num_seqs, seq_len), massive {layer (0-indexed),
token (1-indexed), channels, values (mean |h|), mean_values (signed), ratio (top mean |h| / median |h|)}, seconds,
and rows {name: {ppl, loss, dppl (ppl - the unchanged model's), sink1, alpha1, sink1_star (operations without row
normalisation)}}. User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from sinklab.errors import UserError
from sinklab.measure import OneLineParser, command_main, pick_device
from sinklab.model.masks import MaskMod, and_masks
from sinklab.probe_inputs import (checkpoint_and_run_dir, positive, probe_tokens, read_run_data,
                                   val_blocks)

PROG = "sinklab eval intervene"
INTERVENTIONS = ("zero", "mean", "mask_first", "mask_random")


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="a run dir or a checkpoint inside one (its data gives the validation blocks and "
                                   "the probe set)")
    ap.add_argument("--interventions", nargs="+", default=list(INTERVENTIONS), choices=INTERVENTIONS, metavar="NAME",
                    help=f"which to run, besides the unchanged model (default: all of {', '.join(INTERVENTIONS)})")
    ap.add_argument("--channels", type=int, default=2, help="massive channels to set (default 2)")
    ap.add_argument("--val-batches", type=int, default=None, help="validation batches (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="the random keys of mask_random (default 0)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--json", action="store_true", help="print one JSON object (see the module docstring)")
    return ap


# ------------------------------------------------------------------------------------------------ interventions
@contextlib.contextmanager
def extra_mask(model, mod: MaskMod) -> Iterator[None]:
    """Inside the block every query also obeys `mod` (a key dropped): composed with the model's mask, and the fused
    kernels' is_causal shortcut off so that the mask is applied."""
    saved = model.mask_mod, model.plain_causal
    model.mask_mod, model.plain_causal = and_masks(saved[0], mod), False
    try:
        yield
    finally:
        model.mask_mod, model.plain_causal = saved


def drop_first_key(first: int) -> MaskMod:
    """Queries after position `first` (the first text token) do not see its key."""
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx != first) | (q_idx == first)
    return mask


def drop_random_key(first: int, n_pos: int, seed: int, device) -> MaskMod:
    """Each query q >= first + 2 does not see one key drawn uniformly from first + 1 .. q - 1 (neither the first
    token nor itself); earlier queries see all their keys."""
    g = torch.Generator().manual_seed(seed)
    dropped = torch.full((n_pos,), -1, dtype=torch.long)
    for q in range(first + 2, n_pos):
        dropped[q] = int(torch.randint(first + 1, q, (1,), generator=g))
    dropped = dropped.to(device)

    def mask(b, h, q_idx, kv_idx):
        return kv_idx != dropped[q_idx]
    return mask


@contextlib.contextmanager
def set_activations(model, layer: int, position: int, channels: list[int], values: torch.Tensor) -> Iterator[None]:
    """Inside the block, the output of `layer` has h[:, position, channels] = values (one per channel); `position`
    is a sequence position (learned sink tokens first)."""
    def hook(_module, _inputs, output):
        x, probs = output
        x = x.clone()
        x[:, position, channels] = values.to(x.dtype)
        return x, probs

    handle = model.blocks[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def find_massive(model, tokens: torch.Tensor, n_channels: int, batch_size: int = 32) -> dict:
    """The massive activations of the probe set (see the module docstring): layer, token (1-indexed), channels, their
    mean |h| and mean signed value, and the top mean |h| over the median |h| of that layer."""
    S = model.cfg.n_sink_tokens
    abs_sum, signed_sum, medians = None, None, None
    for start in range(0, tokens.shape[0], batch_size):
        records: list[dict] = []
        model(tokens[start:start + batch_size], records=records)
        h = torch.stack([r["h"][:, S:].float() for r in records], 1)  # (B, L, T, d)
        a, sg = h.abs().sum(0), h.sum(0)  # (L, T, d)
        med = h.abs().flatten(2).median(-1).values.sum(0)  # (L,)
        abs_sum = a if abs_sum is None else abs_sum + a
        signed_sum = sg if signed_sum is None else signed_sum + sg
        medians = med if medians is None else medians + med
    n = tokens.shape[0]
    mean_abs, mean_signed, median = abs_sum / n, signed_sum / n, medians / n
    top = mean_abs.flatten(1).max(-1).values  # (L,)
    layer = int(torch.nonzero(top >= 0.5 * top.max())[0])
    token = int(mean_abs[layer].max(-1).values.argmax())
    if not 1 <= n_channels <= mean_abs.shape[-1]:
        raise UserError(f"--channels {n_channels} must be in 1..{mean_abs.shape[-1]} (model.d_model)")
    channels = mean_abs[layer, token].topk(n_channels).indices
    return {"layer": layer, "token": token + 1, "channels": channels.tolist(),
            "values": mean_abs[layer, token, channels].tolist(),
            "mean_values": mean_signed[layer, token, channels].tolist(),
            "ratio": float(top[layer] / median[layer].clamp(min=1e-12))}


def intervention(name: str, model, massive: dict, n_pos: int, seed: int, device) -> contextlib.AbstractContextManager:
    S = model.cfg.n_sink_tokens
    if name in ("zero", "mean"):
        values = torch.tensor(massive["mean_values"]) if name == "mean" else torch.zeros(len(massive["channels"]))
        position = S + massive["token"] - 1  # the token's sequence position, learned sink tokens first
        return set_activations(model, massive["layer"], position, massive["channels"], values.to(device))
    if name == "mask_first":
        return extra_mask(model, drop_first_key(S))
    return extra_mask(model, drop_random_key(S, n_pos, seed, device))


# ----------------------------------------------------------------------------------------------------- main
def evaluate(model, val: list[torch.Tensor], probe: torch.Tensor, names: Sequence[str], massive: dict, seed: int,
             nll: Callable) -> tuple[dict, int]:
    """{name: row} for the unchanged model and each intervention, and the number of scored validation targets."""
    from sinklab.metrics import attention_scores, summarise

    rows, count = {}, 0
    n_pos = model.cfg.n_sink_tokens + max(val[0].shape[1] - 1, probe.shape[1])
    for name in ("none", *names):
        ctx = contextlib.nullcontext() if name == "none" else \
            intervention(name, model, massive, n_pos, seed, probe.device)
        with ctx, torch.no_grad():
            loss, count = nll(val)
            summary = summarise(attention_scores(model, probe, k=1))
        rows[name] = {"loss": loss, "ppl": math.exp(loss), "sink1": summary["sink1"], "alpha1": summary["alpha1"]}
        if "sink1_star" in summary:
            rows[name]["sink1_star"] = summary["sink1_star"]
    for row in rows.values():
        row["dppl"] = row["ppl"] - rows["none"]["ppl"]
    return rows, count


def run(args) -> dict:
    from sinklab.checkpoint import load_model
    from sinklab.quant.fake import mean_nll

    positive("--val-batches", args.val_batches)
    device = pick_device(args.device)
    t0 = time.perf_counter()
    ckpt, run_dir = checkpoint_and_run_dir(args.target)
    if run_dir is None:
        raise UserError(f"{args.target} has no run config (.hydra/config.yaml): intervene reads the run's validation "
                        "blocks and probe set; pass a run dir or a checkpoint inside one")
    model = load_model(ckpt).to(device).eval()
    val = read_run_data(Path(run_dir), {"num_workers": 0}, lambda dm: val_blocks(dm, args.val_batches),
                        "TARGET", "the validation blocks", "check the run's data config")
    val = [b.to(device) for b in val]
    probe = probe_tokens(Path(run_dir), None, None).to(device)
    massive = find_massive(model, probe, args.channels)
    rows, count = evaluate(model, val, probe, list(dict.fromkeys(args.interventions)), massive, args.seed,
                    lambda batches: mean_nll(model, batches, model.cfg.prefix_len))
    return {"target": str(ckpt), "val_batches": len(val), "val_targets": count,
            "probe": {"num_seqs": int(probe.shape[0]), "seq_len": int(probe.shape[1])}, "massive": massive,
            "rows": rows, "seconds": round(time.perf_counter() - t0, 3)}


def format_table(res: dict) -> str:
    m = res["massive"]
    chans = ", ".join(f"{c} ({v:.2f}, mean {s:+.2f})" for c, v, s in zip(m["channels"], m["values"], m["mean_values"]))
    star = any("sink1_star" in r for r in res["rows"].values())
    lines = [f"{res['target']}: {res['val_batches']} validation batches, probe set {res['probe']['num_seqs']} x "
             f"{res['probe']['seq_len']}",
             f"massive activations: layer {m['layer'] + 1}, token {m['token']}, channels {chans}; top / median "
             f"{m['ratio']:.1f}", "",
             f"{'intervention':<13}{'val ppl':>10}{'d ppl':>10}{'Sink_1 %':>10}{'alpha_1':>9}"
             + (f"{'Sink*_1 %':>11}" if star else "")]
    for name, r in res["rows"].items():
        lines.append(f"{name:<13}{r['ppl']:>10.3f}{r['dppl']:>+10.3f}{r['sink1']:>10.2f}{r['alpha1']:>9.3f}"
                     + (f"{r['sink1_star']:>11.2f}" if star else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
