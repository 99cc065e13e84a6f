"""sinklab eval retrieval: exact-match accuracy of retrieval (the run's data.retrieval task: a planted passkey, or
MQAR) when the model reads through a KV cache that keeps a budget of keys chosen by a policy, by protocol x policy x
budget x depth (`sinklab.evals.retrieval`, which says what the protocols are).

    sinklab eval retrieval RUN_DIR_OR_CKPT [--policies streaming,window,h2o,snapkv] [--budgets 25%,50%]
        [--protocols prefill,decoding] [--grid depth=0.1,0.5,0.9] [--samples 16] [--length N] [--seed 0]
        [--knob snapkv.window=4 ...] [--plot FILE.png] [--json]
    sinklab eval retrieval --hf-model DIR --data RUN_DIR [options]   (a transformers RoPE model on a run's task)
    sinklab eval retrieval --sweep SWEEP_DIR [--jobs 0 1 ...] [options]   (every finished job, one CSV)

The task, its marker ids and its knobs are the run's (data.retrieval: a model trained with it mixed in); --grid
varies one of its knobs (passkey: depth, where the key sits in the filler; mqar: n_pairs, power_a), each value one
cell of --samples samples (seeded by --seed, the filler from the run's validation split). Samples are --length tokens
(default: the model context + 1, a training block). Budgets are text keys kept between steps: an integer, or a share
of the sample's tokens (25%); dense (no eviction) is always run first, the reference. Policies and their knobs:
`sinklab.model.cache_policies` (`--knob POLICY.KNOB=VALUE`, a number, true / false or a rule's name, e.g.
h2o.recent=0.25, streaming.first=1, snapkv.pooling=sinklab; docs/cache_policies.md says each policy's reference and
where it differs).
A passkey run trained with its question anywhere (data.retrieval.query_at=null) is read with the question at the
sample's end (query_at=1: the prompt before it is the whole sample, as for every other run; `sinklab.evals.retrieval.
read_at_end`); --grid query_at=... varies it.

--json prints one object: target, source, task {task, knobs, chance}, grid {knob, values}, length, n_samples (per
cell), notes, seconds, settings [{protocol, policy, budget, knobs, knobs_used, label, accuracy, loss, first_kept,
key_kept, cells {value: {accuracy, loss, first_kept, key_kept}}}]: knobs, those given; knobs_used, every knob the
policy ran with, its defaults included (SnapKV's pooling rule among them); accuracy, the exact-match share of answer
spans (the mean over the cells); loss, the answer tokens' cross-entropy (nats); first_kept / key_kept, the share of (layer, kv head)
kept sets holding the first text token / the whole key when the question came; heads [{layer, head, alpha_1, retrieval,
streaming}] (per layer x kv head, from dense reads of every sample: `sinklab.evals.retrieval.head_scores`),
heads_rank_correlation (Spearman's rho of alpha_1 and retrieval), sink_heads (alpha_1 > 0.3), sink_heads_retrieval
and other_heads_retrieval (their mean retrieval scores). --sweep writes it into
JOB/retrieval.json for every finished job, then SWEEP_DIR/retrieval.csv (`sinklab.evals.retrieval.Retrieval`'s
columns, each setting's rules among them: prefill_snapkv_b32_pooling). User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from sinklab.cli.base import (OneLineParser, add_device_json_args, add_sweep_args, add_target_args, check_one_target,
                              command_main, data_run_dir, knob_value, load_checked_target, name_list, refuse_prefix_lm)
from sinklab.errors import UserError
from sinklab.io import check_output_file

PROG = "sinklab eval retrieval"
DEFAULT_POLICIES = ("streaming", "window", "h2o", "snapkv")
DEFAULT_GRID = {"passkey": ("depth", [0.1, 0.5, 0.9])}


def budget_list(text: str) -> list[str]:
    """'16,25%' -> ['16', '25%'] (each checked: an integer >= 1, or a share 0% < p < 100%)."""
    out = []
    for v in (v.strip() for v in text.split(",") if v.strip()):
        try:
            ok = 0 < float(v[:-1]) < 100 if v.endswith("%") else int(v) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{v!r}: a budget is an integer >= 1 (keys kept) or a share of the "
                                             "sample such as 25%")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of budgets, e.g. 16,25%")
    return list(dict.fromkeys(out))


def build_parser() -> OneLineParser:
    from sinklab.evals.retrieval import REFERENCE
    from sinklab.model.cache_policies import CACHE_POLICIES, knob_defaults

    ap = OneLineParser(prog=PROG, description="Exact-match retrieval (the run's passkey or MQAR task) through a KV "
                                              "cache that keeps a budget of keys chosen by a policy, at prefill or "
                                              f"while decoding, by depth; {REFERENCE} is the reference.")
    add_target_args(ap, "its retrieval task and validation text",
                    "evaluate a transformers RoPE model instead, on --data RUN_DIR's task (e.g. a run exported with "
                    "`sinklab export-hf`; policies that keep other numbers of keys per layer or head, "
                    f"{CACHE_POLICIES.allowed(lambda c: not c.uniform())}, are sinklab's only)")
    ap.add_argument("--data", metavar="RUN_DIR", default=None,
                    help="the run whose retrieval task and validation text to use (default: TARGET's run dir)")
    ap.add_argument("--policies", type=name_list("names"), default=list(DEFAULT_POLICIES), metavar="P,...",
                    help=f"cache policies besides {REFERENCE}, of: "
                         f"{CACHE_POLICIES.allowed(lambda c: c.name != REFERENCE)} (default {','.join(DEFAULT_POLICIES)}"
                         f"; {CACHE_POLICIES.allowed(lambda c: c.prefill_only)} under the prefill protocol only)")
    ap.add_argument("--budgets", type=budget_list, default=["25%", "50%"], metavar="B,...",
                    help="text keys kept: integers, or shares of the sample's tokens (default 25%%,50%%)")
    ap.add_argument("--protocols", type=name_list("names"), default=["prefill", "decoding"], metavar="P,...",
                    help="prefill (compress the prompt once, then ask) and/or decoding (evict after every token) "
                         "(default both)")
    ap.add_argument("--grid", default=None, metavar="KNOB=V,...",
                    help="one knob of the task over values, a cell each (default passkey: depth=0.1,0.5,0.9; "
                         "mqar: the run's n_pairs)")
    ap.add_argument("--samples", type=int, default=16, help="samples per cell (default 16)")
    ap.add_argument("--length", type=int, default=None, help="tokens per sample (default: the model context + 1)")
    ap.add_argument("--seed", type=int, default=0, help="the samples' seed (default 0)")
    ap.add_argument("--knob", action="append", default=[], metavar="POLICY.KNOB=VALUE",
                    help="a policy's knob, e.g. snapkv.window=4 or snapkv.pooling=sinklab (repeatable)")
    ap.add_argument("--duo-heads", choices=("onthefly", "measured"), default="onthefly",
                    help=f"the retrieval heads of {CACHE_POLICIES.allowed(lambda c: 'heads' in knob_defaults(c))}: "
                         "chosen per prompt by the attention a streaming head would lose "
                         "(onthefly, the default), or the heads with the highest measured retrieval score (the "
                         "per-head table: attention on the key), the same for every prompt")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="accuracy against the grid knob, one line a policy, a panel per protocol x budget")
    add_sweep_args(ap, "retrieval")
    add_device_json_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------- inputs
def parse_grid(text: Optional[str], task) -> tuple[str, list]:
    """--grid KNOB=V,... (or the task's default) -> (knob, values), each value checked by the task's config rule."""
    from sinklab.evals.retrieval import with_knob

    if text is None:
        knob, values = DEFAULT_GRID.get(task.name, (task.KNOBS[0], [task.knobs[task.KNOBS[0]]]))
        return knob, list(values)
    knob, eq, raw = text.partition("=")
    if not eq or not raw.strip():
        raise UserError(f"--grid {text}: allowed: KNOB=V1,V2,... with KNOB one of {', '.join(task.KNOBS)}")
    values = []
    for v in raw.split(","):
        try:
            value = int(v) if v.strip().lstrip("-").isdigit() else float(v)
        except ValueError:
            raise UserError(f"--grid {text}: {v!r} is not a number") from None
        with_knob(task, knob.strip(), value)  # the knob's rule: one line naming it
        values.append(value)
    return knob.strip(), list(dict.fromkeys(values))


def parse_knobs(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict]:
    """--knob POLICY.KNOB=VALUE ... -> {policy: {knob: value}} (numbers as numbers)."""
    out: dict[str, dict] = {}
    for item in items:
        name, eq, value = item.partition("=")
        policy, dot, knob = name.partition(".")
        if not eq or not dot:
            raise UserError(f"--knob {item}: allowed: POLICY.KNOB=VALUE, e.g. snapkv.window=4")
        if policy not in policies:
            raise UserError(f"--knob {item}: policy {policy!r} is not in --policies ({', '.join(policies)})")
        out.setdefault(policy, {})[knob] = knob_value("--knob", item, value)
    return out


def settings(args, length: int):
    """The dense reference, then protocols x policies x budgets, each policy built once here (a bad name, knob or
    budget is one line before any sample is run)."""
    from sinklab.evals.retrieval import PROTOCOLS, REFERENCE, Setting
    from sinklab.model.cache_policies import CACHE_POLICIES

    bad = [p for p in args.protocols if p not in PROTOCOLS]
    if bad:
        raise UserError(f"--protocols {bad[0]}: allowed: {', '.join(PROTOCOLS)}")
    for p in args.policies:
        CACHE_POLICIES.get(p)  # an unknown name: one line with the allowed ones
    knobs = parse_knobs(args.knob, args.policies)
    budgets = []
    for b in args.budgets:
        n = int(float(b[:-1]) / 100 * length) if b.endswith("%") else int(b)
        if not 1 <= n < length - 1:
            raise UserError(f"--budgets {b}: {n} keys; allowed: 1 <= budget < {length - 1} (the sample's "
                            f"{length} tokens, the question's on top)")
        budgets.append(n)
    budgets = list(dict.fromkeys(budgets))
    out = [Setting(p, REFERENCE, None) for p in args.protocols[:1]]  # the reference is the same under both
    for protocol in args.protocols:
        for policy in args.policies:
            for b in budgets:
                s = Setting(protocol, policy, b, knobs.get(policy, {}))
                try:
                    s.make()
                except UserError as err:
                    raise UserError(f"--budgets / --knob: {err}") from None
                if CACHE_POLICIES.get(policy).prefill_only and protocol != "prefill":
                    continue  # a method that compresses once, after the prompt
                out.append(s)
    return out


def load_task(args, run_dir: Optional[Path], vocab_size: int, length: int, n_text: int):
    """The run's retrieval task and its validation text (the filler): one line for a run trained without one."""
    from sinklab.runs.run_data import read_run_data

    run, flag = data_run_dir(args, run_dir, "pass --data RUN_DIR (a run trained with data.retrieval.task)")

    def read(dm):
        return dm.retrieval_task, dm.val_text(n_text).numpy()

    task, text = read_run_data(run, {"num_workers": 0}, read, flag, "the retrieval task",
                               "train with data.retrieval.task=passkey (or mqar)")
    if task is None:
        raise UserError(f"{flag} {run}: its data has no retrieval task (data.retrieval.task is null); allowed: a "
                        "run trained with data.retrieval.task=passkey or mqar (and data.retrieval.rate > 0)")
    if task.n_ids > vocab_size:
        raise UserError(f"{flag} {run}: the task writes ids up to {task.n_ids - 1}, the model's vocabulary is "
                        f"[0, {vocab_size - 1}] (was the model trained on this data?)")
    task.check(length)
    return task, text


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    import torch

    from sinklab.data.retrieval import make_samples
    from sinklab.evals import retrieval as rv

    check_one_target(args)
    for name, value in (("--samples", args.samples), ("--length", args.length)):
        if value is not None and value < 1:
            raise UserError(f"{name} {value}: allowed: a positive integer")
    if args.plot is not None:
        check_output_file("--plot", args.plot, (".png",))
    target, device, t0 = load_checked_target(args)
    meta = target.meta
    refuse_prefix_lm(meta, "cache")
    if args.length is None and meta.context is None:
        raise UserError("the model config has no context length: pass --length N (tokens per sample)")
    length = args.length or (meta.context + 1)
    if meta.context is not None and length > meta.context + 1:
        raise UserError(f"--length {length}: allowed: <= the model context + 1 = {meta.context + 1} (the last "
                        "token is only predicted)")
    cases = settings(args, length)
    task, text = load_task(args, meta.run_dir, meta.vocab_size, length, max(20_000, 4 * length))
    knob, values = parse_grid(args.grid, task)
    task = rv.read_at_end(task, knob)
    cells = {v: make_samples(rv.with_knob(task, knob, v), args.samples, length, args.seed, text) for v in values}
    budgets = [c.budget for c in cases if c.budget is not None]
    heads = rv.head_scores(target, [x for samples in cells.values() for x in samples],
                           recent=min(budgets) if budgets else 16)
    if args.duo_heads == "measured":  # DuoAttention's retrieval heads: the highest measured retrieval scores
        cases = [rv.measured_duo(c, heads) for c in cases]
    n_runs = len(cases) * len(values) * args.samples
    from tqdm.auto import tqdm

    bar = tqdm(total=n_runs, desc="retrieval", unit="sample", leave=False, file=sys.stderr,
               disable=args.json or not sys.stderr.isatty())
    try:
        with torch.no_grad():
            results = rv.evaluate(target, cells, cases, bar.update)
    finally:
        bar.close()
    res = {**meta.head(), "task": task.describe(), "chance": task.chance(),
           "grid": {"knob": knob, "values": values}, "length": length, "context": meta.context,
           "n_samples": args.samples, "seed": args.seed, "notes": target.stream_notes(), "settings": results,
           "heads": heads, "heads_rank_correlation": rank_correlation(heads), **rv.heads_by_sink(heads)}
    if args.plot:
        res["plot"] = str(plot(res, args.plot))
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def plot(res: dict, path: str) -> Path:
    """Accuracy against the grid knob, one line a policy (dense dashed), a panel per protocol x budget; chance
    dotted."""
    from matplotlib.figure import Figure

    from sinklab.io import atomic_write

    from sinklab.evals.retrieval import REFERENCE

    dense = [s for s in res["settings"] if s["policy"] == REFERENCE]
    panels = list(dict.fromkeys((s["protocol"], s["budget"]) for s in res["settings"] if s["policy"] != REFERENCE))
    heads = res.get("heads") or []
    n_axes = max(1, len(panels)) + bool(heads)
    fig = Figure(figsize=(3.6 * n_axes, 3.4), dpi=150, layout="constrained")
    axes = fig.subplots(1, n_axes, squeeze=False)[0]
    if heads:  # are sink heads the streaming heads? alpha_1 against the retrieval score, a point per head
        ax, axes = axes[-1], axes[:-1]
        points = ax.scatter([h["alpha_1"] for h in heads], [h["retrieval"] for h in heads],
                            c=[h["layer"] for h in heads], cmap="viridis", s=14)
        fig.colorbar(points, ax=ax, label="layer")
        ax.set_xlabel("alpha_1 (attention on token 1)")
        ax.set_ylabel("retrieval score (attention on the key)")
        ax.set_title("heads (dense)", fontsize=9)
        ax.grid(True, alpha=0.3)
    xs = res["grid"]["values"]
    for ax, (protocol, budget) in zip(axes, panels or [("prefill", None)]):
        for s in dense:
            ax.plot(xs, [cell(s, v)["accuracy"] for v in xs], ls="--", color="0.45", label=REFERENCE)
        for s in res["settings"]:
            if (s["protocol"], s["budget"]) == (protocol, budget) and s["policy"] != REFERENCE:
                ax.plot(xs, [cell(s, v)["accuracy"] for v in xs], marker="o", ms=3, label=s["policy"])
        ax.axhline(res["chance"], color="grey", ls=":", lw=0.8, label="chance")
        ax.set_title(f"{protocol}, budget {budget}", fontsize=9)
        ax.set_xlabel(res["grid"]["knob"])
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("exact-match accuracy")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"retrieval ({res['task']['task']}) under KV-cache eviction: "
                 f"{'/'.join(Path(res['target']).parts[-3:])}", fontsize=9)
    try:
        return atomic_write(path, lambda fh: fig.savefig(fh, format="png"))
    except OSError as err:
        raise UserError(f"--plot {path}: cannot write it ({err.strerror or err})") from None


def rank_correlation(heads: list[dict]) -> Optional[float]:
    """Spearman's rho between the heads' alpha_1 and their retrieval score (None with fewer than 3 heads or a
    constant column)."""
    from sinklab.stats import spearman

    return spearman([h["alpha_1"] for h in heads], [h["retrieval"] for h in heads])


def cell(setting: dict, value) -> dict:
    """A setting's cell for a grid value (its key is the value, or its string after JSON)."""
    cells = setting["cells"]
    return cells[value] if value in cells else cells[str(value)]


def format_table(res: dict) -> str:
    import pandas as pd

    from sinklab.evals.retrieval import REFERENCE
    from sinklab.targets.interface import model_title

    knob, values = res["grid"]["knob"], res["grid"]["values"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rows = [{"protocol": s["protocol"] if s["policy"] != REFERENCE else "-", "policy": s["policy"],
             "budget": s["budget"] if s["budget"] is not None else "-",
             **{f"{knob}={v}": pct(cell(s, v)["accuracy"]) for v in values}, "mean": pct(s["accuracy"]),
             "answer loss": f"{s['loss']:.3f}", "token 1 kept": pct(s["first_kept"]), "key kept": pct(s["key_kept"])}
            for s in res["settings"]]
    task = res["task"]
    knobs = ", ".join(f"{k} {v}" for k, v in task.items() if k not in ("task", "chance", "key_id", "query_id"))
    lines = [f"{model_title(res)}, context {res['context']}",
             f"task {task['task']} ({knobs}); {res['n_samples']} samples of {res['length']} tokens per {knob}; "
             f"chance {100 * res['chance']:.4g}%",
             "", pd.DataFrame(rows).to_string(index=False)]
    lines += ["", "budget: text keys kept between steps (the token fed on top); token 1 kept / key kept: the share "
                  "of (layer, kv head) kept sets holding the first token / the whole key when the question came"]
    heads = res.get("heads") or []
    if heads:
        top = ", ".join("L{layer}H{head}".format(**h) for h in sorted(heads, key=lambda h: -h["retrieval"])[:4])
        rho = res.get("heads_rank_correlation")
        recent = min((s["budget"] for s in res["settings"] if s["budget"]), default=16)
        lines += ["", f"heads (dense, per layer x kv head; streaming: the attention outside the first 4 + the "
                      f"recent {recent} keys):",
                  pd.DataFrame(heads).to_string(index=False, float_format=lambda v: f"{v:.3f}"),
                  f"top retrieval heads: {top}; Spearman rho(alpha_1, retrieval) = "
                  + ("-" if rho is None else f"{rho:.2f}")]
    lines += [f"note: {n}" for n in res["notes"]]
    if "plot" in res:
        lines.append(f"plot: {res['plot']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main(PROG, build_parser(), run, format_table, argv)
