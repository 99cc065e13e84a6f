"""sinklab eval streaming: perplexity over a long text fed one token at a time through a KV cache of the first x + the
y most recent tokens (StreamingLLM, Xiao et al. 2024, arXiv 2309.17453), for a grid of x and y, with the paper's
baselines: dense attention and sliding window with re-computation.

    sinklab eval streaming RUN_DIR_OR_CKPT [--first 0,1,4] [--recent 16,32,60] [--n-tokens 10000] [--json]
    sinklab eval streaming CKPT --data RUN_DIR | --tokens FILE.npy      (another run's text, or one text (N,))
    sinklab eval streaming --hf-model NAME_OR_DIR (--data RUN_DIR | --tokens FILE.npy)   (a transformers RoPE model)
    ... [--baselines dense,recompute | none] [--window L,...] [--bucket 256] [--plot FILE.png]
    ... [--policies h2o,snapkv,... --budgets 32,60]   (other cache policies, sinklab.model.cache_policies)
    sinklab eval streaming --sweep SWEEP_DIR [--jobs 0 1 ...] [options]   (every finished job of a sweep, one CSV)

Text: the first --n-tokens tokens (default 10000) of the run's validation split, contiguous (documents joined by the
separator), with the BOS token first when the run's data uses one (data.bos); or a 1-D token file (all of it unless
--n-tokens). Positions are re-indexed inside the cache (`sinklab.evals.streaming_ppl`, which says what the paper does
and what is decided here, e.g. that y counts the token being fed, so x + y <= the context). transformers models use
their own DynamicCache, evicted and re-rotated after each step (`sinklab.targets.transformers_cache`, which says what is refused:
learned absolute positions, GPT-2 and OPT).

--json prints one object: target, source ("sinklab" | "hf"), data ("run" | "tokens"), text (where it comes from),
n_tokens, targets (n_tokens - 1 scored predictions), context, bucket, bucket_ends (the last target position of each
bucket), notes [...], seconds, and settings [{name, kind ("streaming" | "policy" | "dense" | "recompute"), first,
recent, policy and budget (kind "policy"), keys
(the most keys a prediction attends to), loss, ppl, bpb, bucket_ppl [...], seconds}]. bpb: bits per byte of the
text (the loss over ln 2 x the bytes of text per target, the run's tokenizer decoding the N - 1 targets once:
`sinklab.model.lm_loss`), null with --tokens (no tokenizer to decode them with). --sweep SWEEP_DIR writes that
object into JOB/streaming.json for every finished job, then SWEEP_DIR/streaming.csv, one row per job (its columns:
`sinklab.evals.streaming_ppl.StreamingPerplexity`). User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from sinklab.cli.base import (OneLineParser, add_device_json_args, add_sweep_args, add_target_args, check_data_args,
                              check_one_target, command_main, data_run_dir, int_list, load_checked_target, name_list,
                              refuse_prefix_lm)
from sinklab.errors import UserError
from sinklab.io import check_output_file
from sinklab.evals import streaming_ppl as pp
from sinklab.model.lm_loss import bits_per_byte, bytes_per_token, perplexity
from sinklab.targets import Target
from sinklab.targets.interface import model_title
from sinklab.analysis.probe_inputs import load_tokens, positive
from sinklab.runs.run_data import read_run_data

PROG = "sinklab eval streaming"
DEFAULT_N_TOKENS = 10_000
BASELINES = ("dense", "recompute")


def baseline_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in BASELINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown baseline {(bad or [''])[0]!r}; allowed: "
                                         f"{', '.join(BASELINES)} (comma-separated) or none")
    return list(dict.fromkeys(names))


def build_parser() -> OneLineParser:
    from sinklab.model.cache_policies import CACHE_POLICIES

    ap = OneLineParser(prog=PROG, description="Perplexity over a long text fed one token at a time through a KV cache "
                                              "that keeps the first x and the y most recent tokens (StreamingLLM), "
                                              "positions re-indexed inside the cache; with dense attention and "
                                              "sliding-window recomputation as baselines.")
    add_target_args(ap, "its validation text",
                    "evaluate a transformers RoPE model instead (LLaMA, Mistral, Qwen, Gemma, OLMo, Phi-3, "
                    "GPT-NeoX, gpt-oss, ...; partial rotary and sliding windows too)")
    ap.add_argument("--data", metavar="RUN_DIR", default=None,
                    help="read the text from this run's validation split (default: TARGET's run dir)")
    ap.add_argument("--tokens", metavar="FILE.npy", default=None, help="evaluate this text instead: ids of shape (N,)")
    ap.add_argument("--n-tokens", type=int, default=None,
                    help=f"tokens of text (default {DEFAULT_N_TOKENS:,} of the run's text; all of --tokens)")
    ap.add_argument("--first", type=int_list, default=[0, 1, 4], metavar="X,...",
                    help="first tokens kept in the cache (the attention sinks), comma-separated (default 0,1,4)")
    ap.add_argument("--recent", type=int_list, default=None, metavar="Y,...",
                    help="most recent tokens kept, the one being fed included, comma-separated; x + y <= the model "
                         "context (default: the context minus the largest x)")
    ap.add_argument("--baselines", type=baseline_list, default=list(BASELINES), metavar="B,...",
                    help="dense (a cache that never evicts, past the context) and/or recompute (each token from the "
                         "last `context` tokens recomputed), or none (default dense,recompute)")
    ap.add_argument("--window", type=int_list, default=None, metavar="L,...",
                    help="the recompute baseline's windows: each token predicted from the last L tokens recomputed "
                         "(default: the model context; the paper compares with L = the cache's x + y)")
    ap.add_argument("--policies", type=name_list("cache policies, e.g. h2o,snapkv"), default=[], metavar="P,...",
                    help=f"cache policies to run besides StreamingLLM's x + y, of: {CACHE_POLICIES.allowed()} "
                         "(sinklab.model.cache_policies), each at every --budgets")
    ap.add_argument("--budgets", type=int_list, default=None, metavar="B,...",
                    help="with --policies: text keys kept between steps (default: the context - 1)")
    ap.add_argument("--bucket", type=int, default=256, help="targets per position bucket of the plot (default 256)")
    ap.add_argument("--batch-size", type=int, default=32, help="windows per forward of the recompute baseline")
    ap.add_argument("--plot", metavar="FILE.png", default=None, help="draw perplexity vs position, one line a setting")
    add_sweep_args(ap, "streaming")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- inputs
def choose_text(args, vocab_size: int, run_dir: Optional[Path]) -> tuple[torch.Tensor, str, str, Optional[float]]:
    """(tokens (N,), "run" | "tokens", where the text comes from, in words, the bytes of text per target tokens[1:]
    (None for --tokens, which come without a tokenizer))."""
    if args.tokens is not None:
        tokens = load_tokens(args.tokens, vocab_size, flat=True)
        if args.n_tokens is not None and args.n_tokens > tokens.shape[0]:
            raise UserError(f"--n-tokens {args.n_tokens} exceeds the {tokens.shape[0]} tokens of --tokens "
                            f"{args.tokens}")
        return tokens[:args.n_tokens], "tokens", f"--tokens {args.tokens}", None
    run, flag = data_run_dir(args, run_dir)
    n = args.n_tokens or DEFAULT_N_TOKENS

    def read(dm):  # the text, whether it starts with a BOS, and the bytes of its targets (text[1:])
        text = dm.val_text(n)
        return text, bool(dm.config.bos), dm.text_bytes([text[1:].tolist()], "the validation text")[0]

    text, bos, n_bytes = read_run_data(run, {"num_workers": 0}, read, flag, "the validation text",
                                       "pass --tokens FILE.npy (one text of shape (N,))")
    top = int(text.max())
    if top >= vocab_size:
        raise UserError(f"{flag} {run}: the text has token id {top}, the model's vocabulary is "
                        f"[0, {vocab_size - 1}] (was the model trained on this data?)")
    return (text, "run", f"the first {n:,} tokens of {run}'s validation split" + (" (BOS first)" if bos else ""),
            bytes_per_token(n_bytes, text.shape[0] - 1))


def grid(args, context: Optional[int]) -> list[tuple[int, int]]:
    """The (x, y) settings, checked against the model context (None: the config has none)."""
    recent = args.recent
    if recent is None:
        if context is None:
            raise UserError("the model config has no context length: pass --recent Y,...")
        recent = [context - max(args.first)]
        if recent[0] < 2:
            raise UserError(f"--first {max(args.first)} leaves {recent[0]} recent tokens in the model context "
                            f"{context}; allowed: x <= {context - 2}")
    for y in recent:
        if y < 2:
            raise UserError(f"--recent {y}: allowed: >= 2 (the token being fed and at least one before it)")
    for x in args.first:
        for y in recent:
            if context is not None and x + y > context:
                raise UserError(f"--first {x} --recent {y}: x + y = {x + y} exceeds the model context {context}; "
                                f"allowed: x + y <= {context}")
    return [(x, y) for x in args.first for y in recent]


def recompute_windows(args, context: Optional[int]) -> list[int]:
    """The recompute baseline's windows L (--window, default the model context; [] without one or the baseline),
    checked against the model context before any work."""
    if args.window is not None and "recompute" not in args.baselines:
        raise UserError("--window goes with the recompute baseline: --baselines recompute (or dense,recompute)")
    if "recompute" not in args.baselines:
        return []
    for w in args.window or []:
        if w < 2 or (context is not None and w > context):
            raise UserError(f"--window {w}: allowed: 2 <= L <= {context if context is not None else 'the context'} "
                            "(the model context: a window is recomputed in one forward)")
    return args.window or ([context] if context is not None else [])


def policy_settings(args, context: Optional[int]) -> list:
    """--policies x --budgets as built cache policies (a bad name or budget: one line, before any work)."""
    from sinklab.model.cache_policies import build

    if not args.policies:
        if args.budgets is not None:
            raise UserError("--budgets goes with --policies P,...")
        return []
    budgets = args.budgets or ([context - 1] if context else None)
    if budgets is None:
        raise UserError("the model config has no context length: pass --budgets B,...")
    out = []
    for name in args.policies:
        for b in budgets:
            policy = build(name, b)
            policy.check(context)
            out.append(policy)
    return out


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_one_target(args)
    for name, value in (("--n-tokens", args.n_tokens), ("--bucket", args.bucket), ("--batch-size", args.batch_size)):
        positive(name, value)
    if args.plot is not None:
        check_output_file("--plot", args.plot, (".png",))
    if args.n_tokens is not None and args.n_tokens < 2:
        raise UserError(f"--n-tokens {args.n_tokens}: allowed: >= 2 (a token and the next one to predict)")
    check_data_args(args)
    target, device, t0 = load_checked_target(args)
    meta = target.meta
    refuse_prefix_lm(meta, "stream")
    settings = grid(args, meta.context)
    policies = policy_settings(args, meta.context)
    windows = recompute_windows(args, meta.context)
    tokens, kind, where, per_token = choose_text(args, meta.vocab_size, meta.run_dir)
    target.check_stream()  # refuse what cannot be re-rotated before any work
    tokens = tokens.to(device)
    res = {**meta.head(), "data": kind, "text": where,
           "n_tokens": int(tokens.shape[0]), "targets": int(tokens.shape[0] - 1), "context": meta.context,
           "bucket": args.bucket, "notes": [], "settings": []}
    res["bucket_ends"] = pp.bucket_ends(res["targets"], args.bucket)
    if settings:
        res["notes"] += target.stream_notes()
    runs = [(f"x={x} y={y}", "streaming", {"first": x, "recent": y, "keys": min(x + y, res["targets"])})
            for x, y in settings]
    runs += [(f"{p.name} budget={p.budget}", "policy", {"first": None, "recent": None, "keys": p.budget + 1,
                                                       "policy": p.name, "budget": p.budget, "_policy": p})
             for p in policies]
    if "dense" in args.baselines:
        skip = target.dense_limit(tokens.shape[0])
        if skip:
            res["notes"].append(f"dense: skipped: {skip}")
        else:
            runs.append(("dense", "dense", {"first": None, "recent": None, "keys": res["targets"]}))
    if "recompute" in args.baselines:
        if not windows:
            res["notes"].append("recompute: skipped: the model config has no context length (pass --window L)")
        runs += [(f"recompute {w}", "recompute", {"first": None, "recent": None, "keys": w}) for w in windows]
    with torch.no_grad():
        for name, kind, extra in runs:
            scored = score(args, name, kind, tokens, target, extra, res["bucket_ends"])
            extra = {k: v for k, v in extra.items() if not k.startswith("_")}
            res["settings"].append({"name": name, "kind": kind, **extra, **scored,
                                    "bpb": bits_per_byte(scored["loss"], per_token)})
    if args.plot:
        res["plot"] = str(plot(res, args.plot))
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def score(args, name: str, kind: str, tokens: torch.Tensor, target: Target, extra: dict, ends: list[int]) -> dict:
    """One setting's loss and perplexity, overall and per bucket, with a progress bar on stderr (off with --json or
    when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=tokens.shape[0] - 1, desc=name, unit="tok", leave=False, file=sys.stderr,
               disable=args.json or not sys.stderr.isatty())
    t0 = time.perf_counter()
    try:
        if kind == "recompute":
            nll = pp.recompute_nll(target, tokens, extra["keys"], args.batch_size, bar.update)
        elif kind == "policy":
            decoder = target.decoder(extra["_policy"])
            nll = pp.stream_nll(lambda tok: decoder(tok)[:, -1], tokens, bar.update)
        else:
            nll = pp.stream_nll(target.stream(extra["first"], extra["recent"]), tokens, bar.update)
    finally:
        bar.close()
    loss = float(nll.double().mean())
    return {"loss": loss, "ppl": perplexity(loss), "bucket_ppl": pp.bucket_ppl(nll, ends),
            "seconds": round(time.perf_counter() - t0, 3)}


def plot(res: dict, path: str) -> Path:
    """Perplexity per position bucket, one line a setting (the baselines dashed), log y; the context marked."""
    from matplotlib.figure import Figure

    from sinklab.io import atomic_write

    fig = Figure(figsize=(8.0, 4.8), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    colors = iter(f"C{i}" for i in range(100))
    for s in res["settings"]:
        baseline = s["kind"] in ("dense", "recompute")
        ax.plot(res["bucket_ends"], s["bucket_ppl"], lw=1.6 if baseline else 1.2, ls="--" if baseline else "-",
                color={"dense": "0.45", "recompute": "black"}.get(s["kind"]) or next(colors),
                label=f"{s['name']} ({s['ppl']:.2f})")
    if res["context"]:
        ax.axvline(res["context"], color="grey", lw=0.8, ls=":", label=f"context {res['context']}")
    ax.set_yscale("log")
    ax.set_xlabel(f"position in the text (end of each bucket of {res['bucket']} targets)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"streaming perplexity, first x + recent y tokens: {'/'.join(Path(res['target']).parts[-3:])}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    try:
        return atomic_write(path, lambda fh: fig.savefig(fh, format="png"))
    except OSError as err:
        raise UserError(f"--plot {path}: cannot write it ({err.strerror or err})") from None


def format_table(res: dict) -> str:
    import pandas as pd

    rows = [{"setting": s["name"], "first x": s["first"] if s["first"] is not None else "-",
             "recent y": s["recent"] if s["recent"] is not None else "-", "keys": s["keys"], "ppl": s["ppl"],
             **({"bpb": s["bpb"]} if s.get("bpb") is not None else {}),
             f"ppl 1st {res['bucket']}": s["bucket_ppl"][0], f"ppl last {res['bucket']}": s["bucket_ppl"][-1],
             "seconds": s["seconds"]} for s in res["settings"]]
    three = lambda v: f"{v:.3f}"  # noqa: E731
    lines = [f"{model_title(res)}, context {res['context']}",
             f"text: {res['text']}; {res['targets']:,} targets, fed one token at a time",
             "", pd.DataFrame(rows).to_string(index=False, float_format=three) if rows else "(no settings)"]
    streaming = [s for s in res["settings"] if s["kind"] == "streaming"]
    if len(streaming) > 1:
        pivot = pd.DataFrame(streaming).pivot(index="first", columns="recent", values="ppl")
        pivot.index, pivot.columns = [f"x={v}" for v in pivot.index], [f"y={v}" for v in pivot.columns]
        lines += ["", "perplexity by first x (rows) and recent y (columns):", pivot.to_string(float_format=three)]
    lines += [""] + [f"note: {n}" for n in res["notes"]]
    lines += ["keys: the most keys a prediction attends to (x + y, the token itself included)"]
    if "plot" in res:
        lines.append(f"plot: {res['plot']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)
