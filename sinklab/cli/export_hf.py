"""`sinklab export-hf CKPT_OR_RUN_DIR OUT_DIR`: a sinklab checkpoint as a Hugging Face directory, `LlamaForCausalLM`
where LLaMA can represent the config, else `SinklabForCausalLM` as remote code (`sinklab.export.llama`, whose
docstring says what is exported and checked). Bad input (a plugin's component that nothing could import, among
others) is one line on stderr and exit code 2; an export whose logits disagree with the checkpoint's, exit code 1.
`--revisions` exports every checkpoint a run kept as the branches step<N> of one local git repository
(`sinklab.export.revisions`), which `sinklab trajectory --hf-model OUT_DIR --revision step<N> ...` reads.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sinklab.cli.base import OneLineParser, exit_code
from sinklab.export.llama import DTYPES, ParityError, export
from sinklab.export.revisions import export_revisions

PROG = "sinklab export-hf"
SUMMARY = "write a checkpoint as a transformers LlamaForCausalLM directory"  # the line in `sinklab --help`


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog=PROG, description="Export a sinklab checkpoint as a Hugging Face directory: "
                                              "LlamaForCausalLM where LLaMA can represent the config, else "
                                              "SinklabForCausalLM as remote code (load it with "
                                              "trust_remote_code=True; it needs sinklab installed).")
    ap.add_argument("ckpt", metavar="CKPT", help="a sinklab .ckpt or a run dir (its checkpoints/last.ckpt)")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="new (or empty) output directory")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weights dtype (default float32)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip loading the export back and comparing logits with the sinklab model")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (or a dir holding one) to export with it")
    ap.add_argument("--no-tokenizer", action="store_true", help="do not look for the run's tokenizer")
    ap.add_argument("--revisions", action="store_true",
                    help="CKPT is a run dir: write each checkpoint it kept (and last.ckpt) as a branch step<N> of "
                         "OUT_DIR, a git repository whose main is the newest (needs git)")
    args = ap.parse_args(argv)
    options = dict(dtype=args.dtype, check=not args.no_check, tokenizer=args.tokenizer,
                   with_tokenizer=not args.no_tokenizer)
    if args.revisions:
        return exit_code(PROG, lambda: export_revisions(args.ckpt, args.out_dir, **options), (ParityError,))
    return exit_code(PROG, lambda: export(args.ckpt, args.out_dir, **options), (ParityError,))
