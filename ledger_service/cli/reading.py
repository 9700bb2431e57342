"""Reading the ledger: `ledger balance`, and `ledger history` as a table, with
`--follow` to tail the log until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from ledger_service.api.errors import REASON_KEY
from ledger_service.cli.connection import (
    MAX_PAGES,
    PAGE_SIZE,
    Session,
    command,
    explain,
    last_holding,
)
from ledger_service.cli.exits import EXIT_BAD_VALUE, EXIT_UNREACHABLE, CliError
from ledger_service.cli.render import (
    duration_text,
    emit,
    enum_name,
    message_json,
    pairs,
    row_text,
    time_text,
    usd,
)
from ledger_service.cli.values import parse_count
from ledger_service.domain.errors import ShuttingDown
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

DEFAULT_HISTORY_EVENTS = 50
MAX_HISTORY_EVENTS = 10_000
# --follow: events received and not yet printed, and how often the printing
# thread looks up from waiting for them (so Ctrl-C is seen at once).
FOLLOW_QUEUE_EVENTS = 1000
FOLLOW_POLL_SECONDS = 0.1
# --follow through a server's stop (SHUTTING_DOWN): how long the server has to
# be back (a restart) before the command ends, and how long each look waits.
FOLLOW_RESUME_SECONDS = 60.0
FOLLOW_RESUME_TRY_SECONDS = 1.0
# A follow's listing of the newest events, made again after each stop it meets.
FOLLOW_LIST_ATTEMPTS = 10
# A trace id is shown whole (32 hex digits), so it can be pasted into a trace search.
TRACE_ID_CHARACTERS = 32
CORRECTION_REASON_SHOWN_CHARACTERS = 40
HISTORY_HEADER = (
    "SEQ",
    "TIME (UTC)",
    "LANE",
    "KIND",
    "RESERVATION",
    "AMOUNT",
    "SPENT AFTER",
    "OUTCOME",
    "TRACE",
)

# Minimum widths of a listed page; each column widens to its longest cell.
HISTORY_WIDTHS = (5, 24, 8, 15, 12, 12, 12, 14, TRACE_ID_CHARACTERS)
# --follow prints rows that arrive after its header, so its minimums hold what
# most rows do: lane names such as 'incoming-filter', the lane clients'
# reservation ids (32 hex digits), amounts up to $999, and the longest usual
# outcome ('succeeded http 200', 'hold exceeds limit').
FOLLOW_HISTORY_WIDTHS = (5, 24, 16, 15, 32, 14, 14, 18, TRACE_ID_CHARACTERS)


def balance_lines(balance: pb.Balance) -> list[str]:
    return pairs(
        [
            ("lane", balance.lane),
            ("as of", time_text(balance.as_of)),
            ("window", duration_text(balance.window)),
            ("limit", usd(balance.limit_nanos)),
            ("spent", usd(balance.spent_nanos)),
            ("  held", usd(balance.held_nanos)),
            ("  charged", usd(balance.charged_nanos)),
            ("available", usd(balance.available_nanos)),
            ("overrun", usd(balance.overrun_nanos)),
            ("open bookings", str(balance.open_bookings)),
        ]
    )


def event_outcome(event: pb.Event) -> str:
    """What ended the booking, in a few words: the 'outcome/http status' column."""
    if event.kind == "settled":
        status = f" http {event.http_status}" if event.http_status else ""
        return f"{enum_name(pb.Outcome, event.outcome)}{status}"
    if event.kind == "refunded":
        return f"http {event.http_status}" if event.http_status else event.reason[:40]
    if event.kind == "denied":
        return enum_name(pb.DenialReason, event.denial_reason)
    if event.kind == "lane_configured":
        return f"limit {usd(event.limit_nanos)}"
    if event.kind == "corrected":
        return correction_outcome(event)
    return "-"


def correction_outcome(event: pb.Event) -> str:
    """'was $X: why', the reason on one line and cut short: the table stays one row a line."""
    reason = " ".join(event.reason.split())
    if len(reason) > CORRECTION_REASON_SHOWN_CHARACTERS:
        reason = reason[: CORRECTION_REASON_SHOWN_CHARACTERS - 3] + "..."
    return f"was {usd(event.previous_amount_nanos)}: {reason or event.correction_id}"


def event_row(event: pb.Event) -> tuple[str, ...]:
    return (
        str(event.seq),
        time_text(event.occurred_at),
        event.lane,
        event.kind,
        event.reservation_id or "-",
        usd(event.amount_nanos),
        usd(event.spent_after_nanos),
        event_outcome(event),
        event.trace_id or "-",
    )


def balance(arguments: argparse.Namespace, session: Session) -> int:
    value = session.ledger.GetBalance(
        pb.GetBalanceRequest(lane=arguments.lane), **session.options()
    )
    emit(arguments, value, balance_lines(value))
    return 0


def history(arguments: argparse.Namespace, session: Session) -> int:
    limit = parse_count("--limit", arguments.limit)
    if not 1 <= limit <= MAX_HISTORY_EVENTS:
        raise CliError(f"--limit: must be between 1 and {MAX_HISTORY_EVENTS}", EXIT_BAD_VALUE)
    resumed = arguments.after_seq is not None
    after_seq = parse_count("--after-seq", arguments.after_seq if resumed else "0")
    events: list[pb.Event] = []
    last_seq = after_seq
    # A resumed follow (what a stopped one says to run) lists nothing first:
    # the stream sends every event after SEQ, where the newest --limit would skip.
    if not (arguments.follow and resumed):
        # An unknown lane fails here, NOT_FOUND from ListEvents itself: a read
        # grant (or a server awaiting recovery) must not need the admin's GetLane.
        events, last_seq = _listed(arguments, session, after_seq, limit)
    widths = _history_widths(events, FOLLOW_HISTORY_WIDTHS if arguments.follow else HISTORY_WIDTHS)
    columns = _history_columns(arguments)
    header = _Header(
        None
        if arguments.json
        else row_text([HISTORY_HEADER[i] for i in columns], [widths[i] for i in columns])
    )
    if not (arguments.follow and resumed):
        header.show()
    for event in events:
        _print_event(arguments, event, widths, columns)
    if arguments.follow:
        return follow(arguments, session, last_seq, widths, columns, header)
    return 0


class _Header:
    """The table's header, printed once. A resumed follow prints it only once
    the server accepts the stream, so that a refused --after-seq prints its
    error alone, not under a header of a table that never comes."""

    def __init__(self, text: str | None) -> None:
        self._text = text

    def show(self) -> None:
        if self._text is not None:
            print(self._text, flush=True)
            self._text = None


def _listed(
    arguments: argparse.Namespace, session: Session, after_seq: int, limit: int
) -> tuple[list[pb.Event], int]:
    """The newest events, as `recent_events`. A follow's listing meets a server
    that stops (SHUTTING_DOWN) as its stream does: it waits for the server (or
    another replica) to answer and lists again, at most FOLLOW_LIST_ATTEMPTS
    times. Under a write load the listing takes seconds, and a restart then
    ended the follow before it printed anything."""
    for _ in range(FOLLOW_LIST_ATTEMPTS - 1):
        try:
            return recent_events(arguments, session, after_seq, limit)
        except grpc.RpcError as error:
            if not (arguments.follow and _shutting_down(error)):
                raise
        print(
            f"ledger: the ledger at {session.server} is stopping; listing again once it "
            f"answers (at most {FOLLOW_RESUME_SECONDS:g} s)",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_return(arguments, session, after_seq, printed=False)
    return recent_events(arguments, session, after_seq, limit)


def recent_events(
    arguments: argparse.Namespace, session: Session, after_seq: int, limit: int
) -> tuple[list[pb.Event], int]:
    """The newest `limit` events after `after_seq`, and the last seq read: the
    events after the largest seq that still has `limit` after it."""
    found = _events_after(arguments, session, after_seq, limit + 1)
    if len(found) <= limit:
        return found, found[-1].seq if found else after_seq

    def full_page_after(seq: int) -> list[pb.Event] | None:
        page = _events_after(arguments, session, seq, limit)
        return page if len(page) == limit else None

    newest = last_holding(after_seq, found[:limit], full_page_after)
    return newest, newest[-1].seq


def _events_after(
    arguments: argparse.Namespace, session: Session, after_seq: int, wanted: int
) -> list[pb.Event]:
    """The first `wanted` events after `after_seq` (fewer: the log ends first)."""
    events: list[pb.Event] = []
    token = ""
    for _ in range(MAX_PAGES):
        request = pb.ListEventsRequest(
            lane=arguments.lane or "",
            reservation_id=arguments.reservation_id or "",
            page_size=min(wanted - len(events), PAGE_SIZE),
            page_token=token,
            after_seq=after_seq,
        )
        page = session.ledger.ListEvents(request, **session.options())
        events.extend(page.events)
        token = page.next_page_token
        if not token or len(events) >= wanted:
            return events[:wanted]
    raise CliError(
        f"--limit: the server's pages are too small to read {wanted} events in "
        f"{MAX_PAGES} pages: ask for a smaller --limit",
        EXIT_BAD_VALUE,
    )


def follow(
    arguments: argparse.Namespace,
    session: Session,
    after_seq: int,
    widths: Sequence[int],
    columns: Sequence[int],
    header: _Header,
) -> int:
    """Tails the log until Ctrl-C; the only loop that the user, not a limit, ends.

    A server that stops (SHUTTING_DOWN: a restart, a replica leaving) ends the
    stream; as the contract says, it is opened again after the last seq seen,
    once the server (or another replica) answers, within FOLLOW_RESUME_SECONDS.
    A connection that breaks for good (a server killed, a network down) ends
    it, exit 3, saying where to resume."""
    said_at: int | None = None  # the seq the stopping line last named: said once a stop
    try:
        while True:
            try:
                after_seq = _tail(arguments, session, after_seq, widths, columns, header)
            except _Stopped as stopped:
                after_seq = stopped.after_seq
            except _Broken as broken:
                said = explain(broken.error, session)
                if said.exit_code == EXIT_UNREACHABLE:  # not a refusal (a grant expired, say)
                    said.message += f"; {_resume_hint(broken.after_seq)}"
                raise said from None
            if said_at != after_seq:
                _say_stopping(session, after_seq)
                said_at = after_seq
            _wait_for_return(arguments, session, after_seq)
    except KeyboardInterrupt:
        return 0


class _Stopped(Exception):
    """The server ended the stream SHUTTING_DOWN after `after_seq`."""

    def __init__(self, after_seq: int) -> None:
        super().__init__(after_seq)
        self.after_seq = after_seq


class _Broken(Exception):
    """The stream failed with `error`, not a stop, after `after_seq`."""

    def __init__(self, after_seq: int, error: grpc.RpcError) -> None:
        super().__init__(after_seq)
        self.after_seq = after_seq
        self.error = error


def _resume_hint(after_seq: int) -> str:
    """What to run after a follow that ended having shown the events up to `after_seq`."""
    return f"resume with --after-seq {after_seq}"


def _answered(stream: object) -> bool:
    """Whether a stream whose headers came is still open, or ended OK: not refused."""
    ended = isinstance(stream, grpc.Future) and stream.done()
    return not ended or (isinstance(stream, grpc.Call) and stream.code() is grpc.StatusCode.OK)


def _shutting_down(error: grpc.RpcError) -> bool:
    if not isinstance(error, grpc.Call) or error.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    trailers = dict(error.trailing_metadata() or ())
    return trailers.get(REASON_KEY) == ShuttingDown.reason


def _say_stopping(session: Session, after_seq: int) -> None:
    print(
        f"ledger: the ledger at {session.server} is stopping; following again after seq "
        f"{after_seq} once it answers (at most {FOLLOW_RESUME_SECONDS:g} s)",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_return(
    arguments: argparse.Namespace, session: Session, after_seq: int, *, printed: bool = True
) -> None:
    """Returns once the server answers again; CliError (exit 3) if it has not
    within FOLLOW_RESUME_SECONDS, saying how to resume (`printed`: events up to
    `after_seq` were shown; else the same command again). Each look is short,
    so Ctrl-C is seen."""
    request = pb.ListEventsRequest(lane=arguments.lane or "", page_size=1, after_seq=after_seq)
    given_up = time.monotonic() + FOLLOW_RESUME_SECONDS
    while (left := given_up - time.monotonic()) > 0:
        try:
            session.ledger.ListEvents(
                request,
                timeout=min(left, FOLLOW_RESUME_TRY_SECONDS),
                metadata=session.metadata,
                wait_for_ready=True,
            )
            return
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if code is grpc.StatusCode.UNAVAILABLE:
                time.sleep(min(max(left, 0), FOLLOW_RESUME_TRY_SECONDS))
    resume = _resume_hint(after_seq) if printed else "run the command again"
    raise CliError(
        f"the ledger at {session.server} stopped and did not answer again within "
        f"{FOLLOW_RESUME_SECONDS:g} s; {resume}",
        EXIT_UNREACHABLE,
    )


def _tail(
    arguments: argparse.Namespace,
    session: Session,
    after_seq: int,
    widths: Sequence[int],
    columns: Sequence[int],
    header: _Header,
) -> int:
    """Prints the events of one stream, under the header once the server
    accepts it; raises what ends it.

    The stream is read in a thread of its own and printed here, so that the
    KeyboardInterrupt of a Ctrl-C is raised in this loop, never inside
    grpc's own code halfway through a step of the stream (with its locks
    held, where it once left the command hanging after Ctrl-C). The seq of
    each event received is kept, shown or not, as where a reopened stream starts."""
    request = pb.WatchEventsRequest(lane=arguments.lane or "", after_seq=after_seq)
    stream = session.ledger.WatchEvents(request, metadata=session.metadata)
    received: queue.Queue[pb.Event | Exception | bool | None] = queue.Queue(FOLLOW_QUEUE_EVENTS)

    def receive() -> None:
        try:
            # The server sends its headers once it accepts the stream; a refused
            # one ends with no headers of its own, and iterating raises its error.
            stream.initial_metadata()
            received.put(_answered(stream))
            for event in stream:
                received.put(event)
            received.put(None)
        except Exception as error:  # raised below: a thread that died silently would hang here
            received.put(error)

    threading.Thread(target=receive, name="ledger-follow", daemon=True).start()
    try:
        while True:
            try:
                item = received.get(timeout=FOLLOW_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                break
            if isinstance(item, bool):
                if item:
                    header.show()
                continue
            if isinstance(item, Exception):
                if isinstance(item, grpc.RpcError) and _shutting_down(item):
                    raise _Stopped(after_seq) from item
                if isinstance(item, grpc.RpcError):
                    raise _Broken(after_seq, item) from item
                raise item
            after_seq = item.seq
            if arguments.reservation_id and item.reservation_id != arguments.reservation_id:
                continue
            _print_event(arguments, item, widths, columns)
    finally:
        stream.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped
    raise CliError(f"the ledger at {session.server} ended the stream after seq {after_seq}")


def _history_columns(arguments: argparse.Namespace) -> list[int]:
    """Every column, less LANE when one lane is asked for."""
    return [i for i, name in enumerate(HISTORY_HEADER) if name != "LANE" or not arguments.lane]


def _history_widths(events: Sequence[pb.Event], minimums: Sequence[int]) -> list[int]:
    rows = [HISTORY_HEADER, *(event_row(event) for event in events)]
    return [max(minimum, *(len(row[i]) for row in rows)) for i, minimum in enumerate(minimums)]


def _print_event(
    arguments: argparse.Namespace, event: pb.Event, widths: Sequence[int], columns: Sequence[int]
) -> None:
    if arguments.json:
        print(json.dumps(message_json(event), sort_keys=True), flush=True)
        return
    row = event_row(event)
    print(row_text([row[i] for i in columns], [widths[i] for i in columns]), flush=True)


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    money = commands.add_parser("balance", parents=[common], help="a lane's window right now")
    money.add_argument("lane", metavar="LANE")
    money.set_defaults(run=command(balance))

    log = commands.add_parser("history", parents=[common], help="the event log as a table")
    log.add_argument("lane", metavar="LANE", nargs="?", help="default: every lane")
    log.add_argument("--reservation-id", metavar="ID", help="only this booking's events")
    log.add_argument(
        "--limit",
        default=str(DEFAULT_HISTORY_EVENTS),
        metavar="N",
        help=f"the newest N events (default {DEFAULT_HISTORY_EVENTS}, "
        f"at most {MAX_HISTORY_EVENTS})",
    )
    log.add_argument(
        "--after-seq",
        metavar="SEQ",
        help="only events after SEQ; with --follow, all of them (how a stopped follow resumes)",
    )
    log.add_argument("--follow", action="store_true", help="then print new events until Ctrl-C")
    # Its reservation id is an option, not the moves' RESERVATION_ID argument.
    log.set_defaults(run=command(history), option_of_field={"reservation_id": "--reservation-id"})
