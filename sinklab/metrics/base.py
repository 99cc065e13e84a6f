"""Measurements as plug-ins: the `Metric` interface and the registry `METRICS` (name -> class).

A metric is one module (`sinklab/metrics/<name>.py`) with one class registered here. It declares
- `records`: what it needs from each layer's forward, a subset of RECORDABLE: `q`, `k`, `v` (real tokens' queries,
  keys and values as the operation sees them: after RoPE, the kv heads repeated to H), `v_extra` (the values of
  the extra keys, bias slot then learned sink tokens, (B, H, n_extra, hd); absent without them), `attn` (the attention
  module's output, (B, T, d)), `h` (the residual stream leaving the layer, (B, T, d)), `gate` (a gated model's
  scores, (B, T, width)), `op_tensors` (the attention op's own per-token tensors, `AttentionOp.project`, over the
  real tokens: {name: (B, h, T, w)}, e.g. a recurrent layer's decay and beta; {} for most ops) and `maps` (the
  attention map in chunks of query rows, (B, H, R, n_extra + T), the extra key columns first: the bias slot, then
  learned sink tokens);
- how it reduces: `update(layer, rec)` and `update_maps(layer, rows, maps)` per layer and batch, `end_batch()`,
  `result()` per layer (lists indexed by layer) and overall; with `reads_maps_twice`, each layer's chunks come again
  to `update_maps_again` once all of them were seen (a statistic of each query row that needs the column sums);
- `own_input(tokens)`: the token ids it measures instead of the probe input it is given (None: that input), e.g.
  random tokens repeated for induction scores; built deterministically from a fixed seed;
- `bounds`: the physical range of each of its log keys (regexes over the full name, e.g. `^act/(layer\\d+/)?x$`);
- `log(result)`: the scalars the training callback logs (full names, `sink/...` or `act/...`);
- `json(result)`: its part of `sinklab measure --json` (under `json_key`, or merged at the top level when None);
- `headline`: the log keys `sinklab report --metrics NAME` shows;
- `text(part, res)`: its lines in `sinklab measure`'s text, from its JSON part (default: its log scalars, per layer
  as a table);
- `heatmap(result)`: a layer x head grid the training callback draws at each validation (the sink metric's alpha_1);
- `fill_final(finals)`: values a sweep report derives from the jobs' final logged values (the sink metric's Sink*_k
  for jobs whose rows sum to one).
The training callback (`SinkCallback`), `sinklab measure` (sinklab checkpoints and Hugging Face models,
`sinklab.metrics.record.measure_all`, and its text `sinklab.analysis.measurement.format_tables`) and
`sinklab report` iterate the registry, with no branch on a metric's name;
tests/metrics/test_metric_contracts.py checks every registered metric. A metric in a researcher's own package registers with
`@METRICS.register("name")` and is measured once its module is imported.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import torch

from sinklab.keys import ACT_PREFIX
from sinklab.keys import ANY, NON_NEGATIVE, PERCENT, TRAINING_BOUNDS, UNIT  # noqa: F401  (the bounds metrics declare)
from sinklab.registries import NameRegistry

RECORDABLE = frozenset({"q", "k", "v", "v_extra", "attn", "h", "gate", "op_tensors", "maps"})


@dataclass
class Context:
    """What a metric knows of the measured model before the first batch.

    n_layer, n_head; n_extra: key columns before the real tokens in `maps` (bias slot + sink tokens);
    slot_names: their names; row_normalised: whether every map row sums to one (None: not known before the maps
    are seen, as for Hugging Face models; `Target.row_normalised` says afterwards); eps, k: the sink thresholds and
    how many first tokens are scored; model: the sinklab Transformer (None for other models); extra_mask: an
    intervention's mask the forward obeys on top of the model's (`Transformer.layout`), None without one."""

    n_layer: int
    n_head: int
    n_extra: int = 0
    slot_names: list[str] = field(default_factory=list)
    row_normalised: Optional[bool] = True
    eps: list[float] = field(default_factory=lambda: [0.3])
    k: int = 4
    model: Any = None
    extra_mask: Any = None


class Metric:
    """The interface every registered metric implements (see the module docstring)."""

    name: ClassVar[str] = ""
    records: ClassVar[frozenset] = frozenset()
    bounds: ClassVar[tuple[tuple[str, tuple[float, float]], ...]] = ()
    json_key: ClassVar[Optional[str]] = None
    headline: ClassVar[tuple[str, ...]] = ()
    needs_model: ClassVar[bool] = False  # reads the sinklab model itself (weights): not for Hugging Face models
    reads_maps_twice: ClassVar[bool] = False  # each layer's map chunks come again to update_maps_again

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        """Whether this metric measures the model of `ctx` (a gate statistic needs a gated model)."""
        return not cls.needs_model or ctx.model is not None

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        """One layer's recorded tensors of one batch (the names in `records`, maps excepted)."""

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        """A chunk of one layer's map: `rows` (R,) are real query positions (0-based), maps (B, H, R, n_extra + T)."""

    def update_maps_again(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        """With `reads_maps_twice`: the same chunks of the layer's map once more, after update_maps saw all of them."""

    def own_input(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """The token ids (N, T') this metric measures instead of the probe input `tokens` (N0, T0) it is given, built
        from them deterministically (a fixed seed), on the CPU; None: the given input, shared with the other metrics."""
        return None

    def end_batch(self) -> None:
        """Every layer of the batch has been seen."""

    def result(self) -> dict[str, Any]:
        raise NotImplementedError

    def log(self, result: dict[str, Any]) -> dict[str, float]:
        """Scalars to log, by full name."""
        return self.flatten(result)

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        """`log` where it needs nothing but the result."""
        return {}

    def json(self, result: dict[str, Any]) -> Any:
        """Its part of `sinklab measure --json`."""
        return result

    def heatmap(self, result: dict[str, Any]) -> Optional[torch.Tensor]:
        """A (L, H) grid, layer by head, that the training callback draws at each validation; None: none. The
        callback draws the first that a registered metric gives (the sink metric's alpha_1)."""
        return None

    @classmethod
    def fill_final(cls, finals: Sequence[dict[str, float]]) -> None:
        """Fill in values derived from a sweep's jobs' final logged values (one dict per job, updated in place), so
        that `sinklab report` compares the jobs on one column; nothing by default."""

    @classmethod
    def part(cls, res: dict[str, Any]) -> Any:
        """Its part of a `sinklab measure --json` object `res`: res[json_key] (None where it was not measured), or
        `res` itself for a metric whose part is merged at the top level (json_key None)."""
        return res if cls.json_key is None else res.get(cls.json_key)

    @classmethod
    def text(cls, part: Any, res: dict[str, Any]) -> list[str]:
        """Its lines in `sinklab measure`'s text, from its JSON part `part` (`Metric.part`) and, for what every
        metric shares (model, eps, k), the whole object `res`; [] shows nothing. The default, for a metric that
        declares no text of its own: its log scalars where its part is its result (`flatten`, when `json` is not
        overridden), else the numbers of its part by their paths, overall ones on a line and per-layer ones
        (`layer<i>/...`, or lists of n_layer numbers) as a table by layer, under its name and the first line of its
        docstring; nothing for an empty part."""
        if part in ({}, []):
            return []
        values = cls.flatten(part) if cls.json is Metric.json else {}
        if not values and cls.json_key is not None:
            values = json_scalars(part, (res.get("model") or {}).get("n_layer"))
        doc = (cls.__doc__ or "").strip()
        title = f"{cls.name}: {doc.splitlines()[0]}" if doc else cls.name
        return scalar_text(title, values) or [title, "(no numbers to show here: see `sinklab measure --json`)"]


class MetricRegistry(NameRegistry[type[Metric]]):
    """name -> Metric class, in registration order (the order `measure --json` and the logs follow)."""

    what = "metric"

    def check(self, name: str, cls: type[Metric]) -> None:
        unknown = set(cls.records) - RECORDABLE
        if unknown:
            raise ValueError(f"metric {name!r} records {sorted(unknown)}; allowed: {', '.join(sorted(RECORDABLE))}")

    def build(self, ctx: Context, names: Optional[list[str]] = None) -> list[Metric]:
        """The metrics `names` (default: every registered one) that apply to the model of `ctx`, built."""
        classes = [self.get(n) for n in names] if names is not None else list(self)
        return [cls(ctx) for cls in classes if cls.applies(ctx)]

    def bounds(self) -> list[tuple[str, tuple[float, float]]]:
        return [b for cls in self for b in cls.bounds]


METRICS = MetricRegistry()


def per_layer(values: dict[str, list], key: str) -> dict[str, float]:
    """layer<i>/<key> for every layer's non-missing value."""
    return {f"layer{i}/{key}": float(v) for i, v in enumerate(values.get(key) or []) if v is not None}


def layer_logs(values: dict[str, list], keys: Sequence[str]) -> dict[str, float]:
    """act/layer<i>/<key> for every layer's non-missing value of each of `keys`: what a metric logs per layer."""
    return {ACT_PREFIX + name: v for key in keys for name, v in per_layer(values, key).items()}


class LayerMeans:
    """Per-layer means over sequences of per-sequence values ((B,) or (B, d) tensors), batch by batch: `add` one
    layer's values, `end_batch` sums each over the batch's sequences (stacked over layers, one (B, L) sum); values
    missing from some layer of a batch are left out of every layer."""

    def __init__(self):
        self.batch: dict[int, dict[str, torch.Tensor]] = {}
        self.sums: dict[str, torch.Tensor] = {}  # name -> (L,) sums over sequences ((L, d) for vectors)
        self.n = 0

    def add(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        self.batch.setdefault(layer, {}).update(values)

    def end_batch(self) -> None:
        if not self.batch:
            return
        layers = [self.batch[i] for i in sorted(self.batch)]
        names = [name for name in layers[0] if all(name in s for s in layers)]
        if self.n and set(names) != set(self.sums):
            raise ValueError(f"statistics {sorted(names)} differ from the first batch's {sorted(self.sums)}")
        for name in names:
            total = torch.stack([s[name] for s in layers], 1).sum(0).cpu()  # (B, L) -> (L,); (B, L, d) -> (L, d)
            self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.n += next(iter(layers[0].values())).shape[0]
        self.batch = {}

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    def mean(self, name: str) -> torch.Tensor:
        return self.sums[name] / self.n


# ---------------------------------------------------------------------------------- text (`sinklab measure`)
def cell(x: Any, width: int = 7, prec: Optional[int] = 2) -> str:
    """One value of a text table, right-aligned in `width`: a number with `prec` decimals (None: as it is, e.g. an
    index); a missing or non-finite value as '-'."""
    if x is None or isinstance(x, float) and not math.isfinite(x):
        return f"{'-':>{width}}"
    return f"{x:{width}.{prec}f}" if prec is not None else f"{x:>{width}}"


def layer_table(columns: Sequence[tuple[str, Sequence, int, Optional[int]]],
                overall: Optional[Sequence] = None) -> list[str]:
    """A table by layer: columns (header, per-layer values, width, decimals as `cell`) after the layer's index, one
    space apart; with `overall`, a last row `all` of one value per column."""
    lines = [f"{'layer':>5} " + " ".join(f"{head:>{width}}" for head, _, width, _ in columns)]
    for layer in range(max((len(values) for _, values, _, _ in columns), default=0)):
        lines.append(f"{layer:>5} " + " ".join(cell(values[layer] if layer < len(values) else None, width, prec)
                                               for _, values, width, prec in columns))
    if overall is not None:
        lines.append(f"{'all':>5} " + " ".join(cell(x, width, prec)
                                               for x, (_, _, width, prec) in zip(overall, columns)))
    return lines


LAYER_KEY = re.compile(r"(^|/)layer(\d+)/")  # a per-layer log key: act/layer3/x is layer 3's act/x


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def json_scalars(part: Any, n_layer: Optional[int] = None, path: str = "") -> dict[str, float]:
    """A JSON part's numbers by their paths (`by_layer/induction`), a list of n_layer numbers (or nulls) as
    per-layer values (`layer<i>/<path>`); other lists (per head, per position) and strings are left out."""
    name = path or "value"
    if is_number(part):
        return {name: float(part)}
    if isinstance(part, dict):
        return {k: v for key, value in part.items()
                for k, v in json_scalars(value, n_layer, f"{path}/{key}" if path else str(key)).items()}
    if isinstance(part, list) and len(part) == n_layer and all(x is None or is_number(x) for x in part):
        return {f"layer{i}/{name}": float(x) for i, x in enumerate(part) if x is not None}
    return {}


def json_grids(part: Any, n_layer: int, n_head: int, path: str = "") -> dict[str, list]:
    """A JSON part's layer x head grids by their paths: every list of n_layer lists of n_head numbers (or nulls), the
    per-head values a metric gives (`alpha`, `by_head/induction`, ...); a `by_head` step of a path is left out of
    its name (`by_head/induction` -> `induction`, a part that is one grid -> ""). What `sinklab atlas` colours heads
    by."""
    if isinstance(part, dict):
        return {k: v for key, value in part.items()
                for k, v in json_grids(value, n_layer, n_head,
                                       path if key == "by_head" else f"{path}/{key}" if path else str(key)).items()}
    if isinstance(part, list) and len(part) == n_layer and all(
            isinstance(row, list) and len(row) == n_head and all(x is None or is_number(x) for x in row)
            for row in part):
        return {path: part}
    return {}


def scalar_text(title: str, values: dict[str, float]) -> list[str]:
    """`title`, then the overall values on one line and the per-layer ones (`LAYER_KEY`) as a table by layer, in
    4 significant digits; [] without values."""
    if not values:
        return []
    overall, by_layer = {}, {}
    for name, value in values.items():
        m = LAYER_KEY.search(name)
        if m is None:
            overall[name] = value
        else:
            column = name[:m.start()] + m.group(1) + name[m.end():]
            by_layer.setdefault(column, {})[int(m.group(2))] = value
    lines = [title]
    if overall:
        lines.append(", ".join(f"{name} {value:.4g}" for name, value in overall.items()))
    if by_layer:
        n = 1 + max(i for column in by_layer.values() for i in column)
        widths = {name: max(len(name), 9) for name in by_layer}
        lines.append(f"{'layer':>5} " + " ".join(f"{name:>{widths[name]}}" for name in by_layer))
        for layer in range(n):
            lines.append(f"{layer:>5} " + " ".join(
                f"{column[layer]:{widths[name]}.4g}" if math.isfinite(column.get(layer, math.nan))
                else f"{'-':>{widths[name]}}" for name, column in by_layer.items()))
    return lines


def all_bounds() -> list[tuple[str, tuple[float, float]]]:
    """The physical range of every logged name, the first pattern that matches: the registered metrics' own (each
    declares the bounds of its keys; importing sinklab.metrics registers sinklab's), then the training loop's
    (`sinklab.keys.TRAINING_BOUNDS`). A logged name no pattern covers fails tests/metrics/test_bounds.py."""
    return METRICS.bounds() + list(TRAINING_BOUNDS)


def bounds(name: str) -> Optional[tuple[float, float]]:
    """The physical range of a logged metric, None for a name no family covers."""
    return next((b for pattern, b in all_bounds() if re.search(pattern, name)), None)
