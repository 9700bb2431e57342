"""The `ledger` command's entry point. Importing the CLI (gRPC, protobuf,
SQLAlchemy) takes about half a second, and a Ctrl-C in it printed a traceback:
it is imported here under the same rule as every interrupted command, one line
and exit 130. This module imports nothing of the ledger's until then."""

from __future__ import annotations

import sys

# cli.exits.EXIT_INTERRUPTED, which cannot be imported before the CLI is.
EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        from ledger_service.cli import main as run_command

        return run_command()
    except KeyboardInterrupt:
        # Commands that run until Ctrl-C (`serve`, `history --follow`) handle
        # their own; this is one that came before any command ran.
        print("ledger: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
