"""What every `sinklab` command shares: the one-line-error parser, the run-and-print main, the device choice, the
TARGET / --hf-model arguments, an evaluation's --sweep, strict JSON, and the dispatcher of `sinklab` and `sinklab
eval`.

A command module (`sinklab.cli.<command>`) builds its parser here, checks its options, calls the library (never
another command) and formats the result. User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from sinklab.errors import UserError

if TYPE_CHECKING:  # torch is imported when a device is picked: `sinklab --help` and `sinklab report` need none
    import torch

    from sinklab.targets import Target, TargetMeta, TargetSpec

DEVICE_HELP = "auto (cuda if available), cpu, cuda, cuda:1, ..."
JSON_HELP = "print one JSON object (see the module docstring)"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (and exit code 2, as argparse's own)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_device_json_args(parser: argparse.ArgumentParser, json_help: str = JSON_HELP) -> None:
    """--device (`pick_device`) and --json (`command_main`)."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help=json_help)


def pick_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return dev


def add_target_args(parser: argparse.ArgumentParser, uses: str, hf_help: str, many: bool = False) -> None:
    """TARGET (a checkpoint or run dir, of which the command `uses` ...) or --hf-model NAME_OR_DIR (`many`: one or
    more), with --revision and --dtype (`add_hf_args`): one of the two (`check_one_target`);
    `sinklab.targets.load_target` loads it (`target_spec`)."""
    parser.add_argument("target", nargs="?", default=None,
                        help=f"a sinklab .ckpt or a run dir (uses its checkpoints/last.ckpt and {uses})")
    parser.add_argument("--hf-model", metavar="NAME_OR_DIR", nargs="+" if many else None, default=None,
                        help=hf_help + " (a local dir written by save_pretrained, a GGUF file, or a hub id: "
                                       "huggingface_hub's cache, read offline with HF_HUB_OFFLINE=1)")
    add_hf_args(parser)


def add_hf_args(parser: argparse.ArgumentParser) -> None:
    """--revision and --dtype of a --hf-model (`sinklab.targets.transformers_lm.load_hf_model`)."""
    from sinklab.targets.hub_models import DTYPES

    parser.add_argument("--revision", default=None,
                        help="with a hub id, or a local git repository (export-hf --revisions): its branch, tag or "
                             "commit (default main; e.g. step1000 of Pythia)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the --hf-model's weights and activations: auto (bfloat16 on CUDA, float32 on the "
                             "CPU), float32, bfloat16, float16")


def check_one_target(args) -> None:
    if (args.target is None) == (args.hf_model is None):
        raise UserError("pass either TARGET (a sinklab checkpoint or run dir) or --hf-model NAME_OR_DIR, not "
                        + ("both" if args.target else "neither"))
    if args.target is not None:
        for flag, value, default in (("--revision", args.revision, None), ("--dtype", args.dtype, "auto")):
            if value != default:
                raise UserError(f"{flag} {value}: applies to --hf-model only (a sinklab checkpoint is measured in "
                                "float32 as it was saved)")


def target_spec(args, device) -> "TargetSpec":
    """TARGET or --hf-model (one model name; `check_one_target` has run), --revision, --dtype and the device, as the
    `sinklab.targets.TargetSpec` that `load_target` takes."""
    from sinklab.targets import Target, TargetMeta, TargetSpec

    if args.hf_model is not None:
        name = args.hf_model[0] if isinstance(args.hf_model, list) else args.hf_model
        return TargetSpec(str(name), "hf", args.revision, args.dtype, device)
    return TargetSpec(str(args.target), "sinklab", args.revision, args.dtype, device)


def load_checked_target(args) -> tuple["Target", "torch.device", float]:
    """The model TARGET or --hf-model names, loaded on --device once every argument was checked (`check_one_target`
    first), the device, and the time its loading started (a result's `seconds` count the load)."""
    from sinklab.targets import load_target

    device = pick_device(args.device)
    t0 = time.perf_counter()
    return load_target(target_spec(args, device)), device, t0


def refuse_prefix_lm(meta: "TargetMeta", what: str) -> None:
    """One line for a prefix LM, which has no token-by-token `what` (stream, cache): its first tokens see each
    other."""
    if meta.prefix_len:
        raise UserError(f"model.prefix_len={meta.prefix_len}: a prefix LM's first tokens see each other, so it has "
                        f"no token-by-token {what}; allowed: causal models (model.prefix_len=0)")


def data_run_dir(args, run_dir: Optional[Path],
                 hint: str = "pass --data RUN_DIR or --tokens FILE.npy") -> tuple[Path, str]:
    """The run dir whose data a command reads, and the flag to name in its errors: --data RUN_DIR, else TARGET's own
    run dir (one-line errors when --data is no run dir or there is none, ending with `hint`)."""
    from sinklab.runs.run_data import is_run_dir

    if args.data is not None:
        data = Path(args.data)
        if not is_run_dir(data):
            raise UserError(f"--data {args.data}: not a run dir (it has no .hydra/config.yaml)")
        return data, "--data"
    if run_dir is None:
        where = "an HF model has no run config" if getattr(args, "hf_model", None) else \
            f"{args.target} has no run config (.hydra/config.yaml)"
        raise UserError(f"choose the data: {where}; {hint}")
    return run_dir, "TARGET"


def check_files(*given: tuple[str, Optional[str]]) -> None:
    """Each (flag, path) given names an existing file: checked before a model is loaded, one line otherwise."""
    for flag, path in given:
        if path is not None and not Path(path).is_file():
            raise UserError(f"{flag} {path}: no such file")


def check_data_args(args) -> None:
    """The data of a command that reads a run's blocks or token files (quant, eval streaming, eval intervene),
    checked before the model is loaded: --data or --tokens (not both), the files named exist, --calib-tokens only
    with --tokens, and without --tokens a run to read: --data RUN_DIR, or TARGET's own run dir."""
    from sinklab.runs.run_data import checkpoint_and_run_dir

    calib = getattr(args, "calib_tokens", None)
    if args.tokens is not None and args.data is not None:
        raise UserError("pass either --data RUN_DIR or --tokens FILE.npy, not both")
    if calib is not None and args.tokens is None:
        raise UserError("--calib-tokens goes with --tokens (a run's data calibrates on its training blocks)")
    check_files(("--tokens", args.tokens), ("--calib-tokens", calib))
    if args.tokens is None:
        data_run_dir(args, checkpoint_and_run_dir(args.target)[1] if args.target is not None else None)


def name_list(what: str) -> Callable[[str], list[str]]:
    """An argparse type: 'a,b' -> ['a', 'b'] (deduplicated, in order), a usage error naming `what` when empty."""
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {what}")
        return list(dict.fromkeys(names))
    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: '0,1,4' -> [0, 1, 4] (deduplicated, in order), a usage error unless every item is an
    integer >= 0 (--first / --recent / --window / --budgets of eval streaming, --layers of eval intervene)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers >= 0, e.g. 0,1,4")
    return list(dict.fromkeys(values))


def knob_value(flag: str, item: str, value: str) -> float | int | bool | str:
    """A --knob value: an int, a float, true / false, or else the text (a rule's name, e.g. snapkv.pooling=sinklab;
    the policy checks it and `build` refuses text for a number knob); one line naming `flag` `item` for no value."""
    text = value.strip()
    if not text:
        raise UserError(f"{flag} {item}: no value; allowed: a number, true / false, or a name")
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def finite(obj: Any) -> Any:
    """NaN / inf (e.g. a norm ratio with T = 1) -> null, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def add_sweep_args(parser: argparse.ArgumentParser, evaluation: str) -> None:
    """--sweep SWEEP_DIR and --jobs N ...: the registered evaluation `evaluation` (`sinklab.evals.registry`) over
    every finished job of a sweep instead of one TARGET (`run_sweep`)."""
    parser.add_argument("--sweep", metavar="SWEEP_DIR", default=None,
                        help=f"instead of TARGET: every job dir of this sweep with checkpoints/last.ckpt, each "
                             f"result (what --json prints) into JOB/{evaluation}.json (a rerun adds its settings to "
                             f"the job's earlier result of the same checkpoint and data, else keeps that one as "
                             f"JOB/{evaluation}.K.json), then SWEEP_DIR/{evaluation}.csv"
                             " with one row per job (job, its overrides, the result's columns), which `sinklab "
                             "report` reads")
    parser.add_argument("--jobs", nargs="+", metavar="N", default=None,
                        help="with --sweep: only these job dirs, e.g. --jobs 0 1 2 (default: all); the CSV has every "
                             f"job with a {evaluation}.json")
    parser.set_defaults(evaluation=evaluation)


def checkpoint_stamp(job: Path) -> dict:
    """What tells one checkpoint of a job from another (a retrained job): checkpoints/last.ckpt's size and time."""
    stat = (job / "checkpoints" / "last.ckpt").stat()
    return {"bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}


def keep_earlier(evaluation, path: Path, res: dict) -> dict:
    """The result to write at `path` (JOB/NAME.json) so that nothing written before is lost: `res` merged into an
    earlier result of the same checkpoint and data (`Evaluation.merge`), or `res` with the earlier file moved to
    JOB/NAME.K.json (K = 1, 2, ...: the first free), each said in one line on stderr."""
    if not path.is_file():
        return res
    try:
        earlier = json.loads(path.read_text())
    except ValueError:
        earlier = None
    merged = evaluation.merge(earlier, res) if isinstance(earlier, dict) else None
    if merged is not None:
        part = next(iter(evaluation.settings))
        kept = len(merged[part]) - len(res[part])
        print(f"== {path}: merged with the earlier result ({kept} setting{'s' if kept != 1 else ''} of it kept)",
              file=sys.stderr)
        return merged
    apart = next(p for p in (path.with_suffix(f".{k}.json") for k in itertools.count(1)) if not p.exists())
    path.rename(apart)
    print(f"== {path}: the earlier result (another checkpoint, data or options) kept as {apart.name}", file=sys.stderr)
    return res


def run_sweep(prog: str, args, run: Callable[[Any], dict]) -> str:
    """`--sweep SWEEP_DIR`: run(args) with TARGET = each finished job dir of the sweep (or of --jobs), in this
    process, each result written as JOB/NAME.json (what --json prints, with the checkpoint's stamp; merged into an
    earlier result of the job, or that one kept apart: `keep_earlier`), then SWEEP_DIR/NAME.csv from every job's
    NAME.json (`sinklab.evals.registry.write_table`). A job dir without checkpoints/last.ckpt is skipped with a line
    on stderr. Returns the line saying what was written."""
    from sinklab.evals.registry import EVALUATIONS, finished_jobs, write_table
    from sinklab.io import atomic_write

    if args.target is not None or args.hf_model is not None:
        raise UserError(f"--sweep {args.sweep}: pass either --sweep SWEEP_DIR or one model (TARGET, --hf-model), "
                        "not both")
    evaluation, sweep = EVALUATIONS.get(args.evaluation), Path(args.sweep)
    done, skipped = finished_jobs(sweep, args.jobs)
    for job in skipped:
        print(f"== {job}: no checkpoints/last.ckpt (not finished?), skipped", file=sys.stderr)
    for job in done:
        print(f"== {prog} {job} -> {job / evaluation.name}.json", flush=True)
        try:
            res = run(argparse.Namespace(**{**vars(args), "target": str(job), "json": True}))
        except UserError as err:
            raise UserError(f"job {job}: {err}") from None
        path = job / f"{evaluation.name}.json"
        res = keep_earlier(evaluation, path, {**finite(res), "checkpoint": checkpoint_stamp(job)})
        atomic_write(path, json.dumps(res, allow_nan=False) + "\n")
    path, rows = write_table(evaluation, sweep)
    return f"wrote {path} ({rows} job{'s' if rows != 1 else ''})"


def command_main(prog: str, parser: argparse.ArgumentParser, run: Callable[[Any], dict],
                 text: Callable[[dict], str], argv: Optional[Sequence[str]]) -> int:
    """Parse argv, res = run(args), print res as one JSON object (--json) or as text(res); with --sweep SWEEP_DIR
    (`add_sweep_args`), `run_sweep`. A UserError is one line on stderr and exit code 2."""
    args = parser.parse_args(argv)
    try:
        if getattr(args, "sweep", None) is not None:
            print(run_sweep(prog, args, run))
            return 0
        if getattr(args, "jobs", None) is not None:
            raise UserError(f"--jobs {' '.join(args.jobs)}: goes with --sweep SWEEP_DIR")
        # in JSON mode stdout carries exactly one object: anything printed while running goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            res = run(args)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(finite(res), allow_nan=False) if args.json else text(res))
    return 0


def exit_code(prog: str, call: Callable[[], Any], failures: tuple[type[Exception], ...] = ()) -> int:
    """`call()` as a command's body: 0; a UserError is one line on stderr and exit code 2; an exception of `failures`
    (the result is wrong, not the input: export-hf's and import-hf's parity check) one line and exit code 1."""
    try:
        call()
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


def dispatch(prog: str, commands: dict[str, tuple[str, str]], footer: str,
             argv: Optional[Sequence[str]] = None) -> int:
    """Run `prog NAME ARGS...`: NAME's module's main(ARGS) (imported only then); the listing for no NAME or --help,
    and a one-line error (exit 2) for an unknown NAME or a UserError. `sinklab` and `sinklab eval` are both this."""
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
    from sinklab.plugins import PluginImportError, load_plugins, show_import_failure

    try:
        load_plugins()  # components and metrics of the user's packages (entry points, SINKLAB_PLUGINS)
        module = importlib.import_module(commands[name][0])
        return int(module.main(rest) or 0)
    except UserError as err:
        print(f"{prog} {name}: error: {err}", file=sys.stderr)
        return 2
    except PluginImportError as err:  # the plugin's own bug: named, then its traceback
        show_import_failure(f"{prog} {name}", err)
        return 1
