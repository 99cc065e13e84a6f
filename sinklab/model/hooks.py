"""Hook points: named places in the forward where a tensor that is no module's output passes (the queries, keys and
values after RoPE, the residual stream after the clamp), as TransformerLens's HookPoint. A hook point returns its
input; a forward hook on it sees the tensor, and may return a replacement. Every measurement records through
forward hooks (`sinklab.metrics.record`), on these and on ordinary modules (the attention module's output, a gate's
activation); the forward itself never returns what was recorded."""
from torch import nn


class HookPoint(nn.Identity):
    """x -> x; a place for `register_forward_hook` (no parameters, no state-dict entries)."""
