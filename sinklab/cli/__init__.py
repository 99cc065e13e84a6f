"""`sinklab`: measure, evaluate, sample and quantize checkpoints and models, draw their attention maps, report sweeps,
export to transformers, prepare corpora.

One module per command, each on the shared base `sinklab.cli.base` (parser, errors, device, TARGET / --hf-model,
JSON) and the library below it (`sinklab.targets` loads a model as a `Target`); no command imports another
(tests/cli/test_layering.py). A module of this package that declares `SUMMARY` (its line in `sinklab --help`) is the
command named after it, `_` written `-` (`export_hf.py`: `sinklab export-hf`): `commands` finds them, reading each
module's SUMMARY from its source, so that the listing imports no command. A module without one is an evaluation's
command (`sinklab eval NAME`, `sinklab.evals.EVALUATIONS`) or the base. `sinklab prepare` is also
`scripts/prepare_data.py`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sinklab.cli.base import dispatch
from sinklab.registries import declared, submodules


def commands() -> dict[str, tuple[str, str]]:
    """NAME -> (its module, its line in `sinklab --help`) for every module of `sinklab.cli` that declares a
    `SUMMARY`, in name order."""
    found = {}
    for module in submodules(__name__):
        summary = declared(module, "SUMMARY")
        if summary is not None:
            found[module.rpartition(".")[2].replace("_", "-")] = (module, summary)
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    return dispatch("sinklab", commands(), "training is `sinklab-train` (Hydra); `sinklab COMMAND --help` for a "
                    "command's options", argv)
