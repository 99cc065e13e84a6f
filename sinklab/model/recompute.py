"""The explicit path with each row chunk's map recomputed in backward (`model.attn_memory=linear`), as one autograd
function whose loops leave the allocator as they found it.

Forward: the chunks' outputs are written into one (B, H, N, hd) tensor; no map is kept. Backward, chunk by chunk from
the last: the chunk's map is recomputed with autograd, its gradients taken, the chunk's rows written into dq and its
key / value / parameter gradients added in place into accumulators allocated once, before the loop. Decided here,
instead of `torch.utils.checkpoint` per chunk (what this path used before, with the same numbers): there each chunk's
backward handed autograd a new full-size gradient for k, for v and (a slice's backward) for q, allocated between
the chunk's (B, H, R, n_keys) maps and kept while the next chunk's maps were allocated. glibc's heap did not give
those holes back, so a whole run's resident memory grew with the number of chunks, i.e. with T^2 (docs/
performance.md, "Whole runs"), although the tensors alive at any moment did not.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

# (q rows, k, v, r0, more) -> the rows' output; `more`: further per-token tensors the rows read (an op's own keys)
Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, tuple], torch.Tensor]


class RecomputedRows(torch.autograd.Function):
    """o = concat over row chunks of rows(q[:, :, r0:r0 + R], k, v, r0, more), the maps recomputed in backward.
    q (B, H, N, hd), k and v (B, H, n_keys, hd) -> o (B, H, N, hd_v); `more`: the first `n_more` tensors after v,
    passed to the rows (and, in backward, detached like k and v: activations, whose graph the outer backward goes on
    through); `params`: the rest, every tensor the maps read from their modules (the op's parameters, a learned
    position bias), so that they get their gradients."""

    @staticmethod
    def forward(ctx: Any, rows: Rows, chunk: int, n_more: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *rest: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.chunk = rows, chunk
        ctx.autocast = autocast_state(q.device.type)
        more = rest[:n_more]
        ctx.save_for_backward(q, k, v, *more)
        ctx.params = rest[n_more:]  # the module's own tensors, which the rows use and which take the gradients
        out = None
        for r0 in range(0, q.shape[2], chunk):
            qr = q[:, :, r0:r0 + chunk]  # (B, H, R, hd)
            o = rows(qr, k, v, r0, more)  # (B, H, R, hd_v)
            if out is None:  # the rows' dtype (under autocast, not necessarily q's)
                out = o.new_empty(*q.shape[:3], o.shape[-1])  # (B, H, N, hd_v)
            out[:, :, r0:r0 + qr.shape[2]] = o
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        inputs = (*ctx.saved_tensors, *ctx.params)  # q, k, v, *more, *params
        needs = ctx.needs_input_grad[3:]
        grads = [torch.zeros_like(x) if need else None for x, need in zip(inputs, needs)]  # allocated once
        reached = [False] * len(inputs)
        n_more = len(ctx.saved_tensors) - 3
        for r0 in reversed(range(0, inputs[0].shape[2], ctx.chunk)):  # the last chunk first, as autograd ran them
            add_chunk_grads(ctx, inputs, n_more, needs, grad, r0, grads, reached)
        # an input no chunk's output depends on (an indexer whose choice passes no gradient) gets None, as it would
        # without the recomputation
        return (None, None, None, *(g if hit else None for g, hit in zip(grads, reached)))


def add_chunk_grads(ctx: Any, inputs: Sequence[torch.Tensor], n_more: int, needs: Sequence[bool],
                    grad: torch.Tensor, r0: int, grads: list, reached: list) -> None:
    """Recompute the rows r0 .. r0 + R - 1 with autograd and put their gradients into `grads`: the rows of dq
    written, the rest added in place; `reached[i]` set where input i got one. Everything this allocates is freed when
    it returns."""
    device, enabled, dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
        qr = inputs[0][:, :, r0:r0 + ctx.chunk].detach().requires_grad_(needs[0])  # (B, H, R, hd)
        k, v, *more = (x.detach().requires_grad_(need) for x, need in zip(inputs[1:3 + n_more], needs[1:3 + n_more]))
        leaves = (qr, k, v, *more, *inputs[3 + n_more:])  # the parameters as they are: the rows read their modules'
        out = ctx.rows(qr, k, v, r0, tuple(more))  # (B, H, R, hd_v)
        wanted = [i for i, need in enumerate(needs) if need]
        found = torch.autograd.grad(out, [leaves[i] for i in wanted], grad[:, :, r0:r0 + qr.shape[2]],
                                    allow_unused=True)
    for i, g in zip(wanted, found):
        if g is None:
            continue
        reached[i] = True
        if i == 0:
            grads[0][:, :, r0:r0 + qr.shape[2]] = g  # this chunk's rows of dq
        else:
            grads[i] += g


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The forward's autocast (device, enabled, dtype), re-entered for the recomputation in backward."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == "cuda":
        return device_type, torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return device_type, torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def recomputed_rows(rows: Rows, chunk: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: Sequence[torch.Tensor], more: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """`RecomputedRows` over `more` (passed to the rows) and the parameters that take a gradient."""
    return RecomputedRows.apply(rows, chunk, len(more), q, k, v, *more, *(p for p in params if p.requires_grad))
