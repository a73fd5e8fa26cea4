"""Errors that mean "the spec asks for something that cannot be done here", not a trainer bug.

The entry point prints them as one line naming the field and exits 2; anything else keeps its
traceback.
"""


class ConfigError(ValueError):
    """The spec asks for something this machine, this data or this trainer version cannot do."""
