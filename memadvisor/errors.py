"""The one exception type the CLI turns into a one-line message and a non-zero exit."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or an impossible request, explained in one line.

    ``exit_code`` lets a command choose its status (``check`` uses 2 for bad input).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
