"""The exit codes of the `ledger` commands that talk to a server, and the one
failure they tell the user about: a line on stderr, never a traceback."""

from __future__ import annotations

EXIT_FAILED = 1  # the server refused or failed the call
# A value on the command line is wrong (as argparse does), whether the CLI or the
# server (INVALID_ARGUMENT) found it; TLS settings included.
EXIT_BAD_VALUE = 2
EXIT_UNREACHABLE = 3  # no answer from the server, or UNAVAILABLE: try again
EXIT_DENIED = 4  # `reserve` was answered with a denial
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM, as a shell reports a process it ended


class CliError(Exception):
    """A failure the user is told about in one line, with an exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
