"""One way to record activations: forward hooks, on a sinklab model's hook points (`sinklab.model.hooks`) and
modules, and on a Hugging Face model's decoder layers (`sinklab.targets.transformers_recorder.HFRecorder`). A target runs a batch through its
model with the hooks that the chosen metrics need and hands each metric every layer's recorded tensors as soon as
the layer has run (`Metric.update`), then the layer's attention map in chunks of query rows (`Metric.update_maps`,
and once more `Metric.update_maps_again` for a metric that `reads_maps_twice`); nothing is kept after the layer, so
memory is one layer's tensors plus one chunk of one map. A metric with its own input (`Metric.own_input`, e.g.
repeated random tokens) gets its own forwards over it.

    metrics = METRICS.build(SinklabRecorder(model).context(eps=[0.3], k=4))
    measure_all(SinklabRecorder(model), tokens, metrics, batch_size=32)
    results = {m.name: m.result() for m in metrics}

`attention_maps(model, tokens)` gives every layer's whole map (B, H, S + T, Tk), the reference the tests compare
the chunked routes against.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from .base import Context, Metric


class SinklabRecorder:
    """A sinklab Transformer as a measurement target. Recorded tensors are the real tokens' (learned sink tokens and
    bias slots dropped); maps keep the extra key columns first, and their rows are the real queries."""

    def __init__(self, model, chunk: int = 128, extra_mask=None):
        self.model, self.chunk, self.extra_mask = model, chunk, extra_mask  # extra_mask: an intervention's
        self.row_normalised = model.cfg.row_normalised

    def context(self, eps: Sequence[float] = (0.3,), k: int = 4) -> Context:
        cfg = self.model.cfg
        return Context(n_layer=cfg.n_layer, n_head=cfg.n_head, n_extra=cfg.n_slots + cfg.n_sink_tokens,
                       slot_names=slot_names(cfg), row_normalised=cfg.row_normalised, eps=list(eps), k=k,
                       model=self.model, extra_mask=self.extra_mask)

    def settle(self, metrics: Sequence[Metric]) -> None:
        """Nothing to tell: a sinklab model's row normalisation is known from its config."""

    @contextlib.contextmanager
    def hooks(self, names: set[str], on_layer: Callable[[int, dict], None]) -> Iterator[None]:
        """Forward hooks that fill one dict per layer with `names` and call on_layer(layer, dict) when the layer's
        block has run (its output is the last thing a block computes)."""
        S, n_slots = self.model.cfg.n_sink_tokens, self.model.cfg.n_slots
        current: dict = {}
        handles = []

        def keep(name: str, trim: Callable[[torch.Tensor], torch.Tensor]):
            def hook(_module, _inputs, out):
                current[name] = trim(out)
            return hook

        queries = lambda t: t[:, :, S:]  # noqa: E731  (B, H, S + T, hd) -> the real queries
        keys = lambda t: t[:, :, n_slots + S:]  # noqa: E731  (B, H, n_slots + S + T, hd) -> the real keys
        tokens = lambda t: t[:, S:]  # noqa: E731  (B, S + T, ...) -> the real tokens
        extra = lambda t: t[:, :, :n_slots + S]  # noqa: E731  (B, H, n_slots + S + T, hd) -> the extra keys
        if not n_slots + S:
            names = names - {"v_extra"}
        need_qk = "maps" in names
        for i, block in enumerate(self.model.blocks):
            attn = block.attn
            wanted = ((attn.hook_q, "q", queries), (attn.hook_k, "k", keys), (attn.hook_v, "v", keys),
                      (attn.hook_v, "v_extra", extra), (attn, "attn", tokens),
                      (attn.hook_extra, "op_tensors", lambda d: {n: queries(t) for n, t in d.items()}))
            for module, name, trim in wanted:
                if name in names:
                    handles.append(module.register_forward_hook(keep(name, trim)))
            if need_qk:  # the whole q and k, and the op's own tensors (`Attention.extras`), for the maps
                handles.append(attn.hook_q.register_forward_hook(keep("q_all", lambda t: t)))
                handles.append(attn.hook_k.register_forward_hook(keep("k_all", lambda t: t)))
                handles.append(attn.hook_extra.register_forward_hook(keep("extra", lambda t: t)))
            act = getattr(attn.gate_proj, "gate_act", None)
            if "gate" in names and act is not None:
                handles.append(act.register_forward_hook(keep("gate", lambda t: tokens(t).detach().float())))

            def done(_module, _inputs, out, i=i):
                if "h" in names:
                    current["h"] = tokens(out)
                rec = dict(current)
                current.clear()
                on_layer(i, rec)
            handles.append(block.hook_resid.register_forward_hook(done))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def maps(self, layer: int, rec: dict, layout) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The layer's map in chunks of real query rows: (rows (R,) 0-based, A (B, H, R, n_extra + T))."""
        S = self.model.cfg.n_sink_tokens
        T = layout.n_pos - S
        q, k = rec["q_all"], rec["k_all"]  # (B, H, S + T, hd), (B, H, n_slots + S + T, hd)
        attn = self.model.blocks[layer].attn
        for r0 in range(0, T, self.chunk):
            rows = torch.arange(S + r0, S + min(T, r0 + self.chunk), device=q.device)  # positions of real queries
            yield rows - S, attn.probs(q[:, :, rows], k, layout, rows, rec.get("extra"))

    def run(self, idx: torch.Tensor, metrics: Sequence[Metric]) -> None:
        names = set().union(*(m.records for m in metrics)) if metrics else set()
        # the layout of this batch, as the forward builds it (every layer's maps read it)
        layout = self.model.layout(idx.shape[1], idx.device, extra_mask=self.extra_mask) if "maps" in names else None

        def on_layer(i: int, rec: dict) -> None:
            for m in metrics:
                m.update(i, {n: rec[n] for n in m.records if n in rec})
            feed_maps(metrics, i, lambda: self.maps(i, rec, layout))

        with self.hooks(names, on_layer):
            self.model(idx, return_hidden=True, extra_mask=self.extra_mask)  # no metric reads the logits: no LM head


KEEP_CHUNKS_BYTES = 64 << 20  # a layer's map chunks up to this size are kept for a second pass, not recomputed


def feed_maps(metrics: Sequence[Metric], layer: int,
              chunks: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """One layer's map, as the chunks (rows, maps) that `chunks()` yields, to the metrics that record maps
    (`update_maps`), then again to those that read it twice (`update_maps_again`): from the chunks kept on the first
    pass while they fit KEEP_CHUNKS_BYTES, else from `chunks()` called again (memory stays one chunk)."""
    users = [m for m in metrics if "maps" in m.records]
    twice = [m for m in users if m.reads_maps_twice]
    kept: Optional[list] = [] if twice else None
    size = 0
    for rows, a in chunks() if users else ():
        for m in users:
            m.update_maps(layer, rows, a)
        size += a.numel() * a.element_size()
        if kept is not None:
            kept = kept if size <= KEEP_CHUNKS_BYTES else None  # too large: the second pass recomputes them
        if kept is not None:
            kept.append((rows, a))
    for rows, a in (kept if kept is not None else chunks()) if twice else ():
        for m in twice:
            m.update_maps_again(layer, rows, a)


@torch.no_grad()
def measure_all(target, tokens: torch.Tensor, metrics: Sequence[Metric], batch_size: int = 32) -> None:
    """Run `tokens` (N, T) through `target` in batches; every metric sees every layer of every batch (a metric with
    its own input, `Metric.own_input`, sees its own forwards over that instead); then the target tells the metrics
    what it learnt on the way (`settle`: whether a HF model's rows summed to one)."""
    own = [m.own_input(tokens) for m in metrics]
    inputs = [(tokens, [m for m, ids in zip(metrics, own) if ids is None])]
    inputs += [(ids.to(tokens.device), [m]) for m, ids in zip(metrics, own) if ids is not None]
    for ids, group in inputs:
        for start in range(0, ids.shape[0], batch_size) if group else ():
            target.run(ids[start:start + batch_size], group)
            for m in group:
                m.end_batch()
    target.settle(metrics)


def measure_model(model, tokens: torch.Tensor, names: Optional[list[str]] = None, eps: Sequence[float] = (0.3,),
                  k: int = 4, batch_size: int = 32, chunk: int = 128, extra_mask=None) -> list[Metric]:
    """The registered metrics `names` (default all that apply) of a sinklab model on `tokens`, measured (under an
    intervention's `extra_mask` if given)."""
    from .base import METRICS

    target = SinklabRecorder(model, chunk, extra_mask)
    metrics = METRICS.build(target.context(eps, k), names)
    measure_all(target, tokens, metrics, batch_size)
    return metrics


def attention_maps(model, tokens: torch.Tensor, extra_mask=None) -> list[torch.Tensor]:
    """Every layer's whole attention map (B, H, S + T, n_slots + S + T) in one forward (under an intervention's
    `extra_mask`): the explicit, materialising reference (with autograd where it is enabled)."""
    layout = model.layout(tokens.shape[1], tokens.device, extra_mask=extra_mask)
    with recorded_maps(model, layout) as maps:
        model(tokens, extra_mask=extra_mask)
    return maps


@contextlib.contextmanager
def recorded_maps(model, layout) -> Iterator[list[torch.Tensor]]:
    """Inside, a forward of `model` whose layout is `layout` (`Transformer.layout` of the same length, cache and
    mask) appends each layer's whole map (B, H, n_pos, n_keys) to the list yielded, computed from the q and k the
    layer recorded (`Attention.probs`): the maps of `attention_maps`, and of an exported model's
    output_attentions (a KV cache's earlier keys included)."""
    maps: list[torch.Tensor] = []
    qk: dict = {}
    handles = []
    for block in model.blocks:
        attn = block.attn
        handles.append(attn.hook_extra.register_forward_hook(lambda _m, _i, out: qk.__setitem__("extra", out)))
        handles.append(attn.hook_q.register_forward_hook(lambda _m, _i, out: qk.__setitem__("q", out)))

        def on_k(_m, _i, out, attn=attn):
            maps.append(attn.probs(qk["q"], out, layout, layout.rows(), qk["extra"]))
        handles.append(attn.hook_k.register_forward_hook(on_k))
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()


def slot_names(cfg) -> list[str]:
    """Names of the extra key columns in order: the bias slot, then the learned sink tokens."""
    return (["bias"] if cfg.n_slots else []) + [f"token{i}" for i in range(cfg.n_sink_tokens)]
