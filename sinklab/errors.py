"""User errors: reported as one line naming the offending key or file and what is allowed, never a traceback."""


class UserError(ValueError):
    """Bad input from the user (config, file, checkpoint)."""


def one_line(err: BaseException) -> str:
    """The error's message on one line (its lines joined), or its type's name when it has none."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def describe(err: BaseException) -> str:
    """'<type>: <message on one line>', as status.json records an error."""
    return f"{type(err).__name__}: {one_line(err)}"
