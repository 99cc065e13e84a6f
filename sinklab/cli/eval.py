"""`sinklab eval NAME`: the registered evaluations (`sinklab.evals.EVALUATIONS`: sinklab's and a plugin's, which
`sinklab eval --help` lists) of a checkpoint, a run dir, a transformers model, or every finished job of a sweep
(--sweep)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from sinklab.cli.base import dispatch
from sinklab.errors import UserError

SUMMARY = ("the registered evaluations of a model, or of every finished job of a sweep (`sinklab eval --help` lists "
           "them)")

FOOTER = "`sinklab eval NAME --help` for its options; with --sweep SWEEP_DIR, over every finished job of a sweep"


def subcommands() -> dict[str, tuple[str, str]]:
    """NAME -> (its command module, its line) for every registered evaluation, a plugin's too (loaded first)."""
    from sinklab.evals import EVALUATIONS
    from sinklab.plugins import load_plugins

    load_plugins()
    return {evaluation.name: (evaluation.command, evaluation.summary) for evaluation in EVALUATIONS}


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        commands = subcommands()
    except UserError as err:
        print(f"sinklab eval: error: {err}", file=sys.stderr)
        return 2
    return dispatch("sinklab eval", commands, FOOTER, argv)
