"""End-to-end tests of the CLI's corrections and the flags that came with them:
`ledger correct`, `ledger reconcile --bill-wins`, `ledger settle --cached-input-tokens
/ --cache-write-tokens`, `ledger lane put --max-charge-multiple` and cache prices,
and how `ledger history` and `ledger audit` show a corrected charge.

They run against the same kind of real server as tests/test_cli.py (a `ledger serve
--test-clock` subprocess, one per module), with the CLI in process; the fixtures
come from there.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from ledger_service.cli import exits, lanes, moves, reading, reconcile, values
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests import test_cli
from tests.test_cli import (
    JEV_PRICE,
    LedgerProcess,
    Run,
    RunLedger,
    one_line_error,
    put_recall,
    reserve,
)

# The fixtures of tests/test_cli.py, by name: a `ledger serve` subprocess for the
# module, the environment pointing at it, and the in-process CLI.
ledger_process = test_cli.ledger_process
target = test_cli.target
ledger = test_cli.ledger

# JEV with the prompt cache's prices: $0.01 per million cached input tokens and
# $0.125 per million written to the cache (10 and 125 nanos a token).
JEV_CACHE_PRICE = "jev=0.10/0.40/0.01/0.125"
# `reserve` books 7000 request bytes (2000 input tokens) and 200 output tokens:
# capped at 280_000 nanos. Settled at 1800 input and 150 output tokens it costs
# 1800 * 100 + 150 * 400 = 240_000 nanos.
CAP_NANOS = 280_000
REAL_NANOS = 240_000
# The jam: a bill of $500 for a call capped at $0.00028, on a $0.50 lane.
JAM_BILL = "$500"
JAM_BILL_NANOS = 500 * 10**9
LIMIT_NANOS = 500_000_000
REASON = "the provider billed $500 for a 2000-token call; its support confirmed $0.00024"
EXPECTED_CORRECTION = (
    "corrected r-1: charge $500.000000000 -> $0.000240000\n"
    "lane {lane}: spent $0.000240000 of $0.500000000 (held $0.000000000, "
    "charged $0.000240000), available $0.499760000\n"
)


def correct(ledger: RunLedger, lane: str, reservation_id: str, *extra: str) -> Run:
    return ledger(
        "correct", lane, reservation_id, "--charge", f"{REAL_NANOS}n", "--reason", REASON, *extra
    )


def settle_real(ledger: RunLedger, lane: str, reservation_id: str, *extra: str) -> Run:
    """Settles SUCCEEDED at 1800 input and 150 output tokens (240_000 nanos unless billed)."""
    run = ledger(
        "settle",
        lane,
        reservation_id,
        "--outcome",
        "succeeded",
        "--input-tokens",
        "1800",
        "--output-tokens",
        "150",
        *extra,
    )
    return run


def balance_json(ledger: RunLedger, lane: str) -> dict[str, object]:
    return ledger("balance", lane, "--json").json()


def kinds(ledger: RunLedger, lane: str) -> list[str]:
    run = ledger("history", lane, "--json")
    return [json.loads(line)["kind"] for line in run.out.splitlines()]


# Values, without a server --------------------------------------------------


def test_prices_may_name_the_cache_prices_too() -> None:
    model, price = values.parse_price("jev=0.10/0.40/0.01")
    assert model == "jev"
    assert price.cached_input_nanos_per_million_tokens == 10_000_000
    assert not price.HasField("cache_write_nanos_per_million_tokens")
    _, price = values.parse_price("big/model=$3/$15/300000000n/$3.75")
    assert price.input_nanos_per_million_tokens == 3_000_000_000
    assert price.output_nanos_per_million_tokens == 15_000_000_000
    assert price.cached_input_nanos_per_million_tokens == 300_000_000
    assert price.cache_write_nanos_per_million_tokens == 3_750_000_000
    _, plain = values.parse_price(JEV_PRICE)
    assert not plain.HasField("cached_input_nanos_per_million_tokens")


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("jev=0.1/0.4/0.01/0.1/0.2", "--price: "),
        ("jev=0.1/0.4/abc", "--price jev cached input: "),
        ("jev=0.1/0.4/0.01/0.0000000001", "--price jev cache write: "),
        ("jev=0.1/0.4/", "--price jev cached input: "),
    ],
)
def test_bad_cache_prices_name_their_part(text: str, start: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_price(text)
    assert refused.value.message.startswith(start), refused.value.message
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


def test_a_derived_correction_id_is_fixed_by_what_the_correction_says() -> None:
    first = moves.correction_id("recall", "r-1", 240_000, "why")
    assert re.fullmatch(r"c-[0-9a-f]{24}", first)
    assert moves.correction_id("recall", "r-1", 240_000, "why") == first
    others = {
        moves.correction_id("recall2", "r-1", 240_000, "why"),
        moves.correction_id("recall", "r-2", 240_000, "why"),
        moves.correction_id("recall", "r-1", 240_001, "why"),
        moves.correction_id("recall", "r-1", 240_000, "why not"),
        # No two fields run into each other.
        moves.correction_id("recall", "r-1", 240_000, "why "),
        moves.correction_id("recal", "lr-1", 240_000, "why"),
    }
    assert first not in others and len(others) == 6


def test_lane_lines_show_the_max_charge_and_the_cache_prices() -> None:
    lane = pb.Lane(lane="x", limit_nanos=1)
    # The server always states it; a lane message without it says whose default applies.
    assert "max charge       the server's default" in lanes.lane_lines(lane)
    lane.max_charge_multiple = 100
    assert "max charge       100x the cap" in lanes.lane_lines(lane)
    lane.max_charge_multiple = 0
    assert "max charge       no bound" in lanes.lane_lines(lane)
    lane.max_charge_multiple = 7
    lane.prices["jev"].CopyFrom(values.parse_price(JEV_CACHE_PRICE)[1])
    lines = lanes.lane_lines(lane)
    assert "max charge       7x the cap" in lines
    assert (
        "price jev        in $0.100000000 / out $0.400000000 / cached in $0.010000000 / "
        "cache write $0.125000000 per million tokens"
    ) in lines


def test_a_corrected_event_shows_the_old_charge_and_the_reason_on_one_line() -> None:
    event = pb.Event(
        seq=9,
        kind="corrected",
        reservation_id="r-1",
        previous_amount_nanos=JAM_BILL_NANOS,
        amount_nanos=REAL_NANOS,
        reason="typo\nin   the bill, " + "x" * 100,
        correction_id="c-1",
    )
    outcome = reading.event_row(event)[7]
    assert outcome.startswith("was $500.000000000: typo in the bill, xxx")
    assert outcome.endswith("...")
    assert len(outcome) == len("was $500.000000000: ") + reading.CORRECTION_REASON_SHOWN_CHARACTERS
    event.reason = ""
    assert reading.event_row(event)[7] == "was $500.000000000: c-1"


def test_replaced_rows_show_their_amounts_and_are_counted() -> None:
    response = pb.ReconcileResponse(
        applied=True,
        replaced_count=1,
        rows=[
            pb.ReconcileRow(
                line=2,
                lane="bill",
                reservation_id="s-1",
                status="replaced",
                before_nanos=1000,
                after_nanos=2000,
            )
        ],
    )
    lines = reconcile.reconcile_lines(response, dry_run=False, bill_wins=True)
    assert lines[1].split() == ["2", "bill", "s-1", "replaced", "$0.000001000", "->",
                                "$0.000002000"]  # fmt: skip
    assert "applied: 0 corrected, 0 matched, 0 unmatched, 0 disagreeing, 1 replaced" in lines
    # Without --bill-wins and nothing replaced, the totals read as they always have.
    response.replaced_count = 0
    quiet = reconcile.reconcile_lines(response, dry_run=False)
    assert "applied: 0 corrected, 0 matched, 0 unmatched, 0 disagreeing" in quiet


def test_rows_the_answer_left_out_are_said_and_counted() -> None:
    """A 10,000-row file came back with 4,000 rows and the CLI printed those
    alone, saying nothing of the rest; a refused file of 1 bad and 2,000 good
    rows said "1000 not checked", the routine rows the answer kept."""
    unmatched = pb.ReconcileResponse(
        unmatched_count=3,
        rows_omitted=2,
        rows=[pb.ReconcileRow(line=2, lane="l", reservation_id="x0", status="unmatched")],
    )
    lines = reconcile.reconcile_lines(unmatched, dry_run=True)
    assert (
        "2 more rows not listed (the ledger lists those that need a look and routine ones "
        "up to 1,000: at most 4,000)"
    ) in lines
    refused = pb.ReconcileResponse(
        bad_count=1,
        rows_omitted=1000,
        rows=[
            pb.ReconcileRow(
                line=2, lane="l", reservation_id="s1", status="bad", field="billed_nanos"
            ),
            *[
                pb.ReconcileRow(line=3 + i, lane="l", reservation_id=f"y{i}", status="not_applied")
                for i in range(1000)
            ],
        ],
    )
    lines = reconcile.reconcile_lines(refused, dry_run=True)
    assert (
        "not applied: the file has bad rows, so nothing changed: 1 bad, 2000 not checked" in lines
    )


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["correct"], "--correction-id"),
        (["reconcile"], "--bill-wins"),
        (["settle"], "--cached-input-tokens"),
        (["settle"], "--cache-write-tokens"),
        (["lane", "put"], "--max-charge-multiple"),
        (["lane", "put"], "CACHED_IN"),
    ],
)
def test_the_new_options_are_in_the_help(
    ledger: RunLedger, command: list[str], option: str
) -> None:
    run = ledger(*command, "--help")
    assert run.code == 0
    assert option in run.out


# Lanes ---------------------------------------------------------------------


def test_lane_put_takes_a_max_charge_multiple_and_cache_prices(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    default = put_recall(ledger, "bounded-default")
    assert "max charge       100x the cap" in default.out.splitlines()
    assert ledger("lane", "show", "bounded-default", "--json").json()["max_charge_multiple"] == 100

    put = ledger(
        "lane", "put", "unbounded", "--limit", "$0.50", "--price", JEV_CACHE_PRICE,
        "--max-charge-multiple", "0",
    )  # fmt: skip
    assert put.code == 0, put
    lines = put.out.splitlines()
    assert "max charge       no bound" in lines
    assert (
        "price jev        in $0.100000000 / out $0.400000000 / cached in $0.010000000 / "
        "cache write $0.125000000 per million tokens"
    ) in lines
    shown = ledger("lane", "show", "unbounded")
    assert shown.out == put.out
    as_json = ledger("lane", "show", "unbounded", "--json").json()
    assert as_json["max_charge_multiple"] == 0
    assert as_json["prices"]["jev"] == {
        "input_nanos_per_million_tokens": 100_000_000,
        "output_nanos_per_million_tokens": 400_000_000,
        "cached_input_nanos_per_million_tokens": 10_000_000,
        "cache_write_nanos_per_million_tokens": 125_000_000,
    }
    seven = put_recall(ledger, "bounded-7", "--max-charge-multiple", "7")
    assert "max charge       7x the cap" in seven.out.splitlines()


@pytest.mark.parametrize(
    ("value", "code", "start"),
    [
        ("ten", exits.EXIT_BAD_VALUE, "ledger: --max-charge-multiple: "),
        # Negative: refused by the CLI itself, as a negative amount is, not by the server.
        ("-1", exits.EXIT_BAD_VALUE, "ledger: --max-charge-multiple: '-1' is negative"),
    ],
)
def test_a_bad_max_charge_multiple_names_the_option(
    target: LedgerProcess, ledger: RunLedger, value: str, code: int, start: str
) -> None:
    run = ledger(
        "lane", "put", "bounded-bad", "--limit", "$1", "--price", JEV_PRICE,
        "--max-charge-multiple", value,
    )  # fmt: skip
    assert one_line_error(run).startswith(start), run
    assert run.code == code


def test_a_charge_above_the_max_charge_multiple_is_refused(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    put_recall(ledger, "bounded-10", "--max-charge-multiple", "10")
    assert reserve(ledger, "bounded-10", "b-1").code == 0
    refused = settle_real(ledger, "bounded-10", "b-1", "--billed", JAM_BILL)
    assert one_line_error(refused).startswith("ledger: bad value for --billed (field "), refused
    assert refused.code == exits.EXIT_BAD_VALUE
    # Ten times the cap is still a charge the lane takes.
    assert settle_real(ledger, "bounded-10", "b-1", "--billed", f"{10 * CAP_NANOS}n").code == 0


# Settle with the prompt cache ------------------------------------------------


def test_settle_prices_cached_and_cache_write_tokens(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    ledger("lane", "put", "cached", "--limit", "$0.50", "--price", JEV_CACHE_PRICE)
    assert reserve(ledger, "cached", "k-1").code == 0
    run = settle_real(
        ledger, "cached", "k-1", "--cached-input-tokens", "1000", "--cache-write-tokens", "400"
    )
    assert run.code == 0, run
    # 400 plain input tokens * 100 + 1000 cached * 10 + 400 written * 125 + 150 output * 400.
    assert run.out.splitlines()[0] == "settled k-1: charged $0.000160000"
    events = [json.loads(line) for line in ledger("history", "cached", "--json").out.splitlines()]
    settled = events[-1]
    assert (settled["cached_input_tokens"], settled["cache_write_tokens"]) == (1000, 400)


@pytest.mark.parametrize(
    ("extra", "start", "code"),
    [
        (
            ["--cached-input-tokens", "1801"],
            "ledger: bad value for --cached-input-tokens (field ",
            exits.EXIT_BAD_VALUE,
        ),
        # Negative: refused by the CLI itself, exit 2, not sent for the server to refuse.
        (
            ["--cache-write-tokens", "-1"],
            "ledger: --cache-write-tokens: '-1' is negative",
            exits.EXIT_BAD_VALUE,
        ),
    ],
)
def test_bad_cache_token_counts_name_their_option(
    target: LedgerProcess, ledger: RunLedger, extra: list[str], start: str, code: int
) -> None:
    ledger("lane", "put", "cached-bad", "--limit", "$0.50", "--price", JEV_CACHE_PRICE)
    reserve(ledger, "cached-bad", "k-1")
    run = settle_real(ledger, "cached-bad", "k-1", *extra)
    assert one_line_error(run).startswith(start), run
    assert run.code == code
    words = settle_real(ledger, "cached-bad", "k-1", "--cache-write-tokens", "many")
    assert one_line_error(words).startswith("ledger: --cache-write-tokens: "), words
    assert words.code == exits.EXIT_BAD_VALUE


# Correct -----------------------------------------------------------------------


def jam(ledger: RunLedger, lane: str) -> None:
    """A lane jammed by one absurd bill: r-1, capped at $0.00028, settled SUCCEEDED at
    $500 on a $0.50 lane whose max_charge_multiple 0 lets any charge through."""
    put_recall(ledger, lane, "--max-charge-multiple", "0")
    assert reserve(ledger, lane, "r-1").code == 0
    settled = settle_real(ledger, lane, "r-1", "--billed", JAM_BILL, "--http-status", "200")
    assert settled.code == 0, settled
    assert settled.out.splitlines()[0] == "settled r-1: charged $500.000000000"


def test_one_correct_unjams_a_lane_and_running_it_again_changes_nothing(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    jam(ledger, "jammed")
    jammed = balance_json(ledger, "jammed")
    assert jammed["available_nanos"] == LIMIT_NANOS - JAM_BILL_NANOS
    assert reserve(ledger, "jammed", "r-2").code == exits.EXIT_DENIED

    fixed = correct(ledger, "jammed", "r-1")
    assert fixed.code == 0, fixed
    assert fixed.err == ""
    assert fixed.out == EXPECTED_CORRECTION.format(lane="jammed")
    after = balance_json(ledger, "jammed")
    assert after["available_nanos"] == LIMIT_NANOS - REAL_NANOS
    assert after["charged_nanos"] == REAL_NANOS
    booking_kinds = kinds(ledger, "jammed")
    assert booking_kinds.count("corrected") == 1

    again = correct(ledger, "jammed", "r-1")
    assert again.code == 0, again
    assert again.out.splitlines()[0] == "corrected r-1: charge $500.000000000 -> $0.000240000"
    assert balance_json(ledger, "jammed") == after
    assert kinds(ledger, "jammed") == booking_kinds

    assert reserve(ledger, "jammed", "r-3").code == 0


def test_correct_json_is_the_raw_response(target: LedgerProcess, ledger: RunLedger) -> None:
    jam(ledger, "jammed-json")
    run = correct(ledger, "jammed-json", "r-1", "--json")
    assert run.code == 0, run
    response = run.json()
    assert response["previous_charge_nanos"] == JAM_BILL_NANOS
    assert response["charged_nanos"] == REAL_NANOS
    assert response["state"] == "CORRECTED"
    assert response["balance"]["available_nanos"] == LIMIT_NANOS - REAL_NANOS
    events = [
        json.loads(line) for line in ledger("history", "jammed-json", "--json").out.splitlines()
    ]
    corrected = events[-1]
    assert corrected["seq"] == response["seq"]
    assert corrected["kind"] == "corrected"
    assert corrected["correction_id"] == moves.correction_id(
        "jammed-json", "r-1", REAL_NANOS, REASON
    )
    assert (corrected["previous_amount_nanos"], corrected["amount_nanos"]) == (
        JAM_BILL_NANOS,
        REAL_NANOS,
    )
    assert corrected["reason"] == REASON
    assert corrected["grant_id"]


def test_a_correction_shows_in_history_and_audit(target: LedgerProcess, ledger: RunLedger) -> None:
    jam(ledger, "jammed-story")
    assert correct(ledger, "jammed-story", "r-1").code == 0
    lines = ledger("history", "jammed-story").out.splitlines()
    row = lines[-1].split()
    assert row[2:6] == ["corrected", "r-1", "$0.000240000", "$0.000240000"]
    assert row[6:9] == ["was", "$500.000000000:", "the"]
    assert "..." in lines[-1]  # the reason, cut short
    # The OUTCOME column still starts where its header does.
    offset = lines[0].index("OUTCOME")
    assert lines[-1][offset : offset + 4] == "was "
    audit = ledger("audit", "jammed-story")
    assert audit.code == 0, audit
    assert (
        "  real charges    $0.000240000: 0 succeeded $0.000000000, 0 reconciled $0.000000000, "
        "1 corrected $0.000240000"
    ) in audit.out.splitlines()
    figures = ledger("audit", "jammed-story", "--json").json()
    assert (figures["corrected_count"], figures["corrected_charged_nanos"]) == (1, REAL_NANOS)
    assert figures["real_charged_nanos"] == REAL_NANOS


def test_correct_refusals_are_one_line(target: LedgerProcess, ledger: RunLedger) -> None:
    jam(ledger, "jammed-refusals")
    assert reserve(ledger, "jammed-refusals", "still-open").code == exits.EXIT_DENIED
    put_recall(ledger, "open-lane")
    assert reserve(ledger, "open-lane", "o-1").code == 0
    still_open = correct(ledger, "open-lane", "o-1")
    assert one_line_error(still_open).endswith("(BOOKING_STILL_OPEN)\n"), still_open
    assert still_open.code == exits.EXIT_FAILED

    assert correct(ledger, "jammed-refusals", "r-1", "--correction-id", "fix-1").code == 0
    other = ledger(
        "correct", "jammed-refusals", "r-1", "--charge", "$0", "--reason", "other",
        "--correction-id", "fix-1",
    )  # fmt: skip
    assert one_line_error(other).endswith("(CORRECTION_ID_REUSED)\n"), other
    assert other.code == exits.EXIT_FAILED
    assert balance_json(ledger, "jammed-refusals")["charged_nanos"] == REAL_NANOS


@pytest.mark.parametrize(
    ("options", "code", "start"),
    [
        (["--charge", "abc", "--reason", "x"], exits.EXIT_BAD_VALUE, "ledger: --charge: "),
        (["--charge=-1n", "--reason", "x"], exits.EXIT_BAD_VALUE,
         "ledger: --charge: '-1n' is negative: an amount is 0 or more"),
        (["--charge", f"{2**62 + 1}n", "--reason", "x"], exits.EXIT_BAD_VALUE,
         f"ledger: --charge: '{2**62 + 1}n' is too large (at most {2**62}n)"),
        (["--charge", "$0", "--reason", " "], exits.EXIT_BAD_VALUE,
         "ledger: bad value for --reason (field reason): "),
        (["--charge", "$0", "--reason", "x", "--correction-id", "has space"], exits.EXIT_BAD_VALUE,
         "ledger: bad value for --correction-id (field correction_id): "),
    ],
)  # fmt: skip
def test_bad_correct_values_name_their_option(
    target: LedgerProcess, ledger: RunLedger, options: list[str], code: int, start: str
) -> None:
    jam(ledger, "jammed-values")
    run = ledger("correct", "jammed-values", "r-1", *options)
    assert one_line_error(run).startswith(start), run
    assert run.code == code


def test_correct_needs_an_admin_grant(target: LedgerProcess, ledger: RunLedger) -> None:
    jam(ledger, "jammed-grant")
    issued = ledger(
        "grant", "issue", "--lane", "jammed-grant", "--scope", "charge", "--scope", "read",
        "--data-dir", str(target.data_dir),
    )  # fmt: skip
    assert issued.code == 0, issued
    run = correct(ledger, "jammed-grant", "r-1", "--grant", issued.out.strip())
    assert one_line_error(run).startswith("ledger: "), run
    assert run.code == exits.EXIT_FAILED
    assert balance_json(ledger, "jammed-grant")["charged_nanos"] == JAM_BILL_NANOS


def test_correct_without_a_server_is_one_line(ledger: RunLedger) -> None:
    run = correct(ledger, "x", "r-1", "--server", "127.0.0.1:9")
    assert "cannot reach the ledger at 127.0.0.1:9" in one_line_error(run)
    assert run.code == exits.EXIT_UNREACHABLE


# Reconcile --bill-wins ---------------------------------------------------------


def test_reconcile_bill_wins_replaces_a_disagreeing_charge_once(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    put_recall(ledger, "bill-wins")
    assert reserve(ledger, "bill-wins", "s-1").code == 0
    assert settle_real(ledger, "bill-wins", "s-1").code == 0
    export = tmp_path / "usage.csv"
    export.write_text("reservation_id,billed_usd\ns-1,0.0003\n")

    flagged = ledger("reconcile", str(export), "--lane", "bill-wins")
    assert flagged.code == 0, flagged
    # Flagged, not overwritten: the ledger's charge before and after is its own.
    assert flagged.out.splitlines()[1].split()[3:7] == [
        "disagrees", "$0.000240000", "->", "$0.000240000"
    ]  # fmt: skip
    assert "applied: 0 corrected, 0 matched, 0 unmatched, 1 disagreeing\n" in flagged.out
    assert balance_json(ledger, "bill-wins")["charged_nanos"] == REAL_NANOS

    dry = ledger("reconcile", str(export), "--lane", "bill-wins", "--bill-wins", "--dry-run")
    assert dry.code == 0, dry
    assert dry.out.splitlines()[1].split()[3] == "replaced"
    assert balance_json(ledger, "bill-wins")["charged_nanos"] == REAL_NANOS

    replaced = ledger("reconcile", str(export), "--lane", "bill-wins", "--bill-wins")
    assert replaced.code == 0, replaced
    assert replaced.out.splitlines()[1].split()[:7] == [
        "2", "bill-wins", "s-1", "replaced", "$0.000240000", "->", "$0.000300000"
    ]  # fmt: skip
    assert "\napplied: 0 corrected, 0 matched, 0 unmatched, 0 disagreeing, 1 replaced\n" in (
        replaced.out
    )
    assert balance_json(ledger, "bill-wins")["charged_nanos"] == 300_000
    assert kinds(ledger, "bill-wins").count("corrected") == 1

    again = ledger("reconcile", str(export), "--lane", "bill-wins", "--bill-wins", "--json")
    assert again.code == 0, again
    response = again.json()
    assert [row["status"] for row in response["rows"]] == ["matched"]
    assert (response["matched_count"], response["replaced_count"]) == (1, 0)
    assert balance_json(ledger, "bill-wins")["charged_nanos"] == 300_000
    assert kinds(ledger, "bill-wins").count("corrected") == 1


def test_a_bad_rows_text_from_the_file_cannot_drive_the_terminal() -> None:
    """A bad row's reservation id and lane are the file's own bytes, echoed by
    the server: an id with a newline (an unclosed CSV quote swallows the rest
    of the file) broke the table in two, and one with ESC sequences recoloured
    or cleared the operator's terminal. They are shown escaped, on one line."""
    refused = pb.ReconcileResponse(
        bad_count=1,
        rows=[
            pb.ReconcileRow(
                line=2,
                lane="rc\x1b[0m",
                reservation_id="u1\x1b[31m\nZ,rc,0.1\r\n",
                status="bad",
                field="reservation_id",
                message="must be printable ASCII without spaces",
            )
        ],
    )
    lines = reconcile.reconcile_lines(refused, dry_run=True)
    assert lines[1].split()[:4] == ["2", r"rc\x1b[0m", r"u1\x1b[31m\nZ,rc,0.1\r\n", "bad"]
    assert not any(ch in line for line in lines for ch in "\x1b\r\n")
