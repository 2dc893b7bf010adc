"""The one user-facing error type: the CLI prints its message on one line and exits with its code."""

from __future__ import annotations


class HarnessError(Exception):
    """An error the user can act on. The message says what is wrong and, where possible, what to do."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotMoEError(HarnessError):
    """The model has no routed experts, so there is nothing to cache."""


class BuildMissingError(HarnessError):
    """A build that the command needs is not there."""
