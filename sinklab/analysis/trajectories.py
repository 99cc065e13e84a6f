"""Trajectories: every registered metric (`sinklab.metrics.METRICS`) of a model at many points of its training, the
kept checkpoints of a sinklab run (callbacks.checkpoint.keep) or the revisions of a Hugging Face model (Pythia's
`step143000`, OLMo's `stage1-step1000-tokens4B`) or local checkpoint dirs, as one table keyed by step and tokens
seen, and a plot of chosen metrics against tokens (`sinklab trajectory`, `sinklab.cli.trajectory`).

Each series (a run, a model) reads its input once (a run's probe set through its data config, a model's tokenizer
and text, or random / repeated ids) and measures each of its checkpoints, a `sinklab.targets.Target` of its source, on
exactly those sequences, as `sinklab measure` does; a value is the one the training callback logs under the same
name. A trajectory of N checkpoints costs N loads and N measurements.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from sinklab.runs.checkpoints import TOKENS_SEEN, kept_checkpoints, read_checkpoint
from sinklab.runs.run_data import is_run_dir
from sinklab.analysis.probe_inputs import InputSpec
from sinklab.errors import UserError
from sinklab.targets import TargetSpec, load_target

RUN_KEYS = ("series", "checkpoint", "step", "tokens", "input", "seconds")  # the CSV's first columns
# hub models that publish revisions by step only: training tokens per step (Pythia: 1024 sequences x 2048 tokens)
TOKENS_PER_STEP = {"EleutherAI/pythia-": 2_097_152}
_STEP = re.compile(r"(?:^|[^A-Za-z0-9])(?:step|checkpoint-|ckpt-?|global_step)(\d+)(?![A-Za-z0-9])", re.IGNORECASE)
_TOKENS = re.compile(r"(?:^|[^A-Za-z0-9])tokens(\d+(?:\.\d+)?)([KMBT]?)(?![A-Za-z0-9])", re.IGNORECASE)
_SCALE = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


@dataclass
class Point:
    """One checkpoint of a series: `where` is the file, the local dir or the hub revision; step and tokens seen
    (None where they are not known); `name` and `revision` are what loads it (a checkpoint file, a model id or dir)."""

    where: str
    step: Optional[int]
    tokens: Optional[int]
    name: str = ""
    revision: Optional[str] = None  # a hub revision of the series' model


@dataclass
class Series:
    """A run or a model: its points in order, the source that loads them (a `sinklab.targets.SOURCES` name) and, for
    a run, its dir."""

    label: str
    source: str
    points: list[Point] = field(default_factory=list)
    run_dir: Optional[Path] = None


def parse_revision(name: str, tokens_per_step: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
    """(step, tokens seen) in a revision or dir name: `step143000` (Pythia), `stage1-step1000-tokens4B` (OLMo;
    K, M, B, T suffixes), `checkpoint-500` (transformers' Trainer); tokens = step x tokens_per_step when the name
    has a step only. None for what the name does not say."""
    base = Path(name).name or name
    m_step, m_tok = _STEP.search(base), _TOKENS.search(base)
    step = int(m_step[1]) if m_step else None
    tokens = round(float(m_tok[1]) * _SCALE[m_tok[2].upper()]) if m_tok else None
    if tokens is None and step is not None and tokens_per_step:
        tokens = step * tokens_per_step
    return step, tokens


def known_tokens_per_step(model: str) -> Optional[int]:
    return next((n for prefix, n in TOKENS_PER_STEP.items() if model.startswith(prefix)), None)


def run_series(run_dir: str) -> Series:
    """A training run's kept checkpoints (checkpoints/kept/), then last.ckpt where no kept one has its step."""
    path = Path(run_dir)
    if not is_run_dir(path):
        raise UserError(f"RUN_DIR {run_dir}: not a training run dir (no .hydra/config.yaml); pass a sinklab-train "
                        "output dir, or --hf-model for transformers models")
    points = [Point(str(p), step, tokens, name=str(p)) for step, tokens, p in kept_checkpoints(path)]
    last = path / "checkpoints" / "last.ckpt"
    if last.is_file():
        ckpt = read_checkpoint(last, mmap=True)
        step = ckpt.get("global_step")  # None in a checkpoint written outside training
        if step is None or step not in {p.step for p in points}:
            points.append(Point(str(last), step, ckpt.get(TOKENS_SEEN), name=str(last)))
    if not points:
        raise UserError(f"RUN_DIR {run_dir}: no checkpoints (checkpoints/kept/*.ckpt or last.ckpt); train with "
                        "callbacks.checkpoint.keep.every_n_steps=N to keep some")
    points.sort(key=lambda p: (p.step is None, p.step or 0))
    return Series(str(run_dir), "sinklab", points, run_dir=path)


def hf_series(names: Sequence[str], revisions: Sequence[str], tokens_per_step: Optional[int],
              recorded: Optional[Callable] = None) -> Series:
    """One model at several hub revisions (`--hf-model ID --revision R1 R2 ...`), or several local checkpoint dirs
    of one training (`--hf-model DIR1 DIR2 ...`), in the order given; step and tokens parsed from the names, what
    they do not say taken from `recorded(name, revision) -> (step, tokens)` where given (what a local export
    records: `sinklab.targets.hub_models.recorded_progress`, which also refuses an unknown local revision)."""
    if revisions and len(names) > 1:
        raise UserError(f"--revision {' '.join(revisions)} follows {len(names)} models ({' '.join(names)}); give "
                        "one --hf-model ID per --revision list, e.g. --hf-model A --revision r1 r2 --hf-model B ...")

    def placed(name: str, revision: Optional[str], per_step: Optional[int]) -> tuple[Optional[int], Optional[int]]:
        step, tokens = parse_revision(revision or name, per_step)
        if recorded is not None and (step is None or tokens is None):
            known_step, known_tokens = recorded(name, revision)
            step, tokens = (step if step is not None else known_step), (tokens if tokens is not None else known_tokens)
        return step, tokens

    if revisions:
        per_step = tokens_per_step or known_tokens_per_step(names[0])
        points = [Point(rev, *placed(names[0], rev, per_step), name=names[0], revision=rev) for rev in revisions]
        return Series(names[0], "hf", points)
    points = [Point(name, *placed(name, None, tokens_per_step), name=name) for name in names]
    label = names[0] if len(names) == 1 else f"{Path(names[0]).parent.name or names[0]} ({len(names)} dirs)"
    return Series(label, "hf", points)


def unique_labels(series: Sequence[Series]) -> None:
    """A label given twice (the same run or model named twice) gets its position: `runs/a (2)`."""
    seen: dict[str, int] = {}
    for s in series:
        seen[s.label] = seen.get(s.label, 0) + 1
        if seen[s.label] > 1:
            s.label = f"{s.label} ({seen[s.label]})"


# ----------------------------------------------------------------------------------------------- measuring
def logged_values(metrics) -> dict[str, float]:
    """Every measured metric's logged scalars (the names the training callback logs)."""
    out: dict[str, float] = {}
    for metric in metrics:
        out.update(metric.log(metric.result()))
    return out


def measure_series(series: Series, inputs: InputSpec, device, on_point: Callable, dtype="auto",
                   eps: Sequence[float] = (0.3,), k: int = 4, batch_size: int = 25) -> None:
    """Each point of a series measured on one input, chosen once from its first point (`choose_tokens`: a run's
    probe set by default, text through a transformers model's tokenizer with `inputs.texts`), as `sinklab measure`
    measures one model; on_point(series, point, input name, tokens' shape, logged values, seconds)."""
    from sinklab.analysis.probe_inputs import choose_tokens

    tokens = kind = None
    for point in series.points:
        t0 = time.perf_counter()
        target = load_target(TargetSpec(point.name, series.source, point.revision, dtype, device))
        if tokens is None:
            tokens, kind, _ = choose_tokens(inputs, target)
            kind = "text" if inputs.texts else kind
        with torch.no_grad():
            metrics = target.measure(tokens, eps=eps, k=k, batch_size=batch_size)
        on_point(series, point, kind, tokens.shape, logged_values(metrics), time.perf_counter() - t0)
        del target


# ----------------------------------------------------------------------------------------------- the plot
def x_axis(rows: Sequence[dict]) -> tuple[str, str]:
    """(column, label) of the plot's x: tokens seen when every point has them, else the step, else the order."""
    if rows and all(r.get("tokens") is not None for r in rows):
        return "tokens", "training tokens seen"
    if rows and all(r.get("step") is not None for r in rows):
        return "step", "training step"
    return "order", "checkpoint (in the order given)"


def plot(rows: Sequence[dict], keys: Sequence[str], path: Path) -> tuple[Path, str]:
    """One panel per key (rows: the CSV's records), one line per series, against tokens seen on a log x axis
    (linear around 0 when a point sits at 0: symlog); written atomically to `path` (PNG). Returns (path, the x
    column)."""
    import matplotlib
    from matplotlib.figure import Figure

    from sinklab.io import atomic_write
    from sinklab.report.plots import RC

    xcol, xlabel = x_axis(rows)
    series = list(dict.fromkeys(r["series"] for r in rows))
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(7.5, 1.0 + 2.8 * len(keys)), dpi=130, layout="constrained")
        axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
        positive = [float(r[xcol]) for r in rows if float(r[xcol]) > 0]
        scale, kw = ("log", {}) if len(positive) == len(rows) else ("symlog", {"linthresh": min(positive or [1.0])})
        for ax, key in zip(axes, keys):
            for i, name in enumerate(series):
                pts = sorted((float(r[xcol]), r.get(key)) for r in rows if r["series"] == name)
                pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=4, lw=1.5, color=matplotlib.colormaps["tab10"](i % 10),
                            label=name)
            ax.set_ylabel(key)
            ax.set_xscale(scale, **kw)
            ax.legend(loc="best", fontsize=8, framealpha=0.85)
        axes[-1].set_xlabel(xlabel + {"log": " (log scale)", "symlog": " (log scale, linear around 0)"}.get(scale, ""))
        fig.suptitle(f"{', '.join(keys)} over training")
        atomic_write(path, lambda fh: fig.savefig(fh, format="png"))
    return path, xcol
