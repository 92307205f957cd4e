"""The exception types the CLI turns into a one-line message and a non-zero exit (here, not
beside what raises them, so that the CLI catches them without importing pandas and pyarrow)."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or an impossible request, explained in one line.

    ``exit_code`` lets a command choose its status (``check`` uses 2 for bad input).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class TraceError(Exception):
    """A trace file cannot be used; the message is one line meant for the user."""
