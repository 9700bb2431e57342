"""`ledger audit LANE` and `ledger report LANE --html FILE`: what a lane's window
is made of.

`audit` prints the server's audit (GetAudit) as a readable report, or JSON with
`--json`. `report` writes one self-contained HTML page (inline CSS and SVG, no
script, nothing fetched) with a chart of the window, spent, held and limit over
time with a marker at each denial and at each corrected charge, the audit's
figures in a table whose cells have stable ids (`spent-nanos`, `denied-count`,
...) holding raw values, and the window's corrected charges (`corrected`
events: an operator's Correct, or Reconcile --bill-wins) in a table of their own.

The chart spans the whole rolling window (now - window to now) and is drawn from
the lane's events inside it (ListEvents): each event carries the lane's spent and
limit right after it, and what is held is replayed from the events (a reserved
hold stays held until its booking is settled, refunded or expired, or its
deadline passes). Between two
events the lines are flat; the last point is the audit's own balance. Dotted
lines mark where bookings of the window before aged out inside the chart, an
arrow at now the next release; the y axis has 4 to 6 round ticks in dollars.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import html
import math
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from ledger_service.cli.connection import MAX_PAGES, PAGE_SIZE, Session, last_holding
from ledger_service.cli.connection import command as _command
from ledger_service.cli.connection import common_options as _common_options
from ledger_service.cli.exits import EXIT_BAD_VALUE, CliError
from ledger_service.cli.render import duration_text, time_text, usd
from ledger_service.cli.render import emit as _emit
from ledger_service.cli.render import pairs as _pairs
from ledger_service.cli.render import table as _table
from ledger_service.cli.values import parse_count
from ledger_service.domain.counts import counted
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

DEFAULT_BIGGEST = 5
MAX_BIGGEST = 100
BIGGEST_HELP = f"list the N biggest bookings (default {DEFAULT_BIGGEST}, at most {MAX_BIGGEST})"
MAX_CHART_POINTS = 2_000
MAX_DENIAL_MARKERS = 500
MAX_CORRECTION_MARKERS = 500
MAX_AGE_OUT_MARKS = 500
# The y axis has at most this many steps of a round size, so 4 to 6 ticks (y_ticks).
MAX_Y_STEPS = 5
# The booking events after which a booking counts their amount_nanos.
AMOUNT_KINDS = frozenset({"settled", "refunded", "expired", "reconciled", "corrected"})
# The corrections table lists the newest this many; the count covers them all.
MAX_CORRECTIONS_LISTED = 100
CORRECTION_REASON_SHOWN_CHARACTERS = 200
CHART_WIDTH = 960
CHART_HEIGHT = 360
MARGIN_LEFT = 120
MARGIN_RIGHT = 20
MARGIN_TOP = 20
MARGIN_BOTTOM = 48
MICROS_PER_SECOND = 1_000_000
# What each figure of the table is called; the cell ids are the field names.
LABELS = {
    "limit_nanos": "limit",
    "spent_nanos": "spent (held + charged)",
    "held_nanos": "held by open bookings",
    "charged_nanos": "charged",
    "available_nanos": "available",
    "overrun_nanos": "overrun",
    "open_bookings": "open bookings",
    "succeeded_count": "succeeded calls",
    "succeeded_charged_nanos": "charged for succeeded calls (real)",
    "reconciled_count": "reconciled calls",
    "reconciled_charged_nanos": "charged after reconciling (real)",
    "corrected_count": "corrected calls",
    "corrected_charged_nanos": "charged after an operator's correction (real)",
    "unknown_count": "UNKNOWN outcomes",
    "unknown_charged_nanos": "charged for UNKNOWN outcomes (estimate)",
    "expired_count": "expired holds",
    "expired_charged_nanos": "charged for expired holds (estimate)",
    "open_count": "open holds",
    "open_held_nanos": "held by open holds",
    "refunded_count": "refused or never sent (charged zero)",
    "reserve_count": "Reserves answered",
    "denied_count": "Reserves denied (fallbacks)",
    "denial_rate": "denial rate",
    "real_charged_nanos": "real charges",
    "estimated_charged_nanos": "estimated charges",
    "estimated_to_real_ratio": "estimated / real",
    "next_release_at": "next release at",
    "next_release_nanos": "next release frees",
}
BALANCE_FIGURES = (
    "limit_nanos",
    "spent_nanos",
    "held_nanos",
    "charged_nanos",
    "available_nanos",
    "overrun_nanos",
    "open_bookings",
)
AUDIT_FIGURES = tuple(name for name in LABELS if name not in BALANCE_FIGURES)
CORRECTIONS_HEADER = ("seq", "reservation", "at", "charge before", "charge after", "reason",
                      "correction id")  # fmt: skip
# The audit's float fields, and the integers each is the ratio of.
RATIOS = {
    "denial_rate": ("denied_count", "reserve_count"),
    "estimated_to_real_ratio": ("estimated_charged_nanos", "real_charged_nanos"),
}
# Ratios are rounded for the page: in the raw cells and as shown.
RAW_RATIO_PLACES = decimal.Decimal("0.0001")
SHOWN_PLACES = decimal.Decimal("0.1")
# A report is meant to be shared: readable by all, whatever the umask.
PAGE_MODE = 0o644
_Item = TypeVar("_Item")


# Reading ---------------------------------------------------------------------


def fetch_audit(arguments: argparse.Namespace, session: Session) -> pb.Audit:
    biggest = parse_count("--biggest", arguments.biggest)
    if not 1 <= biggest <= MAX_BIGGEST:  # the wire's 0 asks for the default
        raise CliError(f"--biggest: must be between 1 and {MAX_BIGGEST}", EXIT_BAD_VALUE)
    request = pb.GetAuditRequest(lane=arguments.lane, biggest=biggest)
    found: pb.Audit = session.ledger.GetAudit(request, **session.options())
    return found


# A reserved event without a deadline (none it could be read from) stays held.
_NEVER_US = 2**63


def micros(value: timestamp_pb2.Timestamp) -> int:
    return value.seconds * MICROS_PER_SECOND + value.nanos // 1000


def window_span_us(balance: pb.Balance) -> tuple[int, int]:
    """The audit's rolling window, (now - window, now], in microseconds."""
    end_us = micros(balance.as_of)
    return end_us - (
        balance.window.seconds * MICROS_PER_SECOND + balance.window.nanos // 1000
    ), end_us


def window_events(
    lane: str, balance: pb.Balance, session: Session
) -> tuple[list[pb.Event], list[pb.Event], bool]:
    """The lane's events inside the audit's window and those of the window before
    it (whose bookings age out inside this one), oldest first, and whether the
    read stopped at its bound (MAX_PAGES pages) before the end of the log."""
    start_us, end_us = window_span_us(balance)
    earlier_us = start_us - (end_us - start_us)
    after_seq = _seq_before(lane, earlier_us, session)
    kept: list[pb.Event] = []
    earlier: list[pb.Event] = []
    token = ""
    for _ in range(MAX_PAGES):
        request = pb.ListEventsRequest(
            lane=lane, page_size=PAGE_SIZE, page_token=token, after_seq=after_seq
        )
        page = session.ledger.ListEvents(request, **session.options())
        for event in page.events:
            at_us = micros(event.occurred_at)
            if start_us < at_us <= end_us:
                kept.append(event)
            elif earlier_us < at_us <= start_us:
                earlier.append(event)
        token = page.next_page_token
        if not token:
            return kept, earlier, False
    return kept, earlier, True


def _seq_before(lane: str, instant_us: int, session: Session) -> int:
    """The seq of the lane's last event dated at or before `instant_us` (0:
    none): a lane's events are dated in seq order, so a long-lived lane's
    report then reads its windows, not its first pages."""

    def next_is_before(seq: int) -> pb.Event | None:
        request = pb.ListEventsRequest(lane=lane, page_size=1, after_seq=seq)
        page = session.ledger.ListEvents(request, **session.options())
        found = page.events[0] if page.events else None
        return found if found is not None and micros(found.occurred_at) <= instant_us else None

    first = next_is_before(0)
    if first is None:
        return 0
    return last_holding(0, first, next_is_before).seq


# Text ------------------------------------------------------------------------


def _percent(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def audit_lines(audit: pb.Audit) -> list[str]:
    balance = audit.balance
    release = (
        f"{time_text(audit.next_release_at)}, frees {usd(audit.next_release_nanos)}"
        if audit.HasField("next_release_at")
        else "-"
    )
    rows = [
        ("lane", audit.lane),
        ("as of", time_text(balance.as_of)),
        ("window", f"{duration_text(balance.window)} (rolling)"),
        ("limit", usd(balance.limit_nanos)),
        ("spent", f"{usd(balance.spent_nanos)} "
         f"({_percent(balance.spent_nanos, balance.limit_nanos)} of the limit)"),
        ("  real charges", f"{usd(audit.real_charged_nanos)}: "
         f"{audit.succeeded_count} succeeded {usd(audit.succeeded_charged_nanos)}, "
         f"{audit.reconciled_count} reconciled {usd(audit.reconciled_charged_nanos)}"
         f"{_corrected_part(audit)}"),
        ("  estimates", f"{usd(audit.estimated_charged_nanos)}: "
         f"{audit.unknown_count} UNKNOWN {usd(audit.unknown_charged_nanos)}, "
         f"{audit.expired_count} expired {usd(audit.expired_charged_nanos)}"),
        ("  open holds", f"{usd(audit.open_held_nanos)} in {audit.open_count}"),
        ("refused calls", f"{audit.refunded_count}, charged {usd(0)}"),
        ("reserves", f"{audit.reserve_count}, {audit.denied_count} denied "
         f"({_percent(audit.denied_count, audit.reserve_count)})"),
        ("estimated / real", f"{audit.estimated_to_real_ratio:.1f}"
         if audit.real_charged_nanos else "- (no real charge)"),
        ("next release", release),
        ("flags", ", ".join(audit.flags) or "none"),
    ]  # fmt: skip
    lines = _pairs(rows)
    if audit.biggest_bookings:
        header = ("RESERVATION", "STATE", "AMOUNT", "HOLD", "CAP", "RESERVED (UTC)", "AGES OUT")
        lines += ["", "biggest bookings:", *_table(header, _booking_rows(audit))]
    return [*lines, "", audit.summary]


def _corrected_part(audit: pb.Audit) -> str:
    """The corrected bookings among the real charges; left out when there are none, so
    that a lane nobody corrected reads as it always has."""
    if not audit.corrected_count:
        return ""
    return f", {audit.corrected_count} corrected {usd(audit.corrected_charged_nanos)}"


def _booking_rows(audit: pb.Audit) -> list[tuple[str, ...]]:
    return [
        (
            booking.reservation_id,
            pb.BookingState.Name(booking.state).lower(),
            usd(booking.amount_nanos),
            usd(booking.hold_nanos),
            usd(booking.cap_nanos),
            time_text(booking.reserved_at),
            time_text(booking.ages_out_at),
        )
        for booking in audit.biggest_bookings
    ]


# The chart -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChartPoint:
    at_us: int
    spent_nanos: int
    held_nanos: int
    limit_nanos: int


def chart_points(
    events: Iterable[pb.Event], balance: pb.Balance
) -> tuple[list[ChartPoint], list[ChartPoint]]:
    """The lines' points (one per event, then the balance now) and the denials'."""
    # Open holds: (amount, the instant it stops being held: its deadline).
    holds: dict[tuple[str, str], tuple[int, int]] = {}
    held = 0
    points: list[ChartPoint] = []
    denials: list[ChartPoint] = []
    for event in events:
        key = (event.lane, event.reservation_id)
        at_us = micros(event.occurred_at)
        # Open past its deadline is expired from then, whether or not an
        # expired event was written yet (docs/semantics.md, "Expire").
        for overdue in [k for k, (_, until_us) in holds.items() if until_us <= at_us]:
            held -= holds.pop(overdue)[0]
        if event.kind == "reserved":
            deadline_us = micros(event.expires_at) if event.HasField("expires_at") else _NEVER_US
            holds[key] = (event.amount_nanos, deadline_us)
            held += event.amount_nanos
        elif event.kind in {"settled", "refunded", "expired"} and key in holds:
            held -= holds.pop(key)[0]
        point = ChartPoint(at_us, event.spent_after_nanos, held, event.limit_nanos)
        points.append(point)
        if event.kind == "denied":
            denials.append(point)
    now = ChartPoint(
        micros(balance.as_of), balance.spent_nanos, balance.held_nanos, balance.limit_nanos
    )
    return [*points, now], denials


def _thinned(points: Sequence[_Item], most: int) -> list[_Item]:
    """At most `most` points, evenly spread, keeping the last (the balance now)."""
    if len(points) <= most:
        return list(points)
    step = math.ceil(len(points) / (most - 1))
    return [*points[:-1:step], points[-1]]


@dataclasses.dataclass(frozen=True)
class _Scale:
    start_us: int
    end_us: int
    top_nanos: int

    def x(self, at_us: int) -> float:
        width = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
        return MARGIN_LEFT + (at_us - self.start_us) / (self.end_us - self.start_us) * width

    def y(self, nanos: int) -> float:
        height = CHART_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
        return MARGIN_TOP + height - max(0, nanos) / self.top_nanos * height


def _steps(points: Sequence[ChartPoint], scale: _Scale, field: str) -> str:
    """A step line: each value holds until the next point."""
    coordinates: list[str] = []
    previous_y: float | None = None
    for point in points:
        x, y = scale.x(point.at_us), scale.y(getattr(point, field))
        if previous_y is not None:
            coordinates.append(f"{x:.1f},{previous_y:.1f}")
        coordinates.append(f"{x:.1f},{y:.1f}")
        previous_y = y
    return " ".join(coordinates)


def _timestamp(at_us: int) -> timestamp_pb2.Timestamp:
    seconds, rest_us = divmod(at_us, MICROS_PER_SECOND)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=rest_us * 1000)


def corrected_events(events: Iterable[pb.Event]) -> list[pb.Event]:
    """The events that replaced an ended booking's charge (Correct, or Reconcile --bill-wins)."""
    return [event for event in events if event.kind == "corrected"]


def correction_title(event: pb.Event) -> str:
    """'corrected r-1 at T: $X -> $Y (why)', for a marker's tooltip."""
    return (
        f"corrected {event.reservation_id} at {time_text(event.occurred_at)}: "
        f"{usd(event.previous_amount_nanos)} -> {usd(event.amount_nanos)} ({_reason(event)})"
    )


def _reason(event: pb.Event) -> str:
    reason = " ".join(event.reason.split())
    if len(reason) > CORRECTION_REASON_SHOWN_CHARACTERS:
        return reason[: CORRECTION_REASON_SHOWN_CHARACTERS - 3] + "..."
    return reason


def _correction_markers(corrections: Sequence[pb.Event], scale: _Scale) -> str:
    """A circle on the spent line at each correction, its tooltip saying what changed."""
    shown = _thinned(corrections, MAX_CORRECTION_MARKERS) if corrections else []
    circles = "".join(
        f'<circle class="correction-marker" cx="{scale.x(micros(event.occurred_at)):.1f}" '
        f'cy="{scale.y(event.spent_after_nanos):.1f}" r="5">'
        f"<title>{html.escape(correction_title(event))}</title></circle>"
        for event in shown
    )
    return f'<g id="correction-markers" data-count="{len(corrections)}">{circles}</g>'


@dataclasses.dataclass(frozen=True)
class AgeOut:
    """Bookings reserved at one instant that age out of the window together."""

    at_us: int
    count: int
    nanos: int


def age_outs(events: Iterable[pb.Event], start_us: int, end_us: int) -> list[AgeOut]:
    """The instants inside the chart, (start, end], at which bookings age out of the
    rolling window (reserved_at + window), with what each frees: the bookings
    reserved in the window before, at what their latest event says they count.
    Bookings that count nothing by then (refunded) free nothing and are left out."""
    window_us = end_us - start_us
    counted: dict[tuple[str, str], tuple[int, int]] = {}
    for event in events:
        key = (event.lane, event.reservation_id)
        if event.kind == "reserved":
            counted[key] = (_reserved_us(event) + window_us, event.amount_nanos)
        elif event.kind in AMOUNT_KINDS and key in counted:
            counted[key] = (counted[key][0], event.amount_nanos)
    grouped: dict[int, AgeOut] = {}
    for at_us, nanos in counted.values():
        if start_us < at_us <= end_us and nanos > 0:
            before = grouped.get(at_us, AgeOut(at_us, 0, 0))
            grouped[at_us] = AgeOut(at_us, before.count + 1, before.nanos + nanos)
    return [grouped[at_us] for at_us in sorted(grouped)]


def _reserved_us(event: pb.Event) -> int:
    return micros(event.reserved_at if event.HasField("reserved_at") else event.occurred_at)


def y_ticks(top_nanos: int) -> list[int]:
    """Round dollar values from 0 up to at least `top_nanos`: the smallest step of
    1, 2 or 5 times a power of ten nanos that needs at most MAX_Y_STEPS steps, so
    4 to 6 ticks. Integer arithmetic only."""
    top = max(1, top_nanos)
    power = 1
    while True:
        for factor in (1, 2, 5):
            step = factor * power
            steps = -(-top // step)
            if steps <= MAX_Y_STEPS:
                return [step * index for index in range(steps + 1)]
        power *= 10


def tick_usd(nanos: int) -> str:
    """A round amount as dollars, to the last digit that is not zero but with at
    least cents: 500_000_000 -> '$0.50', 2_000 -> '$0.000002'."""
    whole, _, fraction = usd(nanos).partition(".")
    return f"{whole}.{fraction.rstrip('0').ljust(2, '0')}"


def _y_axis(ticks: Sequence[int], scale: _Scale) -> str:
    """A grid line and a dollar label at each tick."""
    right = CHART_WIDTH - MARGIN_RIGHT
    return "".join(
        f'<line class="grid" x1="{MARGIN_LEFT}" x2="{right}" y1="{scale.y(tick):.1f}" '
        f'y2="{scale.y(tick):.1f}"/>'
        f'<text class="axis y-tick" x="{MARGIN_LEFT - 6}" y="{scale.y(tick) + 4:.1f}" '
        f'text-anchor="end">{tick_usd(tick)}</text>'
        for tick in ticks
    )


def _age_out_marks(marks: Sequence[AgeOut], scale: _Scale) -> str:
    """A dotted vertical line at each instant bookings aged out, its tooltip saying what."""
    shown = _thinned(marks, MAX_AGE_OUT_MARKS) if marks else []
    lines = "".join(
        f'<line class="age-out-mark" x1="{scale.x(mark.at_us):.1f}" '
        f'x2="{scale.x(mark.at_us):.1f}" y1="{MARGIN_TOP}" y2="{CHART_HEIGHT - MARGIN_BOTTOM}">'
        f"<title>{counted(mark.count, 'booking')} aged out at "
        f"{html.escape(time_text(_timestamp(mark.at_us)))}, freeing {usd(mark.nanos)}</title>"
        "</line>"
        for mark in shown
    )
    return f'<g id="age-out-marks" data-count="{len(marks)}">{lines}</g>'


def _next_release_marker(release: AgeOut | None, scale: _Scale, spent_now: int) -> str:
    """An arrow at the right edge (now) when the oldest booking ages out just after it."""
    if release is None:
        return ""
    x, y = CHART_WIDTH - MARGIN_RIGHT, scale.y(spent_now)
    return (
        f'<path id="next-release-marker" d="M{x},{y - 6:.1f} l8,6 l-8,6 z">'
        f"<title>next release at {html.escape(time_text(_timestamp(release.at_us)))} "
        f"(after now), frees {usd(release.nanos)}</title></path>"
    )


def chart_svg(
    points: Sequence[ChartPoint],
    denials: Sequence[ChartPoint],
    corrections: Sequence[pb.Event] = (),
    span_us: tuple[int, int] | None = None,
    marks: Sequence[AgeOut] = (),
    release: AgeOut | None = None,
) -> str:
    """The window, from `span_us` (now - window, now; by default the points' own
    span), with round dollar ticks, age-out marks and the next release."""
    shown = _thinned(points, MAX_CHART_POINTS)
    marked = _thinned(denials, MAX_DENIAL_MARKERS) if denials else []
    start_us, end_us = span_us if span_us is not None else (shown[0].at_us, shown[-1].at_us)
    end_us = max(end_us, start_us + MICROS_PER_SECOND)
    ticks = y_ticks(max(p for point in shown for p in (point.spent_nanos, point.limit_nanos)))
    scale = _Scale(start_us, end_us, ticks[-1])
    bottom = CHART_HEIGHT - MARGIN_BOTTOM
    right = CHART_WIDTH - MARGIN_RIGHT
    markers = "".join(
        f'<path class="denial-marker" d="M{scale.x(p.at_us):.1f},{scale.y(p.spent_nanos) - 9:.1f}'
        f' l-5,-8 h10 z"><title>denied at {html.escape(time_text(_timestamp(p.at_us)))}'
        f"</title></path>"
        for p in marked
    )
    return (
        f'<svg id="window-chart" role="img" '
        f'viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" width="{CHART_WIDTH}" '
        f'height="{CHART_HEIGHT}" aria-label="spent, held and limit over the window">'
        f'<rect class="plot" x="{MARGIN_LEFT}" y="{MARGIN_TOP}" '
        f'width="{right - MARGIN_LEFT}" height="{bottom - MARGIN_TOP}"/>'
        f'<g id="y-axis">{_y_axis(ticks, scale)}</g>'
        f"{_age_out_marks(marks, scale)}"
        f'<polyline id="limit-line" class="limit" points="{_steps(shown, scale, "limit_nanos")}"/>'
        f'<polyline id="spent-line" class="spent" points="{_steps(shown, scale, "spent_nanos")}"/>'
        f'<polyline id="held-line" class="held" points="{_steps(shown, scale, "held_nanos")}"/>'
        f'<g id="denial-markers" data-count="{len(denials)}">{markers}</g>'
        f"{_correction_markers(corrections, scale)}"
        f"{_next_release_marker(release, scale, shown[-1].spent_nanos)}"
        f'<text class="axis" x="{MARGIN_LEFT}" y="{bottom + 18}">'
        f"{html.escape(time_text(_timestamp(start_us)))}</text>"
        f'<text class="axis" x="{right}" y="{bottom + 18}" text-anchor="end">'
        f"{html.escape(time_text(_timestamp(end_us)))} (now)</text>"
        f'<text class="legend spent" x="{MARGIN_LEFT}" y="{bottom + 40}">&#9632; spent</text>'
        f'<text class="legend held" x="{MARGIN_LEFT + 90}" y="{bottom + 40}">&#9632; held</text>'
        f'<text class="legend limit" x="{MARGIN_LEFT + 180}" y="{bottom + 40}">&#9632; limit</text>'
        f'<text class="legend denial" x="{MARGIN_LEFT + 270}" y="{bottom + 40}">'
        f"&#9660; denial ({len(denials)})</text>"
        f'<text class="legend correction" x="{MARGIN_LEFT + 400}" y="{bottom + 40}">'
        f"&#9679; correction ({len(corrections)})</text>"
        f'<text class="legend age-out" x="{MARGIN_LEFT + 550}" y="{bottom + 40}">'
        f"&#9482; aged out ({len(marks)})</text>"
        "</svg>"
    )


# The page --------------------------------------------------------------------

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 1000px;
       color: #1d2330; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin-bottom: .25rem; }
.summary { font-size: 1.05rem; background: #f4f6fa; border-left: 4px solid #3b5bdb;
           padding: .6rem .9rem; }
.flags { list-style: none; padding: 0; display: flex; gap: .5rem; }
.flag { background: #c92a2a; color: white; border-radius: 4px; padding: .1rem .5rem;
        font-size: .85rem; font-weight: 600; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { text-align: left; padding: .2rem .8rem .2rem 0; border-bottom: 1px solid #e3e6ee; }
td.raw { font-family: ui-monospace, monospace; color: #59607a; text-align: right; }
svg .plot { fill: #fbfcfe; stroke: #c5cad8; }
svg polyline { fill: none; stroke-width: 2; }
svg polyline.spent { stroke: #3b5bdb; }
svg polyline.held { stroke: #f08c00; stroke-dasharray: 4 3; }
svg polyline.limit { stroke: #c92a2a; stroke-dasharray: 8 4; }
svg .denial-marker { fill: #c92a2a; }
svg .correction-marker { fill: #2f9e44; stroke: white; stroke-width: 1.5; }
svg line.grid { stroke: #e3e6ee; }
svg line.age-out-mark { stroke: #7048e8; stroke-dasharray: 2 3; }
svg #next-release-marker { fill: #7048e8; }
svg text { font: 12px system-ui, sans-serif; fill: #59607a; }
svg text.spent { fill: #3b5bdb; }
svg text.held { fill: #f08c00; }
svg text.limit, svg text.denial { fill: #c92a2a; }
svg text.correction { fill: #2f9e44; }
svg text.age-out { fill: #7048e8; }
"""


def _raw(message: Any, name: str) -> str:
    value = getattr(message, name)
    if isinstance(value, timestamp_pb2.Timestamp):
        return value.ToJsonString() if message.HasField(name) else ""
    if name in RATIOS:
        return str(_ratio(message, name).quantize(RAW_RATIO_PLACES, decimal.ROUND_HALF_UP))
    return str(value)


def _shown(message: Any, name: str) -> str:
    value = getattr(message, name)
    if isinstance(value, timestamp_pb2.Timestamp):
        return time_text(value) if message.HasField(name) else "-"
    if name.endswith("_nanos"):
        return usd(value)
    if name == "denial_rate":
        percent = (_ratio(message, name) * 100).quantize(SHOWN_PLACES, decimal.ROUND_HALF_UP)
        return f"{percent}%"
    if name in RATIOS:
        return str(_ratio(message, name).quantize(SHOWN_PLACES, decimal.ROUND_HALF_UP))
    return str(value)


def _ratio(audit: Any, name: str) -> decimal.Decimal:
    """A ratio of the audit, exactly, from the integers it is the ratio of (0 over
    nothing, as the audit says), so that the page shows no float."""
    part, whole = (getattr(audit, field) for field in RATIOS[name])
    return decimal.Decimal(part) / decimal.Decimal(whole) if whole else decimal.Decimal(0)


def _figure_rows(message: Any, names: Iterable[str]) -> str:
    return "".join(
        f'<tr><th scope="row">{html.escape(LABELS[name])}</th>'
        f'<td class="raw" id="{name.replace("_", "-")}">{html.escape(_raw(message, name))}</td>'
        f"<td>{html.escape(_shown(message, name))}</td></tr>"
        for name in names
    )


def _biggest_table(audit: pb.Audit) -> str:
    header = "".join(
        f"<th>{name}</th>"
        for name in ("reservation", "state", "amount", "hold", "cap", "reserved", "ages out")
    )
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
        for row in _booking_rows(audit)
    )
    return f'<table id="biggest-bookings"><tr>{header}</tr>{rows}</table>'


def _corrections_table(corrections: Sequence[pb.Event]) -> str:
    """The newest corrections of the window, one row each; data-count counts them all."""
    header = "".join(f"<th>{name}</th>" for name in CORRECTIONS_HEADER)
    listed = corrections[-MAX_CORRECTIONS_LISTED:]
    rows = "".join(
        '<tr class="correction">'
        + "".join(f"<td>{html.escape(cell)}</td>" for cell in _correction_cells(event))
        + "</tr>"
        for event in reversed(listed)
    )
    if not corrections:
        rows = f'<tr><td colspan="{len(CORRECTIONS_HEADER)}">none in this window</td></tr>'
    more = (
        f"<p>The newest {len(listed)} of {len(corrections)} are listed.</p>"
        if len(listed) < len(corrections)
        else ""
    )
    return (
        f'<table id="corrections" data-count="{len(corrections)}"><tr>{header}</tr>{rows}'
        f"</table>{more}"
    )


def _correction_cells(event: pb.Event) -> tuple[str, ...]:
    return (
        str(event.seq),
        event.reservation_id,
        time_text(event.occurred_at),
        usd(event.previous_amount_nanos),
        usd(event.amount_nanos),
        _reason(event),
        event.correction_id,
    )


def render_page(
    audit: pb.Audit,
    events: Sequence[pb.Event],
    truncated: bool = False,
    earlier: Sequence[pb.Event] = (),
) -> str:
    """One HTML page, self-contained: inline CSS and SVG, no script, no links out.
    `events` are the window's, `earlier` those of the window before it."""
    points, denials = chart_points(events, audit.balance)
    corrections = corrected_events(events)
    span_us = window_span_us(audit.balance)
    marks = age_outs([*earlier, *events], *span_us)
    lane = html.escape(audit.lane)
    flags = "".join(f'<li class="flag">{html.escape(flag)}</li>' for flag in audit.flags)
    note = (
        "<p><strong>The chart starts late:</strong> the lane's log was longer than this "
        "report reads.</p>"
        if truncated
        else ""
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Lane {lane}: ledger report</title><style>{STYLE}</style></head><body>"
        f'<h1>Lane <span id="lane">{lane}</span></h1>'
        f"<p>The {html.escape(duration_text(audit.balance.window))} rolling window as of "
        f'<time id="as-of" datetime="{audit.balance.as_of.ToJsonString()}">'
        f"{html.escape(time_text(audit.balance.as_of))}</time>.</p>"
        f'<p id="summary" class="summary">{html.escape(audit.summary)}</p>'
        f'<ul id="flags" class="flags">{flags}</ul>'
        f"<h2>Spent, held and limit over the window</h2>{note}"
        f"{chart_svg(points, denials, corrections, span_us, marks, next_release(audit))}"
        f'<h2>Where the spend went</h2><table id="audit-figures">'
        f"{_figure_rows(audit.balance, BALANCE_FIGURES)}{_figure_rows(audit, AUDIT_FIGURES)}"
        f"</table><h2>Biggest bookings</h2>{_biggest_table(audit)}"
        f"<h2>Charges corrected</h2>{_corrections_table(corrections)}"
        "</body></html>\n"
    )


def next_release(audit: pb.Audit) -> AgeOut | None:
    """When the window's oldest booking ages out, just after now, and what it frees."""
    if not audit.HasField("next_release_at"):
        return None
    return AgeOut(micros(audit.next_release_at), 0, audit.next_release_nanos)


def page_directory(path: pathlib.Path) -> pathlib.Path:
    """The directory the page goes to; a path that cannot name a page is refused
    as a bad value, checked before the server is asked for the audit."""
    directory = path.parent if str(path.parent) else pathlib.Path(".")
    if not directory.is_dir():
        raise CliError(f"--html: {str(directory)!r} is not a directory", EXIT_BAD_VALUE)
    if path.is_dir():
        raise CliError(
            f"--html: {str(path)!r} is a directory: name the page's file", EXIT_BAD_VALUE
        )
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # The page is renamed over the path: a device (/dev/null) or a link
        # (/dev/stdout) would be replaced by it, not written to.
        raise CliError(
            f"--html: {str(path)!r} is not a regular file (a link, a device, a pipe or a "
            "socket): name the page's own file",
            EXIT_BAD_VALUE,
        )
    return directory


def write_page(path: pathlib.Path, page: str) -> None:
    """Writes the page whole or not at all (a temporary file, then a rename),
    readable by all (PAGE_MODE)."""
    directory = page_directory(path)
    handle, temporary = tempfile.mkstemp(prefix=".ledger-report-", dir=directory)
    try:
        os.fchmod(handle, PAGE_MODE)  # mkstemp makes it 0600; fchmod ignores the umask
        with os.fdopen(handle, "w", encoding="utf-8") as output:
            output.write(page)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


# Commands --------------------------------------------------------------------


def audit(arguments: argparse.Namespace, session: Session) -> int:
    found = fetch_audit(arguments, session)
    _emit(arguments, found, audit_lines(found))
    return 0


def report(arguments: argparse.Namespace, session: Session) -> int:
    page_directory(arguments.html)
    found = fetch_audit(arguments, session)
    events, earlier, truncated = window_events(arguments.lane, found.balance, session)
    if truncated:
        print(f"ledger: read {MAX_PAGES * PAGE_SIZE} events and stopped", file=sys.stderr)
    try:
        write_page(arguments.html, render_page(found, events, truncated, earlier))
    except OSError as error:
        raise CliError(f"--html: cannot write {str(arguments.html)!r}: {error.strerror}") from None
    # --json: the audit the page shows, as `ledger audit --json` prints it.
    _emit(arguments, found, [f"wrote {arguments.html}: {found.summary}"])
    return 0


def register(commands: Any) -> None:
    common = _common_options()
    check = commands.add_parser(
        "audit",
        parents=[common],
        help="how a lane's window splits into real charges, estimates, holds and refusals",
    )
    check.add_argument("lane", metavar="LANE")
    check.add_argument("--biggest", default=str(DEFAULT_BIGGEST), metavar="N", help=BIGGEST_HELP)
    check.set_defaults(run=_command(audit))

    page = commands.add_parser(
        "report", parents=[common], help="write a lane's audit and window chart as one HTML page"
    )
    page.add_argument("lane", metavar="LANE")
    page.add_argument("--html", required=True, type=pathlib.Path, metavar="FILE",
                      help="the page to write (self-contained: open it anywhere)")  # fmt: skip
    page.add_argument("--biggest", default=str(DEFAULT_BIGGEST), metavar="N", help=BIGGEST_HELP)
    page.set_defaults(run=_command(report))
