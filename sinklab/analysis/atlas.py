"""The attention atlas (`sinklab atlas`, `sinklab.cli.atlas`; the training summary's "atlas: ..."): one self-contained
HTML file with every head's attention map, an L x H grid of thumbnails coloured by a per-head value (alpha_1 by
default, or any layer x head grid a registered metric gives), a head's full map with the probe tokens on its axes and
its values beside it, and a slider over a run's kept checkpoints.

Each checkpoint is a `Frame`: the registered metrics measured on the probe input as `sinklab measure` measures them
(the per-head grids of their `measure --json` parts, `sinklab.metrics.base.json_grids`, e.g. `sink/alpha`: alpha_1),
and in the same forwards the whole map of the first probe sequence (`FirstMap`). The page needs no network: its data
(maps as uint8 in [lo, hi], zlib-compressed and base64-encoded; values in 4 significant digits) and its script are
inline, and the browser's own DecompressionStream inflates the maps (Chromium 80, Firefox 113, Safari 16.4).
"""
from __future__ import annotations

import base64
import json
import math
import time
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sinklab.analysis.probe_inputs import InputSpec, choose_tokens
from sinklab.errors import UserError
from sinklab.metrics import METRICS, Metric
from sinklab.metrics.base import json_grids
from sinklab.targets import Target, TargetSpec, load_target

DEFAULT_METRIC = "sink/alpha"  # alpha_1 per head: the sink metric's `alpha` grid
DATA_MARK = "/*ATLAS_DATA*/"  # where the template takes the data
LEVELS = 255  # a map value is stored as one byte: round((a - lo) / (hi - lo) * LEVELS)


class FirstMap(Metric):
    """Not registered: the whole attention map of the first sequence measured, (L, H, T, n_extra + T) with the extra
    key columns (bias slot, sink tokens) first, kept from the first batch's chunks."""

    name = "first_map"
    records = frozenset({"maps"})

    def __init__(self, ctx):
        super().__init__(ctx)
        self.map: Optional[np.ndarray] = None
        self.done = False

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        if self.done:
            return
        if self.map is None:
            T = maps.shape[-1] - self.ctx.n_extra
            self.map = np.zeros((self.ctx.n_layer, self.ctx.n_head, T, maps.shape[-1]), np.float32)
        self.map[layer][:, rows.cpu().numpy()] = maps[0].float().cpu().numpy()  # (H, R, n_extra + T)

    def end_batch(self) -> None:
        self.done = self.map is not None

    def result(self) -> dict[str, Any]:
        return {"map": self.map}


@dataclass
class Frame:
    """One checkpoint of the atlas: its label, step and tokens seen (None where not known), the first sequence's map
    (L, H, T, n_extra + T) and the per-head grids {name: [[value per head] per layer]} (None: not finite)."""

    label: str
    map: np.ndarray
    values: dict[str, list]
    step: Optional[int] = None
    tokens: Optional[int] = None
    where: str = ""


@dataclass
class Atlas:
    """What the page shows: the frames (one per checkpoint, in training order), the axis labels of the map (`keys`:
    the extra key columns, then the tokens; `queries`: the tokens), the model and input in words, the metric shown
    first and a note (e.g. why there is no slider)."""

    title: str
    frames: list[Frame]
    queries: list[str]
    keys: list[str]
    input: str
    metric: str = DEFAULT_METRIC
    note: Optional[str] = None
    model: str = ""  # the model in a few words (`model_words`)

    @property
    def metrics(self) -> list[str]:
        """Every per-head grid some frame has, in the order they were measured."""
        return list(dict.fromkeys(name for f in self.frames for name in f.values))


# ----------------------------------------------------------------------------------------------------- measuring
def head_grids(metrics: Sequence[Metric], n_layer: int, n_head: int) -> dict[str, list]:
    """Every layer x head grid of the measured metrics' `measure --json` parts, named `<metric>/<path>`
    (`json_grids`), values in 4 significant digits, non-finite ones None."""
    grids: dict[str, list] = {}
    for metric in metrics:
        for path, grid in json_grids(metric.json(metric.result()), n_layer, n_head).items():
            name = f"{metric.name}/{path}" if path else metric.name
            grids[name] = [[None if v is None or not math.isfinite(v) else float(f"{v:.4g}") for v in row]
                           for row in grid]
    return grids


@torch.no_grad()
def measure_frame(target: Target, tokens: torch.Tensor, label: str, names: Optional[Sequence[str]] = None,
                  eps: Sequence[float] = (0.3,), k: int = 4, batch_size: int = 25) -> Frame:
    """`target` on tokens (N, T): the registered metrics `names` (default all that apply) and the first sequence's
    map, in the same forwards."""
    *metrics, first = target.measure(tokens, names, eps, k, batch_size, also=(FirstMap,))
    return Frame(label, first.result()["map"], head_grids(metrics, first.ctx.n_layer, first.ctx.n_head))


def checkpoint_label(step: Optional[int], tokens: Optional[int], where: str) -> str:
    """A frame's name on the slider: `step 400 (409,600 tokens)`, else the file's name."""
    if step is None:
        return Path(where).name or where
    return f"step {step}" + (f" ({tokens:,} tokens)" if tokens is not None else "")


def model_words(model: dict) -> str:
    """The model's description (`TargetMeta.model`) in a few words for the page's header: what is set (the layer and
    head counts are the grid's; a gate's activation only with a gate)."""
    shown = {k: v for k, v in model.items() if k not in ("n_layer", "n_head") and v not in (None, False, 0, "", "none")}
    if not shown.get("gate"):
        shown.pop("gate_act", None)
    return ", ".join(f"{k} {v}" for k, v in shown.items())


def key_labels(n_extra: int, slot_names: Sequence[str], texts: Sequence[str]) -> list[str]:
    """The map's columns: the extra keys by name in brackets ([bias], [token0], [sink_logit]), then the tokens."""
    names = list(slot_names) if len(slot_names) == n_extra else [f"extra{i}" for i in range(n_extra)]
    return [f"[{n}]" for n in names] + list(texts)


def check_metric(metric: str) -> None:
    """--metric names a grid of a registered metric: `<metric>[/<path>]`, checked before anything is measured (the
    path is checked against what the first checkpoint gives)."""
    if metric.split("/", 1)[0] not in METRICS.names():
        raise UserError(f"--metric {metric}: no registered metric {metric.split('/', 1)[0]!r}; allowed: "
                        f"{DEFAULT_METRIC} (alpha_1) or a per-head grid <metric>/<path> of one of "
                        f"{', '.join(METRICS.names())}")


def check_grid(metric: str, frame: Frame) -> None:
    if metric not in frame.values:
        raise UserError(f"--metric {metric}: not a per-head grid of this model; allowed: "
                        f"{', '.join(frame.values)}")


def build_atlas(title: str, specs: Sequence[tuple[TargetSpec, Optional[int], Optional[int]]], inputs: InputSpec,
                metric: str = DEFAULT_METRIC, eps: Sequence[float] = (0.3,), k: int = 4, batch_size: int = 25,
                note: Optional[str] = None, on_frame: Optional[Callable[[Frame, float], None]] = None) -> Atlas:
    """The atlas `title` of one model's checkpoints (specs: (what loads it, step, tokens seen), in training order),
    measured on one input chosen from the first (`choose_tokens`, as `sinklab measure`: a run's probe set by default);
    on_frame(frame, seconds) after each."""
    check_metric(metric)
    frames: list[Frame] = []
    tokens = kind = keys = None
    model = ""
    for spec, step, seen in specs:
        t0 = time.perf_counter()
        target = load_target(spec)
        if tokens is None:
            tokens, kind, text = choose_tokens(inputs, target)
            texts = target.token_texts(tokens[0].tolist())
            ctx = target.recorder().context(eps, k)
            keys = key_labels(ctx.n_extra, ctx.slot_names, texts)
            kind = kind if text is None else f"{kind} ({text})"
            model = model_words(target.meta.model)
            note = "; ".join(n for n in (note, target.meta.weights_note) if n) or None  # a GGUF's quantization
        frame = measure_frame(target, tokens, checkpoint_label(step, seen, spec.name), eps=eps, k=k,
                              batch_size=batch_size)
        frame.step, frame.tokens, frame.where = step, seen, spec.name if spec.revision is None else spec.revision
        if not frames:
            check_grid(metric, frame)
        frames.append(frame)
        if on_frame is not None:
            on_frame(frame, time.perf_counter() - t0)
        del target
    if not frames:
        raise UserError("the atlas has no checkpoint to draw")
    return Atlas(title=title, frames=frames, queries=keys[len(keys) - tokens.shape[1]:], keys=keys,
                 input=f"{kind}: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens", metric=metric, note=note,
                 model=model)


# ----------------------------------------------------------------------------------------------------- the page
def pack_map(a: np.ndarray) -> tuple[str, float, float]:
    """A frame's maps (L, H, T, K) -> (base64 of zlib of uint8 in [lo, hi], lo, hi): lo = min(0, min a), hi = max(1,
    max a), so that a row-normalised map is stored on [0, 1] and every value within (hi - lo) / (2 * LEVELS)."""
    lo, hi = min(0.0, float(a.min())), max(1.0, float(a.max()))
    q = np.rint((a - lo) / (hi - lo) * LEVELS).astype(np.uint8)
    return base64.b64encode(zlib.compress(q.tobytes(), 9)).decode("ascii"), lo, hi


def unpack_map(data: str, lo: float, hi: float, shape: Sequence[int]) -> np.ndarray:
    """`pack_map`'s inverse (up to its rounding): the page's data back as float32 (L, H, T, K)."""
    q = np.frombuffer(zlib.decompress(base64.b64decode(data)), np.uint8).reshape(shape)
    return (lo + q.astype(np.float32) * ((hi - lo) / LEVELS)).astype(np.float32)


def page_data(atlas: Atlas) -> dict:
    """The JSON object the page reads (its script's `DATA`)."""
    L, H, T, K = atlas.frames[0].map.shape
    frames = []
    for f in atlas.frames:
        data, lo, hi = pack_map(f.map)
        frames.append({"label": f.label, "step": f.step, "tokens": f.tokens, "where": f.where, "lo": lo, "hi": hi,
                       "maps": data, "values": f.values})
    return {"title": atlas.title, "input": atlas.input, "note": atlas.note, "n_layer": L, "n_head": H, "seq_len": T,
            "n_extra": K - T, "keys": atlas.keys, "queries": atlas.queries, "metric": atlas.metric,
            "metrics": atlas.metrics, "levels": LEVELS, "model": atlas.model, "frames": frames}


# characters of the inline JSON written as escapes, so that no string of the data (a token's text, a run's path) can
# end or open a script element or an HTML comment (`</script>`, `<!--`), or end a line of the script (U+2028/U+2029)
SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def render(atlas: Atlas) -> str:
    """The page: the template (sinklab/analysis/atlas.html) with the data inline as JSON whose `<`, `>`, `&`,
    U+2028 and U+2029 are written as \\u escapes (`SCRIPT_SAFE`): still the same JSON, and safe in a script
    element whatever the strings hold."""
    template = resources.files("sinklab.analysis").joinpath("atlas.html").read_text(encoding="utf-8")
    data = json.dumps(page_data(atlas), separators=(",", ":"), allow_nan=False).translate(SCRIPT_SAFE)
    return template.replace(DATA_MARK, data, 1)


def write_atlas(atlas: Atlas, path: Path) -> Path:
    """The page written atomically to `path`."""
    from sinklab.io import atomic_write

    return atomic_write(path, render(atlas))


def read_page_data(html: str) -> dict:
    """The data a written page holds (the JSON of its `atlas-data` script), for tests and tools."""
    start = html.index('<script id="atlas-data" type="application/json">')
    start = html.index(">", start) + 1
    return json.loads(html[start:html.index("</script>", start)])


# ----------------------------------------------------------------------------------------------------- checkpoints
def checkpoints_of(target: str, last_only: bool = False) -> tuple[list[tuple[str, Optional[int], Optional[int]]],
                                                                   Optional[str]]:
    """TARGET's checkpoints for the slider, (file, step, tokens seen) in training order, and a note where there is no
    slider to show: a run dir's kept checkpoints and last.ckpt (`run_series`; with `last_only`, last.ckpt alone), or
    the one checkpoint a .ckpt (or a dir with checkpoints/last.ckpt) names."""
    from sinklab.analysis.trajectories import run_series
    from sinklab.runs.checkpoints import TOKENS_SEEN, find_checkpoint, read_checkpoint
    from sinklab.runs.run_data import is_run_dir

    path = Path(target)
    if not path.exists():
        raise UserError(f"TARGET {target}: no such checkpoint or run dir")
    if path.is_dir() and is_run_dir(path) and not last_only:
        points = [(p.name, p.step, p.tokens) for p in run_series(target).points]
        note = None if len(points) > 1 else (
            f"{target} has no kept checkpoints (checkpoints/kept/): the atlas draws {Path(points[0][0]).name} alone, "
            "without a slider; train with callbacks.checkpoint.keep.every_n_steps=N to keep some")
        return points, note
    ckpt = find_checkpoint(path)
    saved = read_checkpoint(ckpt, mmap=True)
    return [(str(ckpt), saved.get("global_step"), saved.get(TOKENS_SEEN))], None
