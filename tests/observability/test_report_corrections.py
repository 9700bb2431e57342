"""`ledger audit` and `ledger report --html` on a lane whose charges were corrected:
the audit counts corrected bookings among the real charges, and the page marks
each `corrected` event on its chart and lists it in a table of its own."""

from __future__ import annotations

import html
import pathlib
import re
from typing import Any

import pytest

from ledger_service.cli import observe, render
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from tests.observability.jam import HOLD_NANOS, make_jam
from tests.observability.test_report import assert_matches_audit, read_figures, run_cli

# u0 timed out and was charged its hold (486 nanos); the provider's support says 30.
CORRECTED_NANOS = 30
REASON = "support ticket 4711: the timed-out call cost $0.00000003"
ROW = re.compile(r'<tr class="correction">(.*?)</tr>')
CELL = re.compile(r"<td>(.*?)</td>")


def corrected_jam(capsys: pytest.CaptureFixture[str], server: LedgerServer, ledger: Any) -> str:
    """The jam, with u0's estimate corrected through the CLI; returns what `correct` printed."""
    make_jam(ledger)
    return run_cli(
        capsys, server, "correct", "recall", "u0", "--charge", f"{CORRECTED_NANOS}n",
        "--reason", REASON,
    )  # fmt: skip


def correction_rows(page: str) -> list[list[str]]:
    return [[html.unescape(cell) for cell in CELL.findall(row)] for row in ROW.findall(page)]


def test_the_audit_counts_a_corrected_charge_as_real(
    traced_server: LedgerServer, ledger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    printed = corrected_jam(capsys, traced_server, ledger)
    assert printed.startswith("corrected u0: charge $0.000000486 -> $0.000000030\n")
    audit = ledger.audit(biggest=5)
    assert (audit.corrected_count, audit.corrected_charged_nanos) == (1, CORRECTED_NANOS)
    text = run_cli(capsys, traced_server, "audit", "recall")
    assert (
        "  real charges    $0.000000060: 3 succeeded $0.000000030, 0 reconciled $0.000000000, "
        "1 corrected $0.000000030"
    ) in text.splitlines()
    assert "  estimates       $0.000008262: 9 UNKNOWN $0.000004374, 8 expired" in text


def test_the_report_marks_and_lists_the_correction(
    traced_server: LedgerServer,
    ledger: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    corrected_jam(capsys, traced_server, ledger)
    audit = ledger.audit(biggest=5)
    path = tmp_path / "recall.html"
    run_cli(capsys, traced_server, "report", "recall", "--html", str(path))
    page = path.read_text()
    figures = read_figures(page)
    assert_matches_audit(figures, audit)
    assert figures.by_id["corrected-count"] == "1"
    assert figures.by_id["corrected-charged-nanos"] == str(CORRECTED_NANOS)
    assert '<g id="correction-markers" data-count="1">' in page
    assert page.count('class="correction-marker"') == 1
    assert "<title>corrected u0 at " in page
    assert "$0.000000486 -&gt; $0.000000030 (support ticket 4711" in page
    assert "&#9679; correction (1)" in page
    [event] = ledger.events(kinds=["corrected"])
    assert correction_rows(page) == [
        [
            str(event.seq),
            "u0",
            render.time_text(event.occurred_at),
            "$0.000000486",
            "$0.000000030",
            REASON,
            event.correction_id,
        ]
    ]
    for outside in ("<script", "src=", "href=", "http:", "https:", "@import", "url("):
        assert outside not in page


def test_a_report_without_corrections_says_none(
    traced_server: LedgerServer,
    ledger: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    make_jam(ledger)
    path = tmp_path / "recall.html"
    run_cli(capsys, traced_server, "report", "recall", "--html", str(path))
    page = path.read_text()
    assert '<table id="corrections" data-count="0">' in page
    assert "none in this window" in page
    assert '<g id="correction-markers" data-count="0"></g>' in page


def corrected_event(seq: int) -> pb.Event:
    event = pb.Event(
        seq=seq,
        lane="recall",
        kind="corrected",
        reservation_id=f"r-{seq}",
        previous_amount_nanos=HOLD_NANOS,
        amount_nanos=seq,
        spent_after_nanos=seq,
        limit_nanos=10_000,
        reason="a\nlong   reason " + "y" * 300,
        correction_id=f"c-{seq}",
    )
    event.occurred_at.FromSeconds(1_800_000_000 + seq)
    return event


def test_the_corrections_table_lists_the_newest_first_and_bounded() -> None:
    events = [corrected_event(seq) for seq in range(1, observe.MAX_CORRECTIONS_LISTED + 2)]
    audit = pb.Audit(lane="recall")
    audit.balance.limit_nanos = 10_000
    audit.balance.as_of.FromSeconds(1_800_001_000)
    page = observe.render_page(audit, events)
    rows = correction_rows(page)
    assert len(rows) == observe.MAX_CORRECTIONS_LISTED
    assert rows[0][0] == str(len(events)) and rows[-1][0] == "2"
    # The reason on one line, cut short.
    assert rows[0][5].startswith("a long reason yyy") and rows[0][5].endswith("...")
    assert len(rows[0][5]) == observe.CORRECTION_REASON_SHOWN_CHARACTERS
    assert f"The newest {observe.MAX_CORRECTIONS_LISTED} of {len(events)} are listed." in page
    assert f'<g id="correction-markers" data-count="{len(events)}">' in page
