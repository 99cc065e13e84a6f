"""`sinklab`: measure, evaluate, sample and quantize checkpoints and models, report sweeps, export to transformers,
prepare corpora."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "measure": ("sinklab.measure", "sink and activation metrics of a checkpoint, run dir or transformers model"),
    "quant": ("sinklab.quant.cli", "validation perplexity in fp32 and with simulated W8A8 / W4A4 / W8A16 quantization"),
    "eval": ("sinklab.evals.cli", "streaming perplexity (evicting KV cache), interventions on the sink, quantization"),
    "sample": ("sinklab.evals.sample", "generate text from a trained model with a KV cache"),
    "report": ("sinklab.report", "tables and plots from a (finished or running) sweep dir"),
    "export-hf": ("sinklab.export_hf", "write a checkpoint as a transformers LlamaForCausalLM directory"),
    "prepare": ("sinklab.data.prepare", "tokenise a corpus once into sharded memmaps"),
    "components": ("sinklab.components", "every registered architecture component, its knobs and config files"),
    "check-component": ("sinklab.contracts.command", "run the contract tests on your own component or metric module"),
}


def dispatch(prog: str, commands: dict[str, tuple[str, str]], footer: str,
             argv: Optional[Sequence[str]] = None) -> int:
    """Run `prog NAME ARGS...`: NAME's module's main(ARGS) (imported only then); the listing for no NAME or --help,
    and a one-line error (exit 2) for an unknown NAME or a UserError. `sinklab` and `sinklab eval` are both this."""
    from sinklab.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        lines = [f"usage: {prog} COMMAND [ARGS...]", "", "commands:"]
        width = max(map(len, commands))
        lines += [f"  {name:<{width}} {desc}" for name, (_, desc) in commands.items()]
        print("\n".join(lines + ["", footer]))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}; allowed: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        from sinklab.plugins import load_plugins

        load_plugins()  # components and metrics of the user's packages (entry points, SINKLAB_PLUGINS)
        module = importlib.import_module(commands[name][0])
        return int(module.main(rest) or 0)
    except UserError as err:
        print(f"{prog} {name}: error: {err}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    return dispatch("sinklab", COMMANDS, "training is `sinklab-train` (Hydra); `sinklab COMMAND --help` for a "
                    "command's options", argv)


if __name__ == "__main__":
    sys.exit(main())
