"""The README's command lines, and `sinklab` run in this process."""
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HYDRA_SCHEMA_WARNING = "automatic_schema_matching"  # in Hydra's deprecation warning (the address of its docs)


def readme_cli_lines(prefix: str, paths: dict[str, Path]) -> list[list[str]]:
    """The README's lines starting with `prefix` (e.g. "sinklab sample "), comments stripped, as the arguments after
    `sinklab`; the placeholder paths of the README (keys of `paths`, e.g. runs/a) replaced by the test's."""
    lines = [line.split("  #", 1)[0].strip() for line in README.read_text().splitlines() if line.startswith(prefix)]
    return [[str(paths.get(a, a)) for a in shlex.split(line)[1:]] for line in lines]


def readme_commands() -> list[str]:
    """`sinklab-train ...` lines of the README's code blocks, comments stripped."""
    commands, in_block = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and line.startswith("sinklab-train"):
            commands.append(line.split("#", 1)[0].strip())
    return commands


def run_sinklab(capsys, *args: str) -> tuple[int, str, str]:
    """`sinklab ARGS...` in this process: (exit code, stdout, stderr); argparse's usage errors exit too."""
    from sinklab.cli import main

    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err
