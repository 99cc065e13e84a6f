"""The sink metric on the keys each query can see, for sparse attention (a window, a fixed sparse pattern, a top-k or
block selection): there the sink metric's alpha_1 averages over every query i >= 1, and a query that cannot see
token 1 adds 0, so alpha_1 falls with the share of queries that see token 1 whether or not a head sinks.

For layer l, head h, the map A over T real tokens (1-indexed) and the layout the layer attends through (its
`Layout.mask`: which keys each query CAN see, per head for head-dependent patterns; `V_k` the real queries i >= k
that can see key k):
    visible_k(l, h)   = |V_k| / (T - k + 1)                         the share of alpha_k's queries that see key k
    alpha_k^vis(l, h) = 1/|V_k| * sum_{i in V_k} A[i, k]           (0 for a head where no query sees key k)
    Sink_k^vis        = 100 * mean_{l,h} [alpha_k^vis(l, h) > eps]  (per sequence, then averaged over sequences)
A map is zero where the query cannot see the key, so alpha_k^vis = alpha_k / visible_k: on a dense causal map every
query i >= k sees key k, visible_k = 1 and alpha_k^vis is alpha_k exactly. Early queries see few keys: a head
attending uniformly over a window of w has alpha_1^vis = (1 + 1/2 + ... + 1/w) / w (0.46 at w = 5, above eps 0.3),
the baseline to read Sink_1^vis of small windows against. It is logged beside alpha_1^vis, per head, for the keys
each query can see:
    alpha_1^uniform(l, h) = 1/|V_1| * sum_{i in V_1} 1 / n_i      (n_i the real keys query i can see)
the alpha_1^vis of a head that attends uniformly to what it can see (H_w / w for a window of w; H_T / T on a dense
causal map), so that alpha_1^vis - alpha_1^uniform is the attention on token 1 beyond chance: the quantity to
compare across windows or budgets, which alpha_1^vis itself is not (it falls with w even for uniform heads).

Selection sink (token 1). A selection operation (top-k, block selection) is given the causal candidates as its mask,
and the keys it keeps are the map's support: A[i, j] != 0 (a softmax over the kept keys is > 0 on each of them; a
weight that underflows to 0, a logit more than ~100 below its row's largest in float32, counts as not kept). Over the
real queries Q that can see token 1, with m_i the real keys query i keeps and n_i the real keys it can see:
    select1(l, h)          = |{i in Q: A[i, 1] != 0}| / |Q|     the share of queries whose selection holds token 1
    select1_uniform(l, h)  = 1/|Q| * sum_{i in Q} m_i / n_i     the share a uniform choice of m_i keys would give
    select1_ratio(l, h)    = select1 / select1_uniform           (> 1: token 1 is selected more often than chance)
per sequence, then averaged over sequences (the ratio of the two means; none where no query sees token 1). A
window or a fixed pattern keeps every key it can see (m_i = n_i): select1 = select1_uniform = 1, ratio 1. The
bias slot and the learned sink tokens are not real keys: they count in neither m_i nor n_i.

Applies to sinklab models with `cfg.sparse_attention` only (a window, a layer pattern's local layers, or an
operation that declares `sparse`); a dense model logs none of it. The layout is the model's own (`model.layout`, an
intervention's mask included, then `attn.own` per layer), so the metric sees exactly the keys the forward let
each query see. The maps come in row chunks and per-(sequence, layer, head) sums are kept: memory linear in T.

Logged (sparse/...): sink{k}_vis (first eps) and sink{k}_vis@{eps}, alpha{k}_vis, visible{k} (k = 1..K), select1,
select1_uniform, select1_ratio, alpha1_vis_uniform; per layer sparse/layer<i>/{sink1_vis, alpha1_vis,
alpha1_vis_uniform, visible1, select1, select1_uniform, select1_ratio}. `measure --json`: sparse {eps, k, sink_vis,
alpha_vis, alpha1_vis_uniform, visible, select1, select1_uniform, select1_ratio, by_layer {...}, by_head {... (L, H)
grids}}.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .base import ANY, METRICS, NON_NEGATIVE, PERCENT, UNIT, Context, Metric, layer_table
from .sink import rates

SPARSE_PREFIX = "sparse/"
LAYER_KEYS = ("sink1_vis", "alpha1_vis", "alpha1_vis_uniform", "visible1", "select1", "select1_uniform",
              "select1_ratio")


def ratio(select: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """select / uniform elementwise, NaN where the uniform share is 0 (no query sees token 1)."""
    return torch.where(uniform > 0, select / uniform.clamp_min(1e-300), torch.full_like(select, float("nan")))


def number(x: torch.Tensor) -> Optional[float]:
    """A 0-d tensor as a JSON number, None where it is NaN."""
    v = float(x)
    return None if v != v else v


def grid(x: torch.Tensor) -> list:
    """An (L, H) tensor as lists, NaN as None (strict JSON)."""
    return [[number(v) for v in row] for row in x]


@METRICS.register("sparse")
class SparseSinkMetric(Metric):
    """Sink_k^vis, alpha_k^vis and the visible share on the keys each query can see, and the selection sink on token 1
    (module docstring), from the maps in row chunks and the layer's own mask; sums in float64."""

    records = frozenset({"maps"})
    needs_model = True  # the model's layout says which keys each query can see
    bounds = ((r"^sparse/(layer\d+/)?sink\d+_vis(@[0-9.e+-]+)?$", PERCENT),
              (r"^sparse/(layer\d+/)?alpha\d+_vis$", ANY),  # as sink/alpha: any sign for kernels, differential
              (r"^sparse/(layer\d+/)?(visible\d+|select1|select1_uniform|alpha1_vis_uniform)$", UNIT),
              (r"^sparse/(layer\d+/)?select1_ratio$", NON_NEGATIVE))
    json_key = "sparse"
    headline = ("sparse/sink1_vis", "sparse/alpha1_vis", "sparse/select1_ratio")

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        """sinklab models whose attention is sparse (`ModelConfig.sparse_attention`); dense ones have alpha^vis =
        alpha and nothing to select."""
        return ctx.model is not None and bool(ctx.model.cfg.sparse_attention)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.layout = None  # the model's layout of the current length and device (the forward's)
        self.masks: dict[tuple, dict[str, torch.Tensor]] = {}  # (layer, T, device, chunk, rows) -> `chunk_masks`
        self.acc: Optional[dict[str, Any]] = None  # the current layer's sums over the chunks of its rows
        self.layers: dict[str, list] = {name: [] for name in ("alpha_vis", "alpha_uniform", "visible", "select",
                                                              "uniform")}
        self.batches: dict[str, list] = {name: [] for name in self.layers}

    def layer_mask(self, layer: int, T: int, rows: torch.Tensor) -> torch.Tensor:
        """Which real keys the real queries `rows` (0-based) can see in `layer`: (R, T), or (H, R, T) for a
        head-dependent pattern."""
        model = self.ctx.model
        device = rows.device
        if self.layout is None or self.layout.n_pos != T + model.cfg.n_sink_tokens or self.layout.device != device:
            self.layout = model.layout(T, device, extra_mask=self.ctx.extra_mask)
        seen = model.blocks[layer].attn.own(self.layout).mask(rows + model.cfg.n_sink_tokens)
        return seen[..., self.ctx.n_extra:]  # the bias slot and sink tokens' columns dropped

    def chunk_masks(self, layer: int, T: int, K: int, rows: torch.Tensor, chunk: int) -> dict[str, torch.Tensor]:
        """What the layer's mask says of the query rows `rows`, the `chunk`-th chunk of the layer's rows: the same
        for every batch of a measurement, so built once per (layer, length, chunk), not per batch: seen (R, T) or
        (H, R, T), the mask; counted (R, K) or (H, R, K), the queries of alpha_k that see key k; sees1 (R,) or
        (H, R), the queries that see token 1; n_seen (R,) or (H, R), the real keys each query can see (at least 1),
        in float64; uniform1 () or (H,), the sum over the chunk's queries that see token 1 of 1 / n_seen (a uniform
        head's attention on it). The key holds no row value, so that finding it reads nothing back from a GPU."""
        key = (layer, T, rows.device, chunk, len(rows))
        if key not in self.masks:
            seen = self.layer_mask(layer, T, rows)  # (R, T) or (H, R, T)
            later = rows[:, None] >= torch.arange(K, device=rows.device)[None, :]  # (R, K): alpha_k counts i >= k
            n_seen = seen.sum(-1).clamp_min(1).double()
            self.masks[key] = {"seen": seen, "counted": seen[..., :K] & later, "sees1": seen[..., 0], "n_seen": n_seen,
                               "uniform1": (seen[..., 0] / n_seen).sum(-1)}
        return self.masks[key]

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        n_extra, T = self.ctx.n_extra, maps.shape[-1] - self.ctx.n_extra
        K = min(self.ctx.k, T)
        B, H = maps.shape[:2]
        if not self.acc or self.acc["layer"] != layer:
            self._close_layer()
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=maps.device)  # noqa: E731
            self.acc = {"layer": layer, "T": T, "alpha": zeros(B, H, K), "seen": zeros(H, K), "select": zeros(B, H),
                        "uniform": zeros(B, H), "uniform1": zeros(H), "queries": zeros(H), "chunks": 0}
        m = self.chunk_masks(layer, T, K, rows, self.acc["chunks"])
        self.acc["chunks"] += 1
        counted, sees1 = m["counted"], m["sees1"]
        # only alpha's K key columns are summed in float64; the support (a weight != 0) is the same in the maps' dtype
        a = maps[..., n_extra:]  # (B, H, R, T): the real keys
        self.acc["alpha"] += (a[..., :K].double() * counted).sum(2)
        self.acc["seen"] += counted.sum(-2)
        self.acc["uniform1"] += m["uniform1"]  # () or (H,): alpha_1 counts every query that sees token 1
        kept = (a != 0).logical_and_(m["seen"])  # (B, H, R, T): the selection, the map's support on what it can see
        share = kept.sum(-1, dtype=torch.int32).double() / m["n_seen"]  # (B, H, R): m_i / n_i, in float64
        self.acc["select"] += (kept[..., 0] & sees1).sum(-1)
        self.acc["uniform"] += (share * sees1).sum(-1)
        self.acc["queries"] += sees1.sum(-1)

    def _close_layer(self) -> None:
        if not self.acc:
            return
        acc = self.acc
        K, T, B = acc["alpha"].shape[-1], acc["T"], acc["alpha"].shape[0]
        queries = acc["queries"].clamp_min(1)  # (H,): no query sees token 1 -> its shares and alpha_1^uniform 0
        self.layers["alpha_vis"].append(acc["alpha"] / acc["seen"].clamp_min(1))  # (B, H, K)
        self.layers["alpha_uniform"].append((acc["uniform1"] / queries).expand(B, -1))  # (B, H)
        denom = (T - torch.arange(K, device=acc["seen"].device)).double()
        self.layers["visible"].append((acc["seen"] / denom).expand(B, -1, -1))  # (H, K) -> (B, H, K)
        self.layers["select"].append(acc["select"] / queries)  # (B, H)
        self.layers["uniform"].append(acc["uniform"] / queries)
        self.acc = None

    def end_batch(self) -> None:
        self._close_layer()
        for name, layers in self.layers.items():
            if layers:
                self.batches[name].append(torch.stack(layers, 1).cpu())  # (B, L, H, K) or (B, L, H)
            layers.clear()

    def result(self) -> dict[str, Any]:
        """Per sequence, layer and head: alpha_vis and visible (N, L, H, K); alpha_uniform, select and uniform
        (N, L, H)."""
        return {name: torch.cat(batches).double() for name, batches in self.batches.items()}

    def log(self, result: dict[str, Any]) -> dict[str, float]:
        alpha, visible = result["alpha_vis"], result["visible"]
        select, uniform = result["select"], result["uniform"]
        out: dict[str, float] = {}
        for j, e in enumerate(self.ctx.eps):
            for k, v in rates(alpha, e).items():
                out[f"sink{k}_vis@{e:g}"] = v
                if j == 0:
                    out[f"sink{k}_vis"] = v
        for kk in range(alpha.shape[-1]):
            out[f"alpha{kk + 1}_vis"] = alpha[..., kk].mean().item()
            out[f"visible{kk + 1}"] = visible[..., kk].mean().item()
        out.update(select1=select.mean().item(), select1_uniform=uniform.mean().item(),
                   alpha1_vis_uniform=result["alpha_uniform"].mean().item())
        r = number(ratio(select.mean(), uniform.mean()))
        if r is not None:
            out["select1_ratio"] = r
        for layer, values in enumerate(self.by_layer(result)):
            out.update({f"layer{layer}/{name}": v for name, v in values.items() if v is not None})
        return {SPARSE_PREFIX + k: v for k, v in out.items()}

    def by_layer(self, result: dict[str, Any]) -> list[dict[str, Optional[float]]]:
        """Per layer (over its heads and the sequences): LAYER_KEYS, the ratio None where it is undefined."""
        alpha, visible = result["alpha_vis"][..., 0], result["visible"][..., 0]  # (N, L, H)
        select, uniform = result["select"].mean(dim=(0, 2)), result["uniform"].mean(dim=(0, 2))  # (L,)
        sink1 = 100.0 * (alpha > self.ctx.eps[0]).double().mean(dim=(0, 2))
        alpha_uniform = result["alpha_uniform"].mean(dim=(0, 2))  # (L,)
        return [{"sink1_vis": sink1[i].item(), "alpha1_vis": alpha[:, i].mean().item(),
                 "alpha1_vis_uniform": alpha_uniform[i].item(),
                 "visible1": visible[:, i].mean().item(), "select1": select[i].item(),
                 "select1_uniform": uniform[i].item(), "select1_ratio": number(ratio(select[i], uniform[i]))}
                for i in range(alpha.shape[1])]

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        alpha, visible = result["alpha_vis"], result["visible"]
        select, uniform = result["select"], result["uniform"]
        eps, K = self.ctx.eps, alpha.shape[-1]
        layers = self.by_layer(result)
        heads = {"select1": select.mean(0), "select1_uniform": uniform.mean(0)}  # (L, H)
        return {"eps": [float(e) for e in eps], "k": K,
                "sink_vis": {f"{e:g}": rates(alpha, e) for e in eps},
                "alpha_vis": {str(j + 1): alpha[..., j].mean().item() for j in range(K)},
                "alpha1_vis_uniform": result["alpha_uniform"].mean().item(),
                "visible": {str(j + 1): visible[..., j].mean().item() for j in range(K)},
                "select1": select.mean().item(), "select1_uniform": uniform.mean().item(),
                "select1_ratio": number(ratio(select.mean(), uniform.mean())),
                "by_layer": {name: [values[name] for values in layers] for name in LAYER_KEYS},
                "by_head": {"alpha1_vis": grid(alpha[..., 0].mean(0)),
                            "alpha1_vis_uniform": grid(result["alpha_uniform"].mean(0)),
                            "visible1": grid(visible[..., 0].mean(0)),
                            **{name: grid(v) for name, v in heads.items()},
                            "select1_ratio": grid(ratio(heads["select1"], heads["select1_uniform"]))}}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Sink_k^vis per eps, mean alpha_k^vis and the visible share for k = 1..K; per layer Sink_1^vis, alpha_1^vis
        and a uniform head's, visible_1 and the selection of token 1 against the uniform share."""
        K = part["k"]
        lines = ["sparse attention: on the keys each query can see (alpha_k^vis; token 1's selection vs uniform)",
                 f"{'':<18}" + "".join(f"{'k=' + str(j + 1):>9}" for j in range(K))]
        for e, r in part["sink_vis"].items():
            lines.append(f"{'Sink^vis% eps=' + e:<18}" + "".join(f"{r[str(j + 1)]:9.2f}" for j in range(K)))
        for title, name in (("mean alpha^vis", "alpha_vis"), ("visible share", "visible")):
            lines.append(f"{title:<18}" + "".join(f"{part[name][str(j + 1)]:9.4f}" for j in range(K)))
        by = part["by_layer"]
        overall = [part["sink_vis"][f"{part['eps'][0]:g}"]["1"], part["alpha_vis"]["1"],
                   part["alpha1_vis_uniform"], part["visible"]["1"], part["select1"], part["select1_uniform"],
                   part["select1_ratio"]]
        columns = [("Sink1v%", by["sink1_vis"], 7, 1), ("alpha1v", by["alpha1_vis"], 7, 3),
                   ("unif.", by["alpha1_vis_uniform"], 6, 3),
                   ("vis1", by["visible1"], 6, 3), ("select1", by["select1"], 7, 3),
                   ("uniform", by["select1_uniform"], 7, 3), ("ratio", by["select1_ratio"], 6, 2)]
        return lines + layer_table(columns, overall=overall)

