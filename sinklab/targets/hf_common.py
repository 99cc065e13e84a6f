"""What every module that calls transformers needs, imported by the transformers target, the GGUF source and the
export alike (none of them imports another for it): transformers or one line saying how to install it, the dtype
keyword of its version, and its progress bars and warnings kept off stderr."""
from __future__ import annotations

import contextlib
import warnings

import torch

from sinklab.errors import UserError

INSTALL_HINT = "--hf-model needs transformers, an optional extra: pip install 'sinklab[hf]'"


def require_transformers():
    """The transformers module, or a one-line UserError saying how to install it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return transformers


def dtype_kwargs(transformers, dtype: torch.dtype) -> dict:
    """`dtype=` for transformers >= 4.56, `torch_dtype=` before (the old name is deprecated in v5)."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


@contextlib.contextmanager
def quiet(transformers):
    """transformers' (and so huggingface_hub's) progress bars and warnings off (stderr is for what matters: errors
    are one line); afterwards each as it was (HF_HUB_DISABLE_PROGRESS_BARS=1 keeps the hub's off, without its
    warning)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hf_logging = transformers.utils.logging
    bars, hub_bars = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # the hub's too
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the hub's "the environment variable keeps the bars off"
            if bars:
                hf_logging.enable_progress_bar()  # the hub's too
            (enable_progress_bars if hub_bars else disable_progress_bars)()
