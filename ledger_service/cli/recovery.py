"""Recovery commands, run next to the database like `migrate`:
`verify`, `snapshot`, `rebuild` and `recover` (docs/recovery.md).

Exit codes: 0 done (or nothing to do), 1 a finding or a refusal, 2 the
database could not be reached or the work failed, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from ledger_service.cli.exits import EXIT_INTERRUPTED, EXIT_TERMINATED
from ledger_service.cli.operate import database_options, settings_from
from ledger_service.cli.render import micros_time_text
from ledger_service.domain.counts import counted
from ledger_service.settings import Settings

if TYPE_CHECKING:  # the commands import the server lazily, as `serve` does
    from ledger_service.recovery.plan import RecoveryPolicy
    from ledger_service.recovery.rebuild import Recovery
    from ledger_service.recovery.verify import VerificationReport
    from ledger_service.storage.sql import SqlStore


def register(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        help="check every hash-chain link and every projected lane, booking and window "
        "total against a replay of the log",
    )
    database_options(verify)
    verify.add_argument(
        "--at-us",
        type=_instant_us,
        metavar="MICROSECONDS",
        help="instant of the window totals, in microseconds since the epoch "
        "(default: now, or the last event's instant when that is later)",
    )
    verify.set_defaults(run=_interruptible("verify", _verify))

    snapshot = commands.add_parser("snapshot", help="snapshot the projections now")
    database_options(snapshot)
    snapshot.set_defaults(run=_interruptible("snapshot", _snapshot))

    rebuild = commands.add_parser(
        "rebuild",
        help="rebuild lanes and bookings from the newest verified snapshot and the log's "
        "tail (or the whole log), in batches, with progress on stderr",
    )
    database_options(rebuild)
    rebuild.add_argument("--from-scratch", action="store_true",
                         help="replay the whole log; ignore snapshots")  # fmt: skip
    rebuild.set_defaults(run=_interruptible("rebuild", _rebuild))

    recover = commands.add_parser(
        "recover",
        help="assess the projections and, if the planner admits it within your budget, "
        "rebuild them (a running server serves again within its check interval)",
    )
    database_options(recover)
    recover.add_argument(
        "--budget-seconds",
        type=float,
        required=True,
        metavar="SECONDS",
        help="the longest the reconstruction may take",
    )
    recover.add_argument(
        "--max-risk",
        type=float,
        metavar="RISK",
        help="largest acceptable risk score, 0..1 (default: the server's, 0.3)",
    )
    recover.add_argument(
        "--min-viable-sources",
        type=int,
        metavar="N",
        help="independent sources that must agree (default 1)",
    )
    recover.add_argument(
        "--accept-log-head",
        action="store_true",
        help="restore to the log's last event even though the projections or a snapshot "
        "had gone further (the events in between are lost)",
    )
    recover.set_defaults(run=_interruptible("recover", _recover))


def _instant_us(text: str) -> int:
    """An instant the ledger keeps (the test clock's range): past it the
    database's integer overflows, before 1970 no event can lie."""
    from ledger_service.domain.clock import TEST_CLOCK_EARLIEST_US, TEST_CLOCK_LATEST_US

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of microseconds: {text!r}") from None
    if not TEST_CLOCK_EARLIEST_US <= value <= TEST_CLOCK_LATEST_US:
        raise argparse.ArgumentTypeError(
            f"must be between {TEST_CLOCK_EARLIEST_US} (1970-01-01) and "
            f"{TEST_CLOCK_LATEST_US} (9998-12-23) microseconds since the epoch"
        )
    return value


# What Ctrl-C leaves behind, by command. A rebuild that had begun leaves the
# projections incomplete and the marker `rebuilding` (its claim given up):
# moves are refused until a rebuild finishes.
_INTERRUPTED = {
    "verify": "nothing was changed",
    "snapshot": "no snapshot was taken",
    "rebuild": "if it had begun, moves are refused until a rebuild finishes: "
    "run `ledger rebuild` again",
    "recover": "if it had begun rebuilding, moves are refused until a rebuild finishes: "
    "run `ledger recover` again",
}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a command as Ctrl-C does (a rebuild gives up its claim)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _interruptible(
    command: str, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`run`, ended by Ctrl-C (exit 130) or SIGTERM (exit 143) with one line,
    never a traceback. SIGTERM used to end a rebuild on the spot, its claim
    held until its lease ran out: `timeout` or a service manager then left
    the next rebuild refused for rebuild_lease_seconds."""

    def interruptible(arguments: argparse.Namespace) -> int:
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, _terminate) if main else None
        try:
            return run(arguments)
        except _Terminated:
            print(f"ledger {command}: terminated; {_INTERRUPTED[command]}", file=sys.stderr)
            return EXIT_TERMINATED
        except KeyboardInterrupt:
            print(f"ledger {command}: interrupted; {_INTERRUPTED[command]}", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            if before is not None:
                signal.signal(signal.SIGTERM, before)

    return interruptible


class ProgressPrinter:
    """events done / total and the rate, on stderr, at most every interval."""

    def __init__(self, stream: TextIO | None = None, interval_seconds: float = 0.5) -> None:
        self._stream = stream
        self._interval = interval_seconds
        self._phase = ""
        self._started = self._printed = 0.0

    def __call__(self, phase: str, done: int, total: int, elapsed_seconds: float) -> None:
        now = time.monotonic()
        if phase != self._phase:
            self._phase, self._started, self._printed = phase, now, 0.0
        if done < total and now - self._printed < self._interval:
            return
        self._printed = now
        # The caller's clock when it has one (it started before the first batch).
        elapsed = elapsed_seconds if elapsed_seconds > 0 else now - self._started
        share = 100 * done // total if total else 100
        # A rate over a few milliseconds says nothing (40,001 events "at 40M/s").
        rate = f", {done / elapsed:,.0f}/s" if elapsed >= 0.1 else ""
        stream = self._stream or sys.stderr
        print(f"{phase}: {done}/{total} ({share}%){rate}", file=stream, flush=True)


@contextmanager
def _recovery(arguments: argparse.Namespace, command: str) -> Iterator[tuple[Settings, Recovery]]:
    from ledger_service import server
    from ledger_service.storage import database

    settings = settings_from(arguments)
    # These commands look at a ledger; they never create an empty one.
    empty = database.empty_sqlite_file(settings.database_url)
    if empty is not None:
        print(f"ledger {command}: {database.empty_file_text(empty)} (docs/recovery.md)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    lost_wal = database.lost_wal_text(settings.database_url)
    if lost_wal:
        print(f"ledger {command}: {lost_wal}", file=sys.stderr)
        raise SystemExit(2)
    missing = _missing_database(settings)
    if missing:
        print(f"ledger {command}: no database at {missing}", file=sys.stderr)
        raise SystemExit(2)
    store = server.build_store(settings, logs_damage=False)
    refused = _refused_revision(store, command, settings)
    if refused is not None:
        store.close()
        raise SystemExit(refused)
    owner = f"ledger {command} {socket.gethostname()}:{os.getpid()}"
    try:
        yield settings, server.build_recovery(settings, store, owner)
    finally:
        store.close()


def _refused_revision(store: SqlStore, command: str, settings: Settings) -> int | None:
    """Exit 2 with one line when the schema is another release's: a newer one's
    columns a rebuild would drop, an older one's that every read fails on."""
    from ledger_service.domain.errors import StoreUnavailable
    from ledger_service.storage import migrate, translate

    if translate.search_path_missing(store.engine):
        # Not "no ledger schema yet (`ledger migrate` makes it)": migrate refuses.
        print(f"ledger {command}: {translate.MISSING_SCHEMA} ({_where(settings)})",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        with translate.translated():
            migrate.check_revision(store.engine)
    except migrate.RevisionRefused as error:
        print(f"ledger {command}: {error} ({_where(settings)})", file=sys.stderr)
        return 2
    except StoreUnavailable:
        # The command's own first read meets it again and says so, as before.
        return None
    return None


def _missing_database(settings: Settings) -> str:
    """The path of a SQLite database file that does not exist ("" otherwise):
    opening it would make an empty database of it."""
    from ledger_service.storage import database

    path = database.sqlite_file(settings.database_url)
    return "" if path is None or path.is_file() else str(path)


def database_unavailable(command: str, error: Exception, where: str = "") -> int:
    """Exit 2: the database did not answer, or (a damaged store) says what to
    do; `where` (the redacted URL), when given, follows in parentheses."""
    from ledger_service.domain.errors import StoreDamaged
    from ledger_service.storage import translate

    wrong = translate.misconfigured(error)
    if wrong is not None:
        # The URL names a database or role the server refuses: what to fix.
        print(f"ledger {command}: {': '.join(wrong)}", file=sys.stderr)
        return 2
    why = (
        error.message
        if isinstance(error, StoreDamaged)
        else translate.unavailable_words(error, "the database is unavailable")
    )
    said = "" if isinstance(error, StoreDamaged) else translate.driver_message(error)
    print(
        f"ledger {command}: {why}{f' ({where})' if where else ''}{f': {said}' if said else ''}",
        file=sys.stderr,
    )
    return 2


def _where(settings: Settings) -> str:
    from ledger_service.storage import database

    return database.redacted(settings.database_url)


def _verify(arguments: argparse.Namespace) -> int:
    from ledger_service.domain.clock import SystemClock
    from ledger_service.domain.errors import StoreUnavailable
    from ledger_service.recovery.verify import Verifier

    with _recovery(arguments, "verify") as (settings, recovery):
        verifier = Verifier(recovery.store, settings.recovery_batch_events)
        try:
            # The ledger's time, as a server reads it: never before its last event.
            now_us = arguments.at_us
            if now_us is None:
                now_us = max(SystemClock().now_us(), recovery.store.last_event_at_us())
            report = verifier.verify(now_us, ProgressPrinter())
        except StoreUnavailable as error:
            return database_unavailable("verify", error, _where(settings))
    summary = (
        f"{counted(report.events, 'event')}, {counted(report.lanes, 'lane')}, "
        f"{counted(report.bookings, 'booking')}, "
        f"window totals at {micros_time_text(now_us)}"
    )
    if report.unsealed_events:
        summary += f" ({counted(report.unsealed_events, 'event')} predate the hash chain)"
    accepted = report.accepted_count
    if accepted:
        summary += f"; {counted(accepted, 'broken link')} accepted by an operator's recovery"
    if report.ok:
        print(f"verified {summary}: OK")
        _print_accepted(report)
        return 0
    print(f"FAILED: {counted(report.finding_count, 'finding')} in {summary}")
    print(f"first: {report.findings[0]}")
    for finding in report.findings[1:]:
        print(f"  {finding}")
    if report.finding_count > len(report.findings):
        print(f"  ... and {report.finding_count - len(report.findings)} more")
    _print_accepted(report)
    if report.rebuilding_owner:
        # `ledger recover` is refused while the claim holds: it said to run it.
        print(f"next: if the rebuild by {report.rebuilding_owner} is running, wait for it to "
              "end and verify again; if it stopped, `ledger recover` rebuilds the projections "
              "(a killed one's claim lapses rebuild_lease_seconds after its last heartbeat: "
              "until then recover names when) (docs/recovery.md)")  # fmt: skip
        return 1
    print("next: `ledger recover` plans a rebuild of the projections from the log and says "
          "whether it may run (docs/recovery.md)")  # fmt: skip
    if report.broken_links and not report.mismatches:
        # The projections agree with the log: a recover that walks the chain
        # only after its verified point finds nothing, at every run.
        print("  it walks the chain only after the last verified point and the newest "
              "snapshot: if it says the projections are consistent, the links above lie "
              "before them, and nothing the ledger runs accepts or undoes them: restore "
              "the database from a backup")  # fmt: skip
    return 1


def _print_accepted(report: VerificationReport) -> None:
    """The broken links accepted by `ledger recover --max-risk 1`: the log
    keeps them, and verify names them every time (docs/recovery.md)."""
    for described in report.accepted:
        print(f"accepted: {described}")
    if report.accepted_count > len(report.accepted):
        print(f"  ... and {report.accepted_count - len(report.accepted)} more accepted")


def _snapshot(arguments: argparse.Namespace) -> int:
    from ledger_service.domain.errors import StoreUnavailable

    with _recovery(arguments, "snapshot") as (settings, recovery):
        try:
            info = recovery.take_snapshot()
        except StoreUnavailable as error:
            return database_unavailable("snapshot", error, _where(settings))
    if info is None:
        print("ledger snapshot: the projections are not consistent with the log; "
              "run `ledger verify`, then `ledger recover`", file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"snapshot {info.snapshot_id} at event {info.position_seq}: "
        f"{counted(info.lanes_count, 'lane')}, {counted(info.bookings_count, 'booking')}, "
        f"digest {info.digest}"
    )
    return 0


def _rebuild(arguments: argparse.Namespace) -> int:
    from ledger_service.domain.errors import StoreUnavailable
    from ledger_service.recovery.rebuild import FULL_LOG_SOURCE, ChainBroken, Route
    from ledger_service.recovery.store import RebuildClaimLost, RebuildFailed

    with _recovery(arguments, "rebuild") as (settings, recovery):
        try:
            # A rebuild from a snapshot reads only the log after it: damage
            # before it (a page of the log, an index) would pass unseen, and
            # "rebuilt" on a damaged file would send the operator back to serving.
            recovery.store.check_integrity()
            route = Route(FULL_LOG_SOURCE, None)
            if not arguments.from_scratch:
                for snapshot in recovery.store.snapshots():
                    problem = recovery.check_snapshot(snapshot)
                    if not problem:
                        route = Route(f"snapshot-{snapshot.snapshot_id}", snapshot)
                        break
                    print(f"skipping snapshot {snapshot.snapshot_id}: {problem}", file=sys.stderr)
            print(f"rebuilding from {route.source_id}", file=sys.stderr)
            started = time.monotonic()
            digest = recovery.rebuild(route, ProgressPrinter())
            elapsed = time.monotonic() - started
            print(f"rebuilt from {route.source_id} in {elapsed:.2f}s; digest {digest}")
            # As a recovery does: the next start and recovery begin from here.
            info = recovery.snapshot_after_rebuild()
            if info is not None:
                print(f"snapshot {info.snapshot_id} at event {info.position_seq}")
        except StoreUnavailable as error:
            return database_unavailable("rebuild", error, _where(settings))
        except ChainBroken as error:
            print(f"ledger rebuild: stopped at a broken link: {error}. `ledger verify` lists "
                  "them; `ledger recover --max-risk 1` accepts them", file=sys.stderr)  # fmt: skip
            return 1
        except (RebuildFailed, RebuildClaimLost) as error:
            print(f"ledger rebuild: {error}", file=sys.stderr)
            return 2
    return 0


# Each policy field, by the flag of `ledger recover` that sets it.
POLICY_FLAGS = {
    "max_budget_seconds": "--budget-seconds",
    "max_risk_score": "--max-risk",
    "min_viable_sources": "--min-viable-sources",
}


def _recovery_policy(arguments: argparse.Namespace, settings: Settings) -> RecoveryPolicy | None:
    """The policy of the flags (the server's settings where a flag is left out),
    or None after one line naming the flag whose value it refuses."""
    from ledger_service.recovery.plan import PolicyRefused, RecoveryPolicy

    risk, sources = arguments.max_risk, arguments.min_viable_sources
    policy = RecoveryPolicy(
        max_budget_seconds=arguments.budget_seconds,
        max_risk_score=settings.recovery_max_risk if risk is None else risk,
        min_viable_sources=settings.recovery_min_viable_sources if sources is None else sources,
    )
    try:
        policy.validate()
    except PolicyRefused as error:
        print(f"ledger recover: {POLICY_FLAGS[error.field]}: {error}", file=sys.stderr)
        return None
    return policy


def _recover(arguments: argparse.Namespace) -> int:
    import dataclasses

    from ledger_service.domain.errors import StoreUnavailable

    # Before the database is opened: a bad flag is named, not a missing database.
    policy = _recovery_policy(arguments, settings_from(arguments))
    if policy is None:
        return 2
    with _recovery(arguments, "recover") as (settings, recovery):
        recovery.settings = dataclasses.replace(
            recovery.settings, accept_log_head=arguments.accept_log_head
        )
        try:
            outcome = recovery.recover(policy, recovery.owner, ProgressPrinter())
            # Another process's claim: who holds it, and when a killed one's
            # lapses, as `ledger rebuild` says it ("in progress" alone, after a kill -9).
            detail = recovery.claimed_elsewhere() if outcome.waiting_for else outcome.detail
        except StoreUnavailable as error:
            return database_unavailable("recover", error, _where(settings))
    if outcome.manifest is not None:
        print(json.dumps(json.loads(outcome.manifest.to_json()), indent=2, sort_keys=True))
    print(f"ledger recover: {detail}", file=sys.stderr)
    if outcome.ready:
        return 0
    if outcome.manifest is not None and not outcome.manifest.admissible:
        return 1
    return 2
