"""Reconcile rows' numbers: plain ASCII decimals only, so that a typo is a bad
row naming its field, never a different amount and never an INTERNAL error."""

from __future__ import annotations

import pytest

from ledger_service.domain import reconcile
from ledger_service.domain.errors import InvalidArgument


def _parsed(column: str, value: str) -> reconcile.Parsed:
    content = f"reservation_id,{column}\nr1,{value}\n".encode()
    return reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("billed_usd", "1_000"),
        ("billed_usd", "\u0663"),
        ("billed_nanos", "\u00b2"),
        ("billed_nanos", "\u0663"),
        ("billed_nanos", "1_000"),
        ("input_tokens", "\u00b2"),
    ],
)
def test_a_number_that_is_not_plain_ascii_is_a_bad_row(column: str, value: str) -> None:
    parsed = _parsed(column, value)
    assert not parsed.rows
    [bad] = parsed.bad
    assert bad.status is reconcile.RowStatus.BAD and bad.field == column


def test_plain_numbers_still_read() -> None:
    assert _parsed("billed_usd", "0.00019").rows[0].billed_nanos == 190_000
    assert _parsed("billed_nanos", "7").rows[0].billed_nanos == 7


def test_a_second_row_for_one_booking_is_a_bad_row() -> None:
    """Otherwise the file's answer would hang on its order, and with the bill
    winning every re-run would replace one row's charge with the other's."""
    content = b"lane,reservation_id,billed_nanos\nrecall,r1,11\nother,r1,5\nrecall,r1,12\n"
    parsed = reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert [(row.lane, row.line) for row in parsed.rows] == [("recall", 2), ("other", 3)]
    [bad] = parsed.bad
    assert (bad.line, bad.field, bad.status) == (4, "reservation_id", reconcile.RowStatus.BAD)
    assert "line 2" in bad.message


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-inf", "sNaN"])
def test_a_dollar_amount_that_is_no_number_says_so(value: str) -> None:
    [bad] = _parsed("billed_usd", value).bad
    assert (bad.field, bad.message) == (
        "billed_usd",
        "billed_usd: must be a decimal number of dollars",
    )


@pytest.mark.parametrize(
    ("column", "value", "said"),
    [
        ("billed_nanos", "9" * 5_000, "must be between 0 and"),
        ("input_tokens", "1" * 5_000, "must be between 0 and"),
        ("billed_usd", "1e999999", "must be between 0 and"),
        # A billion digits: int() of it held a server's GIL for minutes.
        ("billed_usd", "1e999999999", "must be between 0 and"),
        ("billed_usd", "-1e999999999", "must be between 0 and"),
        ("billed_usd", "1e-999999999", "must be exact to the nano-dollar"),
        ("billed_usd", "1.0000000000000000000000000001", "must be exact to the nano-dollar"),
    ],
)
def test_a_number_too_long_or_too_fine_is_a_bad_row_not_a_rounded_one(
    column: str, value: str, said: str
) -> None:
    parsed = _parsed(column, value)
    assert not parsed.rows
    [bad] = parsed.bad
    assert bad.field == column and said in bad.message, bad.message


@pytest.mark.parametrize("value", ["-1", "-0.000000001", "4611686018.427387905", "1e10"])
def test_a_dollar_amount_out_of_range_says_its_bounds_in_dollars(value: str) -> None:
    """The column is in dollars: its bounds were said in nanos (4611686018427387904)."""
    [bad] = _parsed("billed_usd", value).bad
    assert bad.message == "billed_usd: must be between 0 and 4611686018.427387904 dollars"
    assert _parsed("billed_usd", "4611686018.427387904").rows[0].billed_nanos == 2**62


def test_leading_zeros_still_read() -> None:
    assert _parsed("billed_nanos", "0" * 5_000 + "7").rows[0].billed_nanos == 7
    assert _parsed("billed_usd", "1." + "0" * 100).rows[0].billed_nanos == 10**9


@pytest.mark.parametrize(
    "content", [b"reservation_id,billed_nanos\nq0,1\rx\n", b"reservation_id\n" + b"a" * 200_000]
)
def test_csv_the_csv_module_cannot_read_refuses_the_content(content: bytes) -> None:
    with pytest.raises(reconcile.InvalidArgument) as caught:
        reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert caught.value.field == "content"
    assert "is not valid CSV" in caught.value.message


@pytest.mark.parametrize(
    "line", [b'{"reservation_id": "\\ud800", "billed_nanos": 1}', b'{"\\ud800": 1}']
)
def test_a_lone_surrogate_in_jsonl_is_a_bad_row_that_can_be_answered(line: bytes) -> None:
    parsed = reconcile.parse(line + b"\n", reconcile.ExportFormat.JSONL, "recall")
    assert not parsed.rows
    [bad] = parsed.bad
    assert bad.field == "content" and "surrogate" in bad.message
    (bad.message + bad.reservation_id + bad.lane).encode("utf-8")


@pytest.mark.parametrize(
    "content", [b"reservation_id,la\rne\nr1,recall\n", b"reservation_id," + b"a" * 200_000 + b"\n"]
)
def test_a_header_the_csv_module_cannot_read_refuses_the_content(content: bytes) -> None:
    with pytest.raises(reconcile.InvalidArgument) as caught:
        reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert caught.value.field == "content"
    assert "line 1 is not valid CSV" in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    "content",
    [
        b"reservation_id,lane\nr-1,recall\nr-3,recall\nx,rec\rall\n",
        b"reservation_id,lane\nr-1,recall\nr-3,recall\nx," + b"a" * 200_000 + b"\nz,z\n",
    ],
)
def test_a_line_the_csv_module_cannot_read_is_named_by_its_number(content: bytes) -> None:
    with pytest.raises(reconcile.InvalidArgument) as caught:
        reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert "line 4 is not valid CSV" in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    "export_format", [reconcile.ExportFormat.CSV, reconcile.ExportFormat.JSONL]
)
def test_a_row_whose_two_bills_disagree_is_a_bad_row(export_format: reconcile.ExportFormat) -> None:
    """billed_nanos and billed_usd both given and different: the row says two
    bills. The billed_nanos was taken and the billed_usd dropped without a word,
    so a file could be applied at a charge the operator never saw."""
    if export_format is reconcile.ExportFormat.CSV:
        content = b"reservation_id,billed_usd,billed_nanos\nr1,0.0001,900000\n"
    else:
        content = b'{"reservation_id": "r1", "billed_usd": "0.0001", "billed_nanos": 900000}\n'
    parsed = reconcile.parse(content, export_format, "recall")
    assert not parsed.rows
    [bad] = parsed.bad
    assert bad.status is reconcile.RowStatus.BAD and bad.field == "billed_usd"
    assert "900000" in bad.message


def test_a_row_whose_two_bills_agree_reads() -> None:
    content = b"reservation_id,billed_usd,billed_nanos\nr1,0.0001,100000\n"
    parsed = reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert not parsed.bad and parsed.rows[0].billed_nanos == 100_000


def test_a_jsonl_null_is_an_absent_value_as_an_empty_csv_cell_is() -> None:
    """`"billed_nanos": null` was a bad row in JSON lines, while the same row
    with an empty cell in CSV read as billed by its tokens."""
    jsonl = reconcile.parse(
        b'{"reservation_id": "r1", "billed_nanos": null, "lane": null, "input_tokens": 7}\n',
        reconcile.ExportFormat.JSONL,
        "recall",
    )
    csv_rows = reconcile.parse(
        b"reservation_id,billed_nanos,lane,input_tokens\nr1,,,7\n",
        reconcile.ExportFormat.CSV,
        "recall",
    )
    assert not jsonl.bad and not csv_rows.bad, (jsonl.bad, csv_rows.bad)
    assert jsonl.rows[0].lane == csv_rows.rows[0].lane == "recall"
    assert jsonl.rows[0].billed_nanos is csv_rows.rows[0].billed_nanos is None
    assert jsonl.rows[0].input_tokens == csv_rows.rows[0].input_tokens == 7


def test_a_csv_header_naming_a_column_twice_refuses_the_content() -> None:
    """csv.DictReader keeps a repeated column's last cell: `a,1,500` under
    `reservation_id,billed_nanos,billed_nanos` was applied at 500 nanos, the
    row's other bill dropped without a word (docs/semantics.md: a row states
    one bill, never read by one of its figures alone)."""
    content = b"reservation_id,billed_nanos,billed_nanos\nr1,1,500\n"
    with pytest.raises(InvalidArgument) as refused:
        reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert refused.value.field == "content"
    assert refused.value.message == ("content: the CSV header names billed_nanos more than once")


def test_a_jsonl_row_naming_a_key_twice_is_a_bad_row() -> None:
    """json.loads keeps a repeated key's last value, as DictReader does a column's."""
    content = (
        b'{"reservation_id": "r1", "billed_nanos": 1, "billed_nanos": 500}\n'
        b'{"reservation_id": "r2", "reservation_id": "r3", "billed_nanos": 1}\n'
        b'{"reservation_id": "r4", "billed_nanos": 1}\n'
    )
    parsed = reconcile.parse(content, reconcile.ExportFormat.JSONL, "recall")
    assert [row.reservation_id for row in parsed.rows] == ["r4"]
    assert [(bad.line, bad.field, bad.message) for bad in parsed.bad] == [
        (1, "content", "names billed_nanos more than once"),
        (2, "content", "names reservation_id more than once"),
    ]


@pytest.mark.parametrize(
    ("header", "column"),
    [("reservation_id,billed_nanos,", 3), ("reservation_id,,billed_nanos,", 2)],
)
def test_a_csv_header_column_with_no_name_is_named_by_its_place(header: str, column: int) -> None:
    """A spreadsheet's trailing comma: the refusal said "unknown CSV columns: "
    and named nothing (two of them: "names  more than once")."""
    content = f"{header}\nr1,1,\n".encode()
    with pytest.raises(InvalidArgument) as refused:
        reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert refused.value.message == f"content: column {column} of the CSV header has no name"


def test_a_jsonl_name_that_is_a_number_is_a_bad_row_naming_its_key() -> None:
    """Numbers are checked as numbers; a name given as a number was read as its
    digits ("lane": 5 as the lane "5")."""
    content = (
        b'{"reservation_id": "r1", "lane": 5, "billed_nanos": 1}\n'
        b'{"reservation_id": 7, "billed_nanos": 1}\n'
        b'{"reservation_id": "r3", "model": true, "billed_nanos": 1}\n'
        b'{"reservation_id": "r4", "lane": "recall", "billed_nanos": 1}\n'
    )
    parsed = reconcile.parse(content, reconcile.ExportFormat.JSONL, "recall")
    assert [row.reservation_id for row in parsed.rows] == ["r4"]
    assert [(bad.line, bad.field) for bad in parsed.bad] == [
        (1, "lane"),
        (2, "reservation_id"),
        (3, "model"),
    ]


def test_an_empty_jsonl_key_is_shown_not_left_blank() -> None:
    content = b'{"reservation_id": "r1", "": 1, "billed_nanos": 1}\n'
    parsed = reconcile.parse(content, reconcile.ExportFormat.JSONL, "recall")
    assert [bad.message for bad in parsed.bad] == ['unknown keys: ""']


@pytest.mark.parametrize(
    ("cached", "written", "field"),
    [(11, 0, "cached_input_tokens"), (0, 11, "cache_write_tokens"), (6, 5, "cache_write_tokens")],
)
def test_cache_parts_past_the_input_name_the_column_that_passes_it(
    cached: int, written: int, field: str
) -> None:
    """As a Settle does: the row's bad field is the part that took the sum past
    input_tokens, not always cached_input_tokens."""
    content = (
        "reservation_id,input_tokens,cached_input_tokens,cache_write_tokens\n"
        f"r1,10,{cached},{written}\n"
    ).encode()
    parsed = reconcile.parse(content, reconcile.ExportFormat.CSV, "recall")
    assert not parsed.rows
    [bad] = parsed.bad
    assert bad.status is reconcile.RowStatus.BAD and bad.field == field
