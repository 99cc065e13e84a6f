"""`sinklab`: measure, evaluate, sample and quantize checkpoints and models, draw their attention maps, report sweeps,
export to transformers, prepare corpora.

One module per command, each on the shared base `sinklab.cli.base` (parser, errors, device, TARGET / --hf-model,
JSON) and the library below it (`sinklab.targets` loads a model as a `Target`); no command imports another
(tests/cli/test_layering.py). `sinklab prepare` is also `scripts/prepare_data.py`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sinklab.cli.base import dispatch

COMMANDS = {
    "measure": ("sinklab.cli.measure", "sink and activation metrics of a checkpoint, run dir or transformers model"),
    "trajectory": ("sinklab.cli.trajectory", "every metric over a training: a run's kept checkpoints or a model's "
                   "hub revisions -> CSV by step and tokens, and a plot"),
    "atlas": ("sinklab.cli.atlas", "every head's attention map as one self-contained HTML page, with a slider over a "
              "run's kept checkpoints"),
    "quant": ("sinklab.cli.quant", "validation perplexity in fp32 and with simulated W8A8 / W4A4 / W8A16 quantization"),
    "eval": ("sinklab.cli.eval", "streaming perplexity (evicting KV cache), interventions on the sink, quantization"),
    "sample": ("sinklab.cli.sample", "generate text from a trained model with a KV cache"),
    "report": ("sinklab.cli.report", "tables and plots from a (finished or running) sweep dir"),
    "export-hf": ("sinklab.cli.export_hf", "write a checkpoint as a transformers LlamaForCausalLM directory"),
    "import-hf": ("sinklab.cli.import_hf", "a transformers LLaMA-family model (dir, hub id or GGUF file) as a sinklab "
                  "run dir: measure it, evaluate it, continue its pretraining with init_from="),
    "prepare": ("sinklab.cli.prepare", "tokenise a corpus once into sharded memmaps"),
    "components": ("sinklab.cli.components", "every registered architecture component, its knobs and config files"),
    "check-component": ("sinklab.cli.check_component",
                        "run the contract tests on your own component or metric module"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return dispatch("sinklab", COMMANDS, "training is `sinklab-train` (Hydra); `sinklab COMMAND --help` for a "
                    "command's options", argv)
