"""User errors: reported as one line naming the offending key or file and what is allowed, never a traceback."""


class UserError(ValueError):
    """Bad input from the user (config, file, checkpoint)."""
