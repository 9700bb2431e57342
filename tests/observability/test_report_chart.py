"""`ledger report --html`, issue 26: the chart spans the whole rolling window with
round dollar ticks and marks where bookings age out, the page shows no raw float,
and the file is written 0644. Read from the HTML text and its SVG elements: no
browser needed."""

from __future__ import annotations

import os
import pathlib
import re
import stat
from typing import Any

import pytest
from google.protobuf import timestamp_pb2

from ledger_service.cli import observe
from ledger_service.cli.render import time_text
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.observability.test_report import RAW_FLOAT, read_figures

NOW_S = 1_800_000_000
HOUR_S = 3_600
LIMIT_NANOS = 500_000_000
MICROS_PER_SECOND = 1_000_000
PLOT_WIDTH = observe.CHART_WIDTH - observe.MARGIN_LEFT - observe.MARGIN_RIGHT
Y_TICK = re.compile(r'<text class="axis y-tick"[^>]*>([^<]*)</text>')
X_LABEL = re.compile(r'<text class="axis" x="[^"]*" y="[^"]*"[^>]*>([^<]*)</text>')
AGE_OUT = re.compile(r'<line class="age-out-mark" x1="([\d.]+)"[^>]*><title>([^<]*)</title>')
FIRST_SPENT_X = re.compile(r'id="spent-line" class="spent" points="([\d.]+),')


def an_audit(**figures: Any) -> pb.Audit:
    """A lane's audit as of NOW_S, with a 1 h window and a $0.50 limit."""
    audit = pb.Audit(lane="recall", summary="s", **figures)
    audit.balance.limit_nanos = LIMIT_NANOS
    audit.balance.as_of.FromSeconds(NOW_S)
    audit.balance.window.FromSeconds(HOUR_S)
    return audit


def an_event(kind: str, seconds_ago: int, reservation: str, amount: int, spent: int) -> pb.Event:
    event = pb.Event(
        lane="recall",
        kind=kind,
        reservation_id=reservation,
        amount_nanos=amount,
        spent_after_nanos=spent,
        limit_nanos=LIMIT_NANOS,
    )
    event.occurred_at.FromSeconds(NOW_S - seconds_ago)
    event.reserved_at.FromSeconds(NOW_S - seconds_ago)
    return event


def x_of(seconds_ago: int) -> float:
    """Where an instant falls on a chart spanning the hour before NOW_S."""
    return observe.MARGIN_LEFT + (HOUR_S - seconds_ago) / HOUR_S * PLOT_WIDTH


def eleven_seconds() -> list[pb.Event]:
    """The new user's lane: two calls 11 s apart, 20 s ago, in a 1 h window."""
    return [
        an_event("reserved", 31, "r-1", 280_000, 280_000),
        an_event("settled", 30, "r-1", 240_000, 240_000),
        an_event("reserved", 20, "r-2", 280_000, 520_000),
    ]


def at(seconds: int) -> str:
    return time_text(timestamp_pb2.Timestamp(seconds=seconds))


def test_the_chart_spans_the_whole_window_not_just_the_events() -> None:
    page = observe.render_page(an_audit(), eleven_seconds())
    labels = X_LABEL.findall(page)
    assert labels == [at(NOW_S - HOUR_S), f"{at(NOW_S)} (now)"]
    # The first event, 31 s before now, is near the right edge, not at the left.
    found = FIRST_SPENT_X.search(page)
    assert found is not None
    assert float(found.group(1)) == pytest.approx(x_of(31), abs=0.1)


@pytest.mark.parametrize("top", [1, 7, 9_264, 10_000, 10_001, 520_000, LIMIT_NANOS, 10**18 + 3])
def test_the_y_axis_has_four_to_six_round_ticks(top: int) -> None:
    ticks = observe.y_ticks(top)
    assert 4 <= len(ticks) <= 6 or top < 4
    step = ticks[1]
    assert ticks == [step * index for index in range(len(ticks))]
    assert ticks[-1] >= top > ticks[-2]
    assert str(step).rstrip("0") in {"1", "2", "5"}


def test_the_y_ticks_are_labelled_in_dollars() -> None:
    page = observe.render_page(an_audit(), eleven_seconds())
    assert Y_TICK.findall(page) == ["$0.00", "$0.10", "$0.20", "$0.30", "$0.40", "$0.50"]
    small = an_audit()
    small.balance.limit_nanos = 10_000
    labels = Y_TICK.findall(observe.render_page(small, []))
    assert labels == ["$0.00", "$0.000002", "$0.000004", "$0.000006", "$0.000008", "$0.00001"]


def test_bookings_that_age_out_inside_the_chart_are_marked() -> None:
    earlier = [
        # Reserved 90 min ago, settled at $0.0003: ages out 30 min ago.
        an_event("reserved", 90 * 60, "old-1", 280_000, 280_000),
        an_event("settled", 90 * 60 - 1, "old-1", 300_000, 300_000),
        # Refused: counts nothing, frees nothing when it ages out.
        an_event("reserved", 80 * 60, "old-2", 280_000, 580_000),
        an_event("refunded", 80 * 60 - 1, "old-2", 0, 300_000),
    ]
    page = observe.render_page(an_audit(), eleven_seconds(), earlier=earlier)
    assert '<g id="age-out-marks" data-count="1">' in page
    [(x, title)] = AGE_OUT.findall(page)
    assert float(x) == pytest.approx(x_of(30 * 60), abs=0.1)
    assert title == f"1 booking aged out at {at(NOW_S - 30 * 60)}, freeing $0.000300000"
    # The window's own bookings age out after now: not inside the chart.
    assert observe.age_outs(eleven_seconds(), (NOW_S - HOUR_S) * MICROS_PER_SECOND,
                            NOW_S * MICROS_PER_SECOND) == []  # fmt: skip


def test_the_next_release_is_marked_just_after_now() -> None:
    audit = an_audit(next_release_nanos=240_000)
    audit.next_release_at.FromSeconds(NOW_S - 31 + HOUR_S)
    page = observe.render_page(audit, eleven_seconds())
    assert (
        f"<title>next release at {at(NOW_S - 31 + HOUR_S)} (after now), frees $0.000240000" in page
    )
    assert 'id="next-release-marker"' not in observe.render_page(an_audit(), eleven_seconds())


def test_no_raw_float_on_the_page() -> None:
    # The 108.88888888888889: estimates 9_800 against 90 real.
    audit = an_audit(
        estimated_charged_nanos=9_800, real_charged_nanos=90, reserve_count=9, denied_count=2
    )
    audit.estimated_to_real_ratio = 9_800 / 90
    audit.denial_rate = 2 / 9
    page = observe.render_page(audit, eleven_seconds())
    assert "108.88888888888889" not in page and RAW_FLOAT.findall(page) == []
    figures = read_figures(page)
    assert figures.by_id["estimated-to-real-ratio"] == "108.8889"
    assert figures.by_id["denial-rate"] == "0.2222"
    assert "<td>108.9</td>" in page and "<td>22.2%</td>" in page


def test_the_page_is_written_0644_whatever_the_umask(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "report.html"
    path.write_text("old")
    path.chmod(0o600)
    before = os.umask(0o077)
    try:
        observe.write_page(path, "<p>page</p>")
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_text() == "<p>page</p>"
    # Atomic: a temporary file renamed over the page, none left behind.
    assert [entry.name for entry in tmp_path.iterdir()] == ["report.html"]


def test_a_hold_past_its_deadline_is_not_drawn_as_held_before_its_expiry_event() -> None:
    """Open past its deadline is expired from then, swept or not: the held line
    kept an overdue hold until its expired event was written."""
    overdue = an_event("reserved", 600, "r-1", 280_000, 280_000)
    overdue.expires_at.FromSeconds(NOW_S - 480)
    later = an_event("reserved", 300, "r-2", 100_000, 380_000)
    later.expires_at.FromSeconds(NOW_S - 180)
    balance = an_audit().balance
    points, _ = observe.chart_points([overdue, later], balance)
    assert [point.held_nanos for point in points[:2]] == [280_000, 100_000]
