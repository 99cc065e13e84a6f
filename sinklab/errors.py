"""User errors: reported as one line naming the offending key or file and what is allowed, never a traceback."""
import importlib
from types import ModuleType
from typing import Any


class UserError(ValueError):
    """Bad input from the user (config, file, checkpoint)."""


def one_line(err: BaseException) -> str:
    """The error's message on one line (its lines joined), or its type's name when it has none."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def describe(err: BaseException) -> str:
    """'<type>: <message on one line>', as status.json records an error."""
    return f"{type(err).__name__}: {one_line(err)}"


def word(value: Any) -> str:
    """A config value as the user writes it in an override: null, true, 3, abc."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def import_optional(module: str, needed_by: str, instead: str = "") -> ModuleType:
    """`module`, imported where it is used rather than at sinklab's import: training from a prepared directory with the
    CSV logger and `sinklab measure` run without the packages only some options need (a stock GPU image has no
    `datasets` or `wandb`). Not importable: a one-line UserError naming the option (`needed_by`, e.g. "logger=wandb")
    and the `pip install` line (the module's name is its distribution's here), then what works without it
    (`instead`)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        detail = "" if err.name == module else one_line(err)  # installed, but a package it imports is not
        raise UserError(missing_package(needed_by, module, instead, detail)) from None


def missing_package(needed_by: str, package: str, instead: str = "", detail: str = "") -> str:
    """The one line of an option whose package is not installed (import_optional)."""
    why = f"cannot be imported ({detail})" if detail else "is not installed"
    return f"{needed_by} needs {package}, which {why}: pip install {package}" + (f"; {instead}" if instead else "")
