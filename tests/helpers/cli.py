"""The command lines of the user-facing documentation (the README and every page under docs/); sinklab's commands
run as a test needs them (`run_cli`: in this process, or in a subprocess as a user runs them;
`run_cli_in_one_process`: several calls in one subprocess); and the one-line error that every user error must be
(`assert_one_line_error`)."""
import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import warnings as _warnings
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
HYDRA_SCHEMA_WARNING = "automatic_schema_matching"  # in Hydra's deprecation warning (the address of its docs)
MODULES = {"sinklab": "sinklab", "sinklab-train": "sinklab.train.entry"}  # console script -> its `python -m` module
_TABLE_COMMAND = re.compile(r"^`((?:sinklab|sinklab-train)(?: [^`]*)?)`$")  # a table cell that is one command


def doc_files() -> list[Path]:
    """The pages a user reads, whose commands the tests run: README.md, then every Markdown page of the
    documentation site's source (docs/, in path order; the pages the site generates hold no commands)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def doc_code_lines(files: Optional[Sequence[Path]] = None, langs: Optional[Sequence[str]] = None) -> list[str]:
    """The lines of the fenced code blocks of `files` (default: `doc_files()`), in order, and each cell of the README's
    tables that is one `sinklab ...` command in backticks (its first commands; other pages' tables record
    measurements); `langs`: only blocks of those info
    strings (e.g. ("bash",); a table's commands count as bash)."""
    lines: list[str] = []
    for path in doc_files() if files is None else files:
        lang = None
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                lang = line[3:].strip() if lang is None else None
            elif lang is not None:
                if langs is None or lang in langs:
                    lines.append(line)
            elif line.startswith("|") and path == README and (langs is None or "bash" in langs):
                lines += [m.group(1) for cell in line.strip("|").split("|")
                          if (m := _TABLE_COMMAND.match(cell.strip()))]
    return lines


def readme_cli_lines(prefix: str, paths: dict[str, Path], files: Optional[Sequence[Path]] = None) -> list[list[str]]:
    """The documentation's command lines starting with `prefix` (e.g. "sinklab sample "), each once, in the order of
    `doc_files()`, comments stripped, as the arguments after `sinklab`; the documentation's placeholder paths (keys
    of `paths`, e.g. runs/a) replaced by the test's."""
    lines = dict.fromkeys(line.split("  #", 1)[0].strip() for line in doc_code_lines(files) if line.startswith(prefix))
    return [[str(paths.get(a, a)) for a in shlex.split(line)[1:]] for line in lines]


def readme_commands(files: Optional[Sequence[Path]] = None) -> list[str]:
    """The documentation's `sinklab-train ...` command lines, each once, comments stripped."""
    return list(dict.fromkeys(line.split("#", 1)[0].strip() for line in doc_code_lines(files)
                              if line.startswith("sinklab-train")))


def doc_section(title: str) -> str:
    """The text of the documentation from the heading `title` (any level) to the end of its page."""
    for path in doc_files():
        text = path.read_text()
        match = re.search(rf"^#+ {re.escape(title)}\s*$", text, re.MULTILINE)
        if match:
            return text[match.start():]
    raise AssertionError(f"no page of the documentation has a heading {title!r}")


class Ran(NamedTuple):
    """What a command gave: its exit code and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(command: str, *args: str, capsys=None, process: bool = False, env: Optional[dict] = None,
            warnings: Optional[str] = None, cwd: Optional[Path] = None, timeout: float = 600,
            check: bool = False) -> Ran:
    """`COMMAND ARGS...` (`sinklab` or `sinklab-train`): (exit code, stdout, stderr).

    In this process by default (fast): the console script's own `main`, whose argparse and Hydra exits become the
    exit code; what it prints is read from `capsys` where the test passes it, else captured here. With `process`, in a
    subprocess as a user runs it (`start_cli`), for what only a process shows: a real exit, the warnings a user sees,
    an environment of its own (`env`, `cwd`). `warnings` is the warnings filter (PYTHONWARNINGS in a subprocess);
    None leaves the current one. With `check`, a non-zero exit fails the test, showing what the command printed."""
    assert command in MODULES, f"unknown command {command!r}; allowed: {', '.join(MODULES)}"
    if process:
        ran = finish(start_cli(command, *args, env=env, warnings=warnings, cwd=cwd), timeout)
    else:
        assert env is None and cwd is None, "env and cwd are a subprocess's: pass process=True"
        ran = _run_here(command, list(args), capsys, warnings)
    if check and ran.returncode != 0:
        raise AssertionError(f"{command} exited {ran.returncode}:\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}")
    return ran


def _run_here(command: str, args: list[str], capsys, warnings: Optional[str]) -> Ran:
    stdout, stderr, argv = io.StringIO(), io.StringIO(), sys.argv
    with contextlib.ExitStack() as stack:
        stack.enter_context(_root_handlers_kept())
        stack.enter_context(_warnings.catch_warnings())
        if warnings is not None:
            _warnings.simplefilter(warnings)
        if capsys is None:
            stack.enter_context(contextlib.redirect_stdout(stdout))
            stack.enter_context(contextlib.redirect_stderr(stderr))
        try:
            if command == "sinklab-train":  # the console script reads sys.argv
                from sinklab.train.entry import main

                sys.argv = [command, *args]
                code = main()
            else:
                from sinklab.cli import main

                code = main(args)
        except SystemExit as exc:  # argparse's usage errors, Hydra's and sinklab-train's exits
            code = exc.code
        finally:
            sys.argv = argv
    code = code if isinstance(code, int) else 0 if code is None else 1  # SystemExit's own rule
    if capsys is not None:
        out, err = capsys.readouterr()
        return Ran(code, out, err)
    return Ran(code, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _root_handlers_kept():
    """The root logger's handlers as they were: a Hydra run in this process (sinklab-train's main) puts its console
    and its run's train.log handler there, which a process of its own drops at its end; here they would outlive the
    run, and the next test's log lines would go to this one's train.log (an error once pytest removed its folder)."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
            handler.close()
        for handler in before:  # Hydra's dictConfig removed them (pytest's capture among them)
            if handler not in root.handlers:
                root.addHandler(handler)


def start_cli(command: str, *args: str, env: Optional[dict] = None, warnings: Optional[str] = None,
              cwd: Optional[Path] = None) -> subprocess.Popen:
    """`python -m MODULE ARGS...` of the command, started in a subprocess with stdout and stderr piped: for a test
    that signals, kills or waits on it, or runs several at once (`finish` collects one). `env` is its whole
    environment (default: this process's), with this checkout first on PYTHONPATH."""
    return subprocess.Popen([sys.executable, "-m", MODULES[command], *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=process_env(env, warnings), cwd=cwd)


def process_env(env: Optional[dict], warnings: Optional[str]) -> dict:
    """A subprocess's whole environment: `env` (default: this process's) with this checkout first on PYTHONPATH and
    the warnings filter `warnings` (PYTHONWARNINGS) where given."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if warnings is not None:
        env["PYTHONWARNINGS"] = warnings
    return env


# run_cli_in_one_process's subprocess: each call as run_cli runs it in this process, os.environ put back after each
# (sinklab-train exports plugins= to SINKLAB_PLUGINS), the results written as JSON to the file argv[1] names
ONE_PROCESS = """
import json, os, sys
from tests.helpers.cli import _run_here
out, command, calls, warnings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] or None
ran = []
for args in calls:
    environ = dict(os.environ)
    ran.append(_run_here(command, args, None, warnings))
    os.environ.clear()
    os.environ.update(environ)
with open(out, "w") as f:
    json.dump(ran, f)
"""


def run_cli_in_one_process(command: str, calls: Sequence[Sequence[str]], env: Optional[dict] = None,
                           warnings: Optional[str] = None, cwd: Optional[Path] = None,
                           timeout: float = 600) -> list[Ran]:
    """`COMMAND ARGS...` for each ARGS of `calls`, one after another in ONE subprocess, each through the console
    script's main as `run_cli` runs it here: for calls that need a process of their own environment (`env`:
    PYTHONPATH, SINKLAB_CONF, ...) but not one each, since a process's start-up and imports are most of a failing
    call's time (~7 s for sinklab-train, which imports Lightning). The environment is put back between calls.
    Returns each call's (exit code, stdout, stderr), in order; a call that raises fails the test, showing it."""
    assert command in MODULES, f"unknown command {command!r}; allowed: {', '.join(MODULES)}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ran.json"
        argv = [str(out), command, json.dumps([list(c) for c in calls]), warnings or ""]
        proc = subprocess.run([sys.executable, "-c", ONE_PROCESS, *argv], capture_output=True, text=True,
                              env=process_env(env, warnings), cwd=cwd, timeout=timeout)
        assert proc.returncode == 0 and out.is_file(), \
            f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return [Ran(*ran) for ran in json.loads(out.read_text())]


def finish(proc: subprocess.Popen, timeout: float = 600) -> Ran:
    """Wait for a started command: (exit code, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return Ran(proc.returncode, out, err)


# sinklab-train's Hydra job logging ("[time][logger][LEVEL] - ...") and progress bars (tqdm: "... [00:01, 12.3 it/s]")
LOG_LINE = re.compile(r"^\[|\[\d+:\d\d")


def error_lines(err: str) -> list[str]:
    """stderr without log lines and progress bars, and without blank lines."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not LOG_LINE.search(line)]


def assert_one_line_error(error, *fragments: str, starts: str = "", logs: bool = False) -> str:
    """`error` is one line, no traceback, starting with `starts` and holding every fragment; returns that line.

    `error`: a raised exception (or pytest's ExceptionInfo of one), whose message has no newline; or a command's
    stderr, the line and its newline and nothing else (with `logs`, sinklab-train's log lines and progress bars are
    left out first: `error_lines`)."""
    if isinstance(error, pytest.ExceptionInfo):
        error = error.value
    if isinstance(error, str):
        lines = error_lines(error) if logs else error.split("\n")
        one = len(lines) == 1 if logs else len(lines) == 2 and lines[1] == ""  # "the line\n"
    else:
        lines = [str(error)]
        one = "\n" not in lines[0]
    assert one and "Traceback" not in str(error), f"not one line:\n{error}"
    line = lines[0]
    assert line.startswith(starts), f"{line!r} does not start with {starts!r}"
    missing = [f for f in fragments if f not in line]
    assert not missing, f"{line!r} does not say {missing}"
    return line
