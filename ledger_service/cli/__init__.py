"""`ledger`: the command line for people. Each command group lives in its own module."""

from __future__ import annotations

import os

# gRPC's C core prints its own handshake lines to stderr unless told not to;
# this must happen before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

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
from ledger_service.cli.exits import EXIT_BAD_VALUE, EXIT_FAILED
from ledger_service.cli.values import NEGATIVE_AMOUNT

# The distribution `ledger --version` reports (pyproject.toml's [project] name).
DISTRIBUTION = "ledger-service"


def version_text() -> str:
    """'ledger 0.1.0': the installed distribution's version."""
    try:
        return f"ledger {importlib.metadata.version(DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return f"ledger (unknown version: {DISTRIBUTION} is not installed)"


class LedgerArgumentParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line, and that '-$1' or '-1n'
    after an option is that option's value.

    argparse takes any word starting with '-' that is not a plain negative number
    for an option, so `--limit -$1` failed as 'expected one argument' while
    `--limit=-$1` reached the value check: the same mistake must get the same
    refusal (values.parse_amount_nanos). Subcommands' parsers are of this class too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read by argparse to tell a negative number from an option (no option
        # of ours starts with a digit, '$' or '.').
        self._negative_number_matcher = NEGATIVE_AMOUNT

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """A word no option takes is refused by the (sub)command that met it,
        so the line points at that command's --help, where its options are."""
        self._words = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        """One line naming what is wrong, exit 2 (EXIT_BAD_VALUE), as every other
        refused value: argparse's usage block first made it ten lines or more."""
        unknown = self._unknown_options()
        if unknown and "arguments are required" in message:
            # argparse checks required options before it reports unknown words:
            # `--limt $1` said only that --limit is required.
            message = f"unrecognized arguments: {' '.join(unknown)}; {message}"
        self.exit(EXIT_BAD_VALUE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def _unknown_options(self) -> list[str]:
        """The words of this parser's command line that look like an option of it
        and are none (nor a prefix of one, which argparse takes)."""
        unknown = []
        for word in getattr(self, "_words", []):
            if word == "--":
                break
            name = word.split("=", 1)[0]
            if name.startswith("--") and not any(
                option.startswith(name) for option in self._option_string_actions
            ):
                unknown.append(name)
        return unknown


def parser() -> argparse.ArgumentParser:
    root = LedgerArgumentParser(
        prog="ledger",
        description="The lane ledger: budgets for paid model calls, booked before they are made.",
    )
    root.add_argument("--version", action="version", version=version_text())
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    operate.register(commands)
    common = connection.common_options()
    lanes.register(commands, common)
    moves.register(commands, common)
    reading.register(commands, common)
    reconcile.register(commands)
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
    # SQLAlchemy names a pool's logger after its class: ours (PostgreSQL's) too.
    logging.getLogger("ledger_service.storage.watchdog.DeadlinePool").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command. A reader that leaves early (`ledger history | head -1`) ends it
    quietly with status 1, as the Python docs' note on SIGPIPE recommends."""
    configure_logging()
    stdout = sys.stdout
    if stdout is not None:  # None: the shell closed it (`>&-`); print() then writes nothing
        sys.stdout = _TaggedStdout(stdout)
    try:
        try:
            arguments = parser().parse_args(argv)
            code: int = arguments.run(arguments)
        finally:
            # Flush now, so a closed pipe is a BrokenPipeError here and not at exit.
            if sys.stdout is not None:
                sys.stdout.flush()
    except _ReaderLeft:
        _discard_stdout()
        return EXIT_FAILED
    except BrokenPipeError as error:
        # Another pipe (a helper process's): it used to pass for a reader
        # that left, and the command ended with status 1 and no word.
        print(f"ledger: failed: a pipe to another process broke ({error})", file=sys.stderr)
        return EXIT_FAILED
    except _StdoutUnwritable as error:
        print(f"ledger: cannot write to stdout: {error.reason}", file=sys.stderr)
        _discard_stdout()
        return EXIT_FAILED
    finally:
        sys.stdout = stdout
    return code


class _StdoutUnwritable(Exception):
    """stdout refused a write for a reason other than a reader that left (a full disk)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.reason = error.strerror or str(error)


class _ReaderLeft(BrokenPipeError):
    """stdout's reader left (`| head -1`): a BrokenPipeError of stdout, not of another pipe."""


class _TaggedStdout:
    """stdout, whose write errors are told apart from those of any other file."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError as error:
            raise _ReaderLeft(*error.args) from error
        except OSError as error:
            raise _StdoutUnwritable(error) from error

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError as error:
            raise _ReaderLeft(*error.args) from error
        except OSError as error:
            raise _StdoutUnwritable(error) from error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Points stdout at devnull, so the interpreter's own flush at exit fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
