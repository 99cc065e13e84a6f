"""User errors: reported as one line naming the offending key or file and what is allowed, never a traceback."""
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
