"""torch.compile for a sinklab model: which backends exist, whether compilation can work here, the compiled model
with an eager fallback, and what a failed compilation raises. Below `sinklab.train` (no Lightning): training compiles
with it (`sinklab.train.module`) and config validation checks `compile_backend` with it (`sinklab.config.validate`)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional

import torch

from sinklab.errors import UserError
from sinklab.model.config import ModelConfig
from sinklab.model.transformer import Transformer


class CompileFallbackWarning(UserWarning):
    """model.compile=true, but the model runs eager (torch.compile failed or is not supported here)."""


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compilation raises from the compiled model's call: Dynamo's errors (including
    BackendCompilerFailed, which wraps the backend's own, e.g. a C++ compiler error of inductor) and inductor's."""
    import torch._dynamo.exc as dynamo_exc

    errors: list[type[BaseException]] = [dynamo_exc.TorchDynamoException]
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    return tuple(errors)


def backward_compiled_with_forward():
    """AOTAutograd compiles the backward graph lazily, at the first backward pass, where a failure would escape the
    fallback in LitLM.run_model; this compiles it together with the forward (a private switch of torch >= 2.7: a
    no-op where it does not exist)."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def first_lines(err: BaseException, limit: int = 300) -> str:
    """'Type: message' from the first two non-empty lines of an error (BackendCompilerFailed puts the backend's
    own error on its second line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()][:2]
    text = f"{type(err).__name__}: {' '.join(lines)}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compile_backends() -> list[str]:
    """The torch.compile backends registered in this torch (names for model.compile_backend)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def check_compile_backend(backend: Any) -> None:
    if not isinstance(backend, str) or backend not in compile_backends():
        raise UserError(f"compile_backend={backend!r} is not allowed; allowed: one of {', '.join(compile_backends())} "
                        "(torch.compile's registered backends; inductor is the default)")


def compile_skip_reason(cfg: ModelConfig) -> Optional[str]:
    """Why torch.compile cannot work for this model here, known before trying; None when it may. Every attention
    switch compiles (docs/performance.md); what is known not to is a platform without TorchDynamo support."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "TorchDynamo does not support this platform or Python version"
    return None


def compile_model(model: Transformer, cfg: ModelConfig, backend: str = "inductor"):
    """torch.compile where it can work, else the eager model with one warning. torch.compile itself only wraps the
    model: compilation happens at its first call, where LitLM.run_model falls back to eager if it fails."""
    check_compile_backend(backend)
    reason = compile_skip_reason(cfg)
    if reason is None:
        try:
            return torch.compile(model, backend=backend, dynamic=False)
        except Exception as err:  # torch.compile rejects its arguments or the platform
            reason = first_lines(err)
    warnings.warn(f"model.compile=true: torch.compile is not used ({reason}); running eager",
                  CompileFallbackWarning, stacklevel=2)
    return model
