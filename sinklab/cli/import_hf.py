"""`sinklab import-hf SRC OUT_DIR`: a transformers causal LM of the LLaMA family (a save_pretrained dir, a hub id, a
GGUF file) as a sinklab run dir (`sinklab.export.hf_import`, whose docstring says what is written and checked). Bad
input (another architecture, a feature sinklab's model does not have) is one line on stderr and exit code 2; an
import whose logits disagree with transformers', exit code 1 and nothing written.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sinklab.cli.base import OneLineParser, exit_code
from sinklab.export.llama import ParityError

PROG = "sinklab import-hf"
SUMMARY = ("a transformers LLaMA-family model (dir, hub id or GGUF file) as a sinklab run dir: measure it, evaluate it, "
           "continue its pretraining with init_from=")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog=PROG, description="Import a transformers LLaMA-family causal LM as a sinklab run dir "
                                              "(checkpoints/last.ckpt, tokenizer.json, .hydra/config.yaml), which "
                                              "every sinklab command and sinklab-train init_from= take.")
    ap.add_argument("src", metavar="SRC", help="a transformers model dir, a hub id, or a .gguf file (or a dir "
                                               "holding one)")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="new (or empty) output directory")
    ap.add_argument("--revision", default=None, help="a hub id's branch, tag or commit")
    ap.add_argument("--no-check", action="store_true",
                    help="skip comparing the imported model's logits with transformers'")
    args = ap.parse_args(argv)
    from sinklab.export.hf_import import import_hf

    return exit_code(PROG, lambda: import_hf(args.src, args.out_dir, revision=args.revision,
                                             check=not args.no_check), (ParityError,))
