"""Hook points: named places in the forward where a tensor that is no module's output passes (the queries, keys and
values before and after RoPE, the attention map and the heads' output, the residual stream before, between and after
the sublayers), as TransformerLens's HookPoint. A hook point returns its input; a forward hook on it sees the tensor,
and may return a replacement. Every measurement records through forward hooks (`sinklab.metrics.record`), on these
and on ordinary modules (the attention module's output, a gate's activation); the forward itself never returns what
was recorded. TransformerLens's canonical names for them, and `run_with_cache` / `run_with_hooks`, are in
`sinklab.model.hooked`."""
from torch import nn


class HookPoint(nn.Identity):
    """x -> x; a place for `register_forward_hook` (no parameters, no state-dict entries)."""

    @property
    def active(self) -> bool:
        """Whether a hook is attached: a hook point whose tensor costs work of its own to compute (the attention
        map, on a fused backend) is computed only then."""
        return bool(self._forward_hooks or self._forward_pre_hooks)
