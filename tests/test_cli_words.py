"""The CLI speaks its own words: a refusal the server words with wire fields
("billed_nanos"), moves ("use Refund") or outcomes ("SUCCEEDED") is printed with
the options and commands a person typed (--billed, `ledger refund`, succeeded).

The server's own messages stay as they are (the clients rely on them); the
translation is the CLI's, in `connection.in_cli_words`. The tests run against a
real server as tests/test_cli.py does (its fixtures, by name).
"""

from __future__ import annotations

import argparse
import itertools
import pathlib

import pytest

from ledger_service import cli
from ledger_service.cli import connection, exits
from tests import test_cli
from tests.test_cli import LedgerProcess, RunLedger, one_line_error, put_recall, reserve

ledger_process = test_cli.ledger_process
target = test_cli.target
ledger = test_cli.ledger

SETTLE = ("settle", "words", "w-1", "--outcome", "succeeded")
# One lane a case, since the server lives for the module: "words" in a command is it.
_LANES = itertools.count()


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (
            SETTLE,
            "bad value for --input-tokens (field input_tokens): a succeeded settle needs "
            "its usage: --input-tokens above 0, or --billed",
        ),
        (
            (*SETTLE, "--input-tokens", "10", "--output-tokens", "500"),
            "bad value for --output-tokens (field output_tokens): 500 is more than the 200 "
            "--max-output-tokens the booking was reserved for",
        ),
        (
            (*SETTLE, "--input-tokens", "10", "--cached-input-tokens", "20"),
            "bad value for --cached-input-tokens (field cached_input_tokens): cached and "
            "cache-write tokens are parts of --input-tokens: together at most --input-tokens",
        ),
        (
            (*SETTLE, "--input-tokens", "10", "--http-status", "404"),
            "bad value for --http-status (field http_status): a 4xx answer is a refused "
            "call: use `ledger refund`, it costs zero",
        ),
        (
            (*SETTLE, "--billed", "$1"),
            "bad value for --billed (field billed_nanos): a charge of $1.000000000 is more "
            "than 100 times the booking's cap of $0.000280000 (the lane's "
            "--max-charge-multiple): no request of its size could cost that; nothing was written",
        ),
        (
            ("refund", "words", "w-1"),
            "bad value for --reason (field reason): is required when --http-status is 0 "
            "(a call that was never sent)",
        ),
        (
            (
                "reserve", "words", "w-2", "--model", "jev", "--request-bytes", "7000",
                "--max-output-tokens", "200", "--ttl", "1h",
            ),
            "bad value for --ttl (field ttl): must not exceed the lane's --hold-ttl of 120 s",
        ),
        (
            (
                "reserve", "words", "w-1", "--model", "jev", "--request-bytes", "7000",
                "--max-output-tokens", "201",
            ),
            "RESERVATION_ID 'w-1' was already used with different arguments "
            "(RESERVATION_ID_REUSED)",
        ),
    ],
)  # fmt: skip
def test_a_refusal_names_the_options_and_commands_typed(
    target: LedgerProcess, ledger: RunLedger, command: tuple[str, ...], said: str
) -> None:
    lane = f"words-{next(_LANES)}"
    put_recall(ledger, lane)
    assert reserve(ledger, lane, "w-1").code == 0
    run = ledger(*(lane if word == "words" else word for word in command))
    assert one_line_error(run) == f"ledger: {said}\n"
    # A value to fix (INVALID_ARGUMENT) exits 2, as the CLI's own refusals; a
    # reused id is a refusal of the ledger's state, exit 1.
    assert run.code == (exits.EXIT_BAD_VALUE if said.startswith("bad value") else exits.EXIT_FAILED)
    # Refused, so nothing changed: the booking still settles as it was reserved.
    assert ledger("settle", lane, "w-1", "--outcome", "unknown").code == 0


def test_a_reused_correction_id_names_the_option(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "words-fix")
    assert reserve(ledger, "words-fix", "f-1").code == 0
    assert ledger("refund", "words-fix", "f-1", "--http-status", "403").code == 0
    fix = ("correct", "words-fix", "f-1", "--reason", "the bill", "--correction-id", "c-1")
    assert ledger(*fix, "--charge", "$0.01").code == 0
    run = ledger(*fix, "--charge", "$0.02")
    assert one_line_error(run) == (
        "ledger: --correction-id 'c-1' was already used with other content (CORRECTION_ID_REUSED)\n"
    )


def test_a_refused_history_filter_names_its_option(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    """`ledger history` takes the reservation id as --reservation-id, not as the
    moves' RESERVATION_ID argument, which its usage does not have."""
    put_recall(ledger, "words-history")
    run = ledger("history", "words-history", "--reservation-id", "r 1")
    assert one_line_error(run) == (
        "ledger: bad value for --reservation-id (field reservation_id): "
        "must be printable ASCII without spaces\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (("reserve", "other", "p-1", "--model", "jev", "--request-bytes", "1",
          "--max-output-tokens", "1"),
         "`ledger reserve` on lane 'other' needs the charge scope there"),
        (("settle", "other", "p-1", "--outcome", "unknown"),
         "`ledger settle` on lane 'other' needs the charge scope there"),
        (("refund", "other", "p-1", "--reason", "never sent"),
         "`ledger refund` on lane 'other' needs the charge scope there"),
        (("correct", "other", "p-1", "--charge", "1n", "--reason", "the bill"),
         "`ledger correct` on lane 'other' needs the admin scope on every lane"),
        (("lane", "put", "other", "--limit", "$1", "--price", test_cli.JEV_PRICE),
         "`ledger lane put` on lane 'other' needs the admin scope on every lane"),
        (("lane", "show", "other"),
         "`ledger lane show` on lane 'other' needs the admin scope on every lane"),
        (("lane", "list"), "`ledger lane list` needs the admin scope on every lane"),
        (("balance", "other"),
         "`ledger balance` on lane 'other' needs the charge or read scope there"),
        (("history", "other"), "`ledger history` on lane 'other' needs the read scope there"),
        # --follow reads the history first: a refusal comes from that.
        (("history", "other", "--follow"),
         "`ledger history` on lane 'other' needs the read scope there"),
        (("audit", "other"), "`ledger audit` on lane 'other' needs the read scope there"),
        (("reconcile", "FILE", "--lane", "other"),
         "`ledger reconcile` needs the admin scope on every lane"),
    ],
)  # fmt: skip
def test_a_grant_refusal_names_the_command_not_the_method(
    target: LedgerProcess,
    ledger: RunLedger,
    tmp_path: pathlib.Path,
    command: tuple[str, ...],
    said: str,
) -> None:
    issued = ledger(
        "grant", "issue", "--lane", "mine", "--scope", "read", "--data-dir", str(target.data_dir)
    )  # fmt: skip
    assert issued.code == 0, issued
    export = tmp_path / "usage.csv"
    export.write_text("reservation_id,billed_nanos\np-1,5\n")
    typed = (str(export) if word == "FILE" else word for word in command)
    run = ledger(*typed, "--grant", issued.out.strip())
    assert one_line_error(run) == (
        f"ledger: {said}; this grant has read on mine (PERMISSION_DENIED)\n"
    )


def test_an_id_that_looks_like_a_wire_word_is_shown_as_given(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    put_recall(ledger, "words-id")
    assert reserve(ledger, "words-id", "billed_nanos").code == 0
    run = reserve(ledger, "words-id", "billed_nanos", "--estimate", "1n")
    assert one_line_error(run) == (
        "ledger: RESERVATION_ID 'billed_nanos' was already used with different arguments "
        "(RESERVATION_ID_REUSED)\n"
    )


def test_a_reconcile_row_keeps_the_export_columns_and_the_domain_words(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    """A row's fields are the columns of the user's own file, and its sentence
    speaks of the bill's calls, not of the CLI's commands: it stays as written."""
    ledger("lane", "put", "words-tiny", "--limit", "1n", "--price", test_cli.JEV_PRICE)
    assert reserve(ledger, "words-tiny", "d-1").code == exits.EXIT_DENIED
    export = tmp_path / "usage.csv"
    export.write_text("reservation_id,billed_nanos\nd-1,5\n")
    denied = ledger("reconcile", str(export), "--lane", "words-tiny", "--dry-run")
    assert denied.out.splitlines()[1].endswith("the Reserve was denied: no call was booked"), denied
    export.write_text("reservation_id,input_tokens,cached_input_tokens\nd-2,1,5\n")
    bad = ledger("reconcile", str(export), "--lane", "words-tiny", "--dry-run")
    assert bad.out.splitlines()[1].endswith(
        "cached_input_tokens: cached and cache-write tokens are parts of input_tokens"
    ), bad
    export.write_text("billed_nanos\n5\n")
    header = ledger("reconcile", str(export), "--lane", "words-tiny")
    assert one_line_error(header) == (
        "ledger: bad value for FILE (field content): the CSV header must name a "
        "reservation_id column\n"
    )


def test_every_option_the_translation_names_is_one_the_cli_has() -> None:
    """A renamed option must not leave the table naming one that is gone."""
    options: set[str] = set()
    pending = [cli.parser()]
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    named = {*connection.OPTION_OF_FIELD.values(), *connection.CLI_WORD_OF_WIRE_WORD.values()}
    flags = {name for name in named if name.startswith("--")}
    assert flags <= options, flags - options


def _options() -> list[tuple[str, argparse.Action]]:
    """Every option of every command, with the command's name."""
    found: list[tuple[str, argparse.Action]] = []
    pending = [("ledger", cli.parser())]
    while pending:
        name, parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend((f"{name} {word}", sub) for word, sub in action.choices.items())
            elif action.option_strings:
                found.append((name, action))
    return found


def test_every_option_says_what_its_value_is_in_the_cli_words() -> None:
    """`--help` describes each option's value, never by a wire field or RPC name
    (`--max-output-tokens N` with no text, `Reserve/Settle/Refund`)."""
    wrong = [
        f"{name} {action.option_strings[0]}: {action.help}"
        for name, action in _options()
        if not action.help or connection.in_cli_words(action.help) != action.help
    ]
    assert wrong == []


def test_every_option_value_is_named_for_what_it_is() -> None:
    """`--sweep-interval SECONDS`, not argparse's default from the setting's name
    (`SWEEP_INTERVAL_SECONDS`, `AT_US`, `DATABASE_URL`)."""
    wrong = [
        f"{name} {action.option_strings[0]} {action.dest.upper()}"
        for name, action in _options()
        if action.nargs != 0 and action.choices is None and action.metavar is None
        and "_" in action.dest
    ]  # fmt: skip
    assert wrong == []
