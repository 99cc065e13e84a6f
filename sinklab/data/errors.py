"""Errors of the data package. All are `sinklab.errors.UserError` (a ValueError): the `sinklab` CLI and
the training entry point report them as one line naming the key or file and what to do."""

from sinklab.errors import UserError


class DataFileNotFoundError(UserError, FileNotFoundError):
    """A configured file or directory does not exist."""


class StoreMismatchError(UserError):
    """A token store built from another tokenizer or corpus than the one asked for."""


class StoreDamagedError(UserError):
    """A token store whose shards do not match its manifest, or whose build did not finish."""


class CorpusFetchError(UserError):
    """The default corpus could not be downloaded."""
