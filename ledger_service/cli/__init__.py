"""`ledger`: the command line for people. Each command group lives in its own module."""

from __future__ import annotations

import os

# gRPC's C core prints its own handshake lines to stderr unless told not to;
# this must happen before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import logging
import sys
from collections.abc import Sequence

from ledger_service.cli import (
    connection,
    grants,
    lanes,
    moves,
    observe,
    operate,
    reading,
    reconcile,
    recovery,
)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="ledger",
        description="The lane ledger: budgets for paid model calls, booked before they are made.",
    )
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    operate.register(commands)
    common = connection.common_options()
    lanes.register(commands, common)
    moves.register(commands, common)
    reading.register(commands, common)
    reconcile.register(commands, common)
    grants.register(commands)
    recovery.register(commands)
    observe.register(commands)
    return root


def configure_logging() -> None:
    """The server's and the CLI's log lines, on stderr; SQLAlchemy's and Alembic's quieter."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    arguments = parser().parse_args(argv)
    code: int = arguments.run(arguments)
    return code


if __name__ == "__main__":
    sys.exit(main())
