"""sinklab: small-scale language-model pretraining ablations for studying attention sinks."""
from __future__ import annotations

__version__ = "0.1.0"

from sinklab.errors import UserError  # noqa: E402


def load_model(path):
    """A sinklab checkpoint (.ckpt) or a run dir (its checkpoints/last.ckpt) -> the Transformer in eval mode.
    Its call on a (batch, T) LongTensor of token ids returns logits (batch, T, vocab)."""
    from sinklab.runs.checkpoints import load_model as _load

    return _load(path)


__all__ = ["UserError", "load_model", "__version__"]
