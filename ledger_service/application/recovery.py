"""Recovery with a bounded cost: assess, plan, rebuild, snapshot.

The event log is the authority; lanes and bookings are projections of it,
written in the same transaction as each event. When a look at the database
(`assess`) finds the projections missing, behind or inconsistent with the log,
`plan` lists the sources that could rebuild them (each recent snapshot plus the
tail of the log after it, or the whole log), verifies each one (snapshot
digests, hash-chain links), estimates each one's cost from a replay rate
measured on a sample, scores its risk, and lets the domain planner
(`domain/recovery.py`) decide. An admissible plan is carried out by `rebuild`
in bounded batches; anything else is a clean refusal that leaves the
projections untouched and the server closed to moves.

`RecoveryGuard` is the server's side of it (see docs/recovery.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

from ledger_service.domain import recovery as planner
from ledger_service.domain.bookings import Booking
from ledger_service.domain.chain import ChainBreak, ChainWalker, altered
from ledger_service.domain.clock import MICROS_PER_SECOND, Clock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.policies import LanePolicy, policy_from_dict
from ledger_service.domain.recovery import Manifest, RecoveryPolicy, Source
from ledger_service.domain.snapshots import FORMAT_VERSION, ProjectionDigest, SnapshotInfo
from ledger_service.domain.window import WindowTotals

log = logging.getLogger("ledger.recovery")

STATE_CURRENT = "current"
STATE_REBUILDING = "rebuilding"
# At most this many chain breaks are named; more are only counted.
MAX_NAMED_BREAKS = 1000
FULL_LOG_SOURCE = "log"
# The server's snapshots come at most this many copied rows per event apart
# (see Recovery.snapshot_due).
SNAPSHOT_ROWS_PER_EVENT = 10
# A rebuild's digest has the bookings' lines made in ranges of this many
# (about 9 MB of lines each for the benchmark's bookings).
DIGEST_RANGE_BOOKINGS = 20_000
# Ranges a rebuild has walked before it deletes the old projections (their
# results are a few links and heads each; the rows stay in the processes).
EARLY_WALKS = 64

# (phase, done, total, elapsed_seconds)
ProgressFn = Callable[[str, int, int, float], None]


def no_progress(phase: str, done: int, total: int, elapsed_seconds: float) -> None:
    return None


# The storage interface recovery needs ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Position:
    """The projections' position marker."""

    last_seq: int
    state: str
    owner: str
    updated_at_us: int


@dataclasses.dataclass(frozen=True)
class LogFacts:
    """What one consistent, cheap look at the database shows."""

    position: Position | None
    head_seq: int
    event_count: int
    # reserved + denied events: each is one booking.
    answer_events: int
    # Lanes with a lane_configured event: each is one lanes row.
    configured_lanes: int
    bookings: int
    lanes: int
    # Bookings whose latest event (max of answer_seq, ended_seq) is missing or
    # names another amount, lane or reservation id.
    stale_bookings: int


@dataclasses.dataclass(frozen=True)
class SnapshotChunk:
    lanes: Sequence[LanePolicy] = ()
    bookings: Sequence[Booking] = ()
    # Bookings as rows the store keeps them in (opaque here), with each one's
    # canonical text (chain.canonical_json of its Booking): how the projections
    # are copied into a snapshot and back without a Booking built for each.
    booking_rows: Sequence[Sequence[Any]] = ()
    booking_texts: Sequence[str] = ()

    def add_to(self, digest: ProjectionDigest) -> None:
        for policy in self.lanes:
            digest.add_lane(policy)
        for booking in self.bookings:
            digest.add_booking(booking)
        for text in self.booking_texts:
            digest.add_booking_text(text)

    @property
    def rows(self) -> int:
        return len(self.lanes) + len(self.bookings) + len(self.booking_rows)


# A booking's key, (lane, reservation_id): the order of ProjectionView.bookings.
BookingKey = tuple[str, str]


class ProjectionView(Protocol):
    """One consistent read of the database (a snapshot transaction)."""

    @property
    def facts(self) -> LogFacts: ...

    @property
    def position(self) -> Position | None:
        """facts.position, without the rest of the facts."""
        ...

    def chain_heads(self, through_seq: int) -> Mapping[str, str]:
        """Each lane's last hash at or before `through_seq`; lanes whose
        events all predate the chain are left out."""
        ...

    def lanes(self) -> Iterator[LanePolicy]: ...

    def bookings(self) -> Iterator[Booking]: ...

    def booking_texts(self) -> Iterator[str]:
        """chain.canonical_json of each of `bookings`, in the same order."""
        ...

    def booking_chunks(self, size: int) -> Iterator[SnapshotChunk]:
        """`bookings`, `size` at a time, as chunks of rows with their texts."""
        ...

    def booking_key_after(self, after: BookingKey | None, count: int) -> BookingKey | None:
        """The key of the `count`th booking after `after` (from the first
        with None), in the order of `bookings`; None when there are fewer."""
        ...


class ChainLink(NamedTuple):
    """What a link of the chain is checked by (chain.ChainWalker.check_link)."""

    seq: int
    lane: str
    previous_hash: str
    hash: str


@dataclasses.dataclass(frozen=True)
class WalkedRange:
    """A range of the log walked on its own, without the heads its lanes had
    before it (`take_range` ends the walk with them).

    A lane's events up to and including its first sealed one in the range
    (`leading`) need the head from before the range, so they are left to the
    caller, with which of them no longer hash to their hash (`altered`). Every
    later event was checked here, link and content, by a ChainWalker that
    starts from that first sealed hash: `breaks` is what it found, in seq
    order, `heads` the lanes' heads after the range and `unsealed` how many
    unsealed events it passed."""

    events: int
    last_seq: int
    leading: Sequence[ChainLink]
    altered: Sequence[int]
    breaks: Sequence[ChainBreak]
    heads: Mapping[str, str]
    unsealed: int
    lane_events: Sequence[Event]


class ContentChecks(Protocol):
    def submit_walk(self, after_seq: int, through_seq: int) -> Future[WalkedRange]:
        """Starts walking (after_seq, through_seq] on its own (WalkedRange)."""
        ...

    def submit_booking_lines(
        self, after: BookingKey | None, through: BookingKey | None
    ) -> Future[tuple[int, bytes]]:
        """Starts making snapshots.booking_lines of the bookings with keys in
        (after, through] (None: from the first, to the last); the future
        gives how many there were and the lines."""
        ...


class RebuildClaimLost(Exception):
    """Another process took the rebuild over (its lease had expired for ours)."""


class RecoveryStore(Protocol):
    def facts(self) -> LogFacts: ...

    def position(self) -> Position | None:
        """The marker alone: one row, cheap enough for every maintenance turn."""
        ...

    def view(self) -> contextlib.AbstractContextManager[ProjectionView]: ...

    def events_after(
        self, after_seq: int, limit: int, *, lane: str = "", kinds: tuple[str, ...] = ()
    ) -> Sequence[Event]: ...

    def count_events_after(self, after_seq: int) -> int: ...

    def last_seq(self) -> int:
        """The log's last seq (0 when empty)."""
        ...

    def content_checks(self, processes: int) -> contextlib.AbstractContextManager[ContentChecks]:
        """Checks of events' contents, run by up to `processes` other processes
        (none: in the caller's thread)."""
        ...

    def log_lanes(self) -> Sequence[str]: ...

    def projected_lanes(self) -> Sequence[LanePolicy]: ...

    def projected_bookings(self, lane: str) -> Sequence[Booking]: ...

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals: ...

    def snapshots(self) -> Sequence[SnapshotInfo]:
        """Complete snapshots, newest position first (a bounded few)."""
        ...

    def snapshot_chunks(self, snapshot_id: int) -> Iterator[SnapshotChunk]: ...

    def begin_snapshot(
        self, position_seq: int, chain_heads: Mapping[str, str], taken_at_us: int
    ) -> int: ...

    def write_snapshot_chunk(
        self, snapshot_id: int, chunk_no: int, chunk: SnapshotChunk
    ) -> None: ...

    def complete_snapshot(
        self, snapshot_id: int, digest: ProjectionDigest, chain_verified: bool
    ) -> None: ...

    def prune_snapshots(self, keep: int, unfinished_before_us: int) -> int: ...

    def claim_rebuild(self, owner: str, now_us: int, lease_us: int) -> bool: ...

    def reset_projections(self, owner: str, position_seq: int, now_us: int) -> None: ...

    def restore_chunk(self, owner: str, chunk: SnapshotChunk, now_us: int) -> None: ...

    def fold_events(
        self,
        owner: str,
        lanes: Sequence[LanePolicy],
        after_seq: int,
        through_seq: int,
        now_us: int,
        *,
        dry_run: bool = False,
    ) -> None:
        """In one transaction: writes `lanes`, and every booking an event in
        (after_seq, through_seq] touches, as `bookings.apply` folds it from the
        log (its opening event's fields with its latest ending's), and moves
        the marker to through_seq. Raises RebuildFailed, writing nothing, when
        an event of the range cannot be folded."""
        ...

    def finish_rebuild(self, owner: str, applied_seq: int) -> bool:
        """Marks the projections current at applied_seq if that is the log's head."""
        ...

    def save_manifest(
        self, manifest: Manifest, actor: str, created_at_us: int, outcome: str
    ) -> int: ...

    def update_manifest(self, manifest_id: int, outcome: str, elapsed_ms: int) -> None: ...


# Values ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    batch_events: int = 1000
    sample_events: int = 2000
    snapshot_keep: int = 2
    lease_seconds: float = 30.0
    # Processes that check events' contents during a rebuild of at least
    # parallel_min_events events (see storage/content_check.py); 0: none.
    check_processes: int = 0
    parallel_min_events: int = 50_000
    # Seqs per range of a replay (0: batch_events). Side by side on 2,000,001
    # events, ranges of 1,000 gave 80,913 and 82,911 events/s, of 5,000
    # 96,495 and 95,592, of 10,000 and 20,000 about the same.
    replay_range_events: int = 0
    # Accept the log's last event as the position to restore to, even when the
    # marker or a snapshot says the projections had gone further (events lost).
    accept_log_head: bool = False


@dataclasses.dataclass(frozen=True)
class Assessment:
    facts: LogFacts
    findings: tuple[str, ...]
    rebuilding_elsewhere: bool = False

    @property
    def consistent(self) -> bool:
        return not self.findings and not self.rebuilding_elsewhere


@dataclasses.dataclass(frozen=True)
class Route:
    """How one source rebuilds: from a snapshot (or from nothing) plus events."""

    source_id: str
    snapshot: SnapshotInfo | None
    # Breaks the plan knew of and the policy accepted: the rebuild goes on past them.
    tolerated_breaks: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Plan:
    manifest: Manifest
    routes: Mapping[str, Route]
    rate_events_per_second: float


@dataclasses.dataclass(frozen=True)
class Outcome:
    ready: bool
    manifest: Manifest | None = None
    detail: str = ""


class ChainBroken(Exception):
    def __init__(self, chain_break: ChainBreak) -> None:
        super().__init__(chain_break.describe())
        self.chain_break = chain_break


class RebuildFailed(Exception):
    pass


@dataclasses.dataclass
class _Walk:
    """What walking the chain over a range found."""

    breaks: list[ChainBreak] = dataclasses.field(default_factory=list)
    break_count: int = 0
    unsealed: int = 0
    # The walker's heads right after each requested position.
    heads_at: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)

    def note(self, found: ChainBreak) -> None:
        self.break_count += 1
        if len(self.breaks) < MAX_NAMED_BREAKS:
            self.breaks.append(found)

    def after(self, seq: int) -> list[ChainBreak]:
        return [found for found in self.breaks if found.seq > seq]


def _checked(walker: ChainWalker, link: ChainLink, altered_seqs: set[int]) -> ChainBreak | None:
    """What ChainWalker.check finds at the link's event, given the seqs whose
    content was found not to give their hash."""
    found = walker.check_link(*link)
    if found is None and link.seq in altered_seqs:
        return altered(link.seq, link.lane)
    return found


def take_range(walker: ChainWalker, walked: WalkedRange) -> list[ChainBreak]:
    """Ends the walk of a range with the walker's heads from before it: its
    lanes' leading events are checked here, then the walker goes on from the
    heads the range left. Returns what was found, here or in the range, in seq
    order: what `walker.check` over each of the range's events would have
    found (tests/recovery/test_parallel_rebuild.py compares)."""
    found: list[ChainBreak] = []
    altered_seqs = set(walked.altered)
    for link in walked.leading:
        broken = _checked(walker, link, altered_seqs)
        if broken is not None:
            found.append(broken)
    found += walked.breaks
    walker.heads.update(walked.heads)
    walker.unsealed += walked.unsealed
    walker.checked += walked.events - len(walked.leading)
    if walked.events:
        walker.last_seq = walked.last_seq
    return sorted(found, key=lambda broken: broken.seq)


def lanes_of(batch: Sequence[Event]) -> dict[str, LanePolicy]:
    """The lanes as the batch's lane_configured events leave them (the same
    fold as the live path: `policy_from_dict`)."""
    lanes: dict[str, LanePolicy] = {}
    for event in batch:
        if event.kind is EventKind.LANE_CONFIGURED:
            if event.policy is None:
                raise RebuildFailed(f"event {event.seq} configures a lane without a policy")
            lanes[event.lane] = policy_from_dict(event.policy, event.seq, event.occurred_at_us)
    return lanes


# The recovery service -------------------------------------------------------------


def _digest_of_lanes(view: ProjectionView, heads: Mapping[str, str] | None) -> ProjectionDigest:
    """A projection's digest with its position, the lanes' chain heads there
    (`heads`, or read from the log when None) and its lanes, its bookings to
    come: what a snapshot taken at that position gives, so that the digest
    `ledger rebuild` prints is the one `ledger snapshot` printed while the
    log stood where it stands."""
    position = view.position
    seq = position.last_seq if position else 0
    if heads is None:
        heads = view.chain_heads(seq)
    digest = ProjectionDigest(seq, {lane: head for lane, head in heads.items() if head})
    for policy in view.lanes():
        digest.add_lane(policy)
    return digest


class _Walks:
    """The ranges of a walk from `position` to `head`, of at most `size` seqs
    and ending at each of `cuts`, each walked by `checks` (WalkedRange) once
    submitted, in order."""

    def __init__(
        self,
        checks: ContentChecks,
        position: int,
        head: int,
        size: int,
        cuts: Sequence[int] = (),
    ) -> None:
        self._checks = checks
        self._head = head
        self._size = size
        self._cuts = collections.deque(sorted(cut for cut in cuts if position < cut < head))
        self.read_to = position
        self.pending: collections.deque[tuple[int, int, Future[WalkedRange]]] = collections.deque()

    def fill(self, ahead: int) -> None:
        """Submits ranges until `ahead` are pending or the head is reached."""
        while self.read_to < self._head and len(self.pending) < ahead:
            after, through = self.read_to, min(self.read_to + self._size, self._head)
            while self._cuts and self._cuts[0] <= after:
                self._cuts.popleft()
            if self._cuts and self._cuts[0] < through:
                through = self._cuts.popleft()
            self.pending.append((after, through, self._checks.submit_walk(after, through)))
            self.read_to = through


class Recovery:
    def __init__(
        self,
        store: RecoveryStore,
        wall_clock: Clock,
        settings: RecoverySettings,
        owner: str,
    ) -> None:
        self._store = store
        self._wall = wall_clock
        self.settings = settings
        self.owner = owner

    @property
    def store(self) -> RecoveryStore:
        return self._store

    # Assessment -------------------------------------------------------------

    def assess(self) -> Assessment:
        """A cheap look: the marker, counts, each booking against its latest
        event, and the chain from the newest snapshot's heads to the log's end
        (bounded by the snapshot interval when snapshots are on)."""
        facts = self._store.facts()
        position = facts.position
        if (
            position is not None
            and position.state == STATE_REBUILDING
            and position.owner != self.owner
            and self._wall.now_us() - position.updated_at_us < self._lease_us()
        ):
            found = f"a rebuild by {position.owner} is in progress (event {position.last_seq})"
            return Assessment(facts, (found,), rebuilding_elsewhere=True)
        findings = list(projection_findings(facts))
        snapshots = self._store.snapshots()
        for snapshot in snapshots:
            if snapshot.position_seq > facts.head_seq:
                findings.append(
                    f"snapshot {snapshot.snapshot_id} is at event {snapshot.position_seq}, "
                    f"beyond the log's last event {facts.head_seq}: events are missing"
                )
        anchor = next((s for s in snapshots if s.position_seq <= facts.head_seq), None)
        walk = self._walk(anchor, ())
        if walk.break_count:
            findings.append(
                f"the hash chain is broken at {walk.break_count} event(s); first: "
                f"{walk.breaks[0].describe()}"
            )
        return Assessment(facts, tuple(findings))

    def _lease_us(self) -> int:
        return int(self.settings.lease_seconds * MICROS_PER_SECOND)

    def _walk(
        self,
        anchor: SnapshotInfo | None,
        positions: Sequence[int],
        through_seq: int | None = None,
    ) -> _Walk:
        """Checks every link and content after `anchor` (or from genesis) up to
        `through_seq` (or the log's last event when the walk starts), in ranges
        walked by the checking processes as a rebuild's are, cut at each of
        `positions` to note the heads there."""
        walk = _Walk()
        walker = ChainWalker(anchor.chain_heads if anchor else None)
        after = anchor.position_seq if anchor else 0
        head = self._store.last_seq() if through_seq is None else through_seq
        pending = sorted(position for position in positions if position >= after)
        while pending and pending[0] == after:
            walk.heads_at[pending.pop(0)] = dict(walker.heads)
        with self._content_checks(after) as checks:
            walks = _Walks(checks, after, head, self._replay_range(), cuts=pending)
            ahead = self._ranges_ahead()
            while True:
                walks.fill(ahead)
                if not walks.pending:
                    break
                _, through, walked = walks.pending.popleft()
                for found in take_range(walker, walked.result()):
                    walk.note(found)
                while pending and pending[0] <= through:
                    walk.heads_at[pending.pop(0)] = dict(walker.heads)
        for position in pending:
            walk.heads_at[position] = dict(walker.heads)
        walk.unsealed = walker.unsealed
        return walk

    def _replay_range(self) -> int:
        return max(1, self.settings.replay_range_events or self.settings.batch_events)

    def _ranges_ahead(self) -> int:
        """Ranges submitted to the checking processes ahead of the one taken."""
        return max(2, 2 * self.settings.check_processes)

    # Planning ----------------------------------------------------------------

    def plan(
        self,
        assessment: Assessment,
        policy: RecoveryPolicy,
        known_breaks: Sequence[ChainBreak] = (),
    ) -> Plan:
        facts = assessment.facts
        head = facts.head_seq
        snapshots = list(self._store.snapshots())
        required = head
        if facts.position is not None and facts.position.state == STATE_CURRENT:
            required = max(required, facts.position.last_seq)
        for snapshot in snapshots:
            required = max(required, snapshot.position_seq)
        lost = required > head and not self.settings.accept_log_head
        usable = [s for s in snapshots if s.position_seq <= head][: self.settings.snapshot_keep]
        digests = {s.snapshot_id: self.check_snapshot(s) for s in usable}
        valid = [s for s in usable if not digests[s.snapshot_id]]
        anchor = valid[-1] if valid else None
        walk = self._walk(anchor, [s.position_seq for s in usable])
        for found in known_breaks:
            walk.note(found)
        rate = self.measure_rate()
        findings = list(assessment.findings)
        if lost:
            findings.append(
                f"the projections or a snapshot reached event {required} but the log ends at "
                f"{head}: no source holds the events in between"
            )
        while True:
            sources: list[Source] = []
            routes: dict[str, Route] = {}
            log_source, log_route = self._log_source(facts, anchor, walk, rate, lost)
            sources.append(log_source)
            routes[log_source.source_id] = log_route
            for snapshot in usable:
                source, route = self._snapshot_source(
                    snapshot, digests[snapshot.snapshot_id], walk, rate, lost
                )
                sources.append(source)
                routes[source.source_id] = route
            manifest = planner.plan(sources, policy, findings)
            if anchor is None or FULL_LOG_SOURCE not in manifest.chosen:
                return Plan(manifest, routes, rate)
            # The whole log would be replayed, and its links before the anchor were
            # taken on the snapshot's word: check them now, before anything is
            # written, so that a broken one refuses the plan instead of stopping
            # a rebuild half-way.
            prefix = self._walk(None, (), through_seq=anchor.position_seq)
            for found in prefix.breaks:
                walk.note(found)
            walk.unsealed += prefix.unsealed
            anchor = None

    def _log_source(
        self, facts: LogFacts, anchor: SnapshotInfo | None, walk: _Walk, rate: float, lost: bool
    ) -> tuple[Source, Route]:
        risk = planner.RISK_VERIFIED
        detail = f"replay all {facts.event_count} events at {rate:.0f} events/s"
        if walk.break_count:
            risk = planner.RISK_UNVERIFIABLE
            detail += f"; {walk.break_count} broken link(s), first {walk.breaks[0].describe()}"
        elif anchor is not None and not anchor.chain_verified:
            risk = planner.RISK_UNVERIFIABLE
            detail += f"; links before snapshot {anchor.snapshot_id} did not check out"
        elif walk.unsealed:
            risk = planner.RISK_UNSEALED
            detail += f"; {walk.unsealed} events predate the hash chain"
        source = Source(
            FULL_LOG_SOURCE,
            planner.replay_cost_seconds(facts.event_count, rate),
            risk,
            detail,
            possible=not lost,
        )
        tolerated = frozenset(found.seq for found in walk.breaks)
        return source, Route(FULL_LOG_SOURCE, None, tolerated)

    def _snapshot_source(
        self, snapshot: SnapshotInfo, problem: str, walk: _Walk, rate: float, lost: bool
    ) -> tuple[Source, Route]:
        tail = self._store.count_events_after(snapshot.position_seq)
        source_id = f"snapshot-{snapshot.snapshot_id}"
        detail = (
            f"snapshot {snapshot.snapshot_id} at event {snapshot.position_seq} "
            f"({snapshot.rows} rows) + a tail of {tail} events at {rate:.0f}/s"
        )
        risk = planner.RISK_VERIFIED
        breaks = walk.after(snapshot.position_seq)
        heads = walk.heads_at.get(snapshot.position_seq)
        if problem:
            risk, detail = planner.RISK_UNVERIFIABLE, f"{detail}; {problem}"
        elif snapshot.format_version != FORMAT_VERSION:
            risk = planner.RISK_STALE_FORMAT
            detail += f"; stale: format {snapshot.format_version}, not {FORMAT_VERSION}"
        elif breaks:
            risk = planner.RISK_UNVERIFIABLE
            detail += f"; the tail has broken links, first {breaks[0].describe()}"
        elif heads is not None and heads != dict(snapshot.chain_heads):
            risk = planner.RISK_UNVERIFIABLE
            detail += "; its chain heads are not the log's at its position"
        source = Source(
            source_id,
            planner.replay_cost_seconds(snapshot.rows + tail, rate),
            risk,
            detail,
            possible=not lost,
        )
        return source, Route(source_id, snapshot, frozenset(found.seq for found in breaks))

    def check_snapshot(self, snapshot: SnapshotInfo) -> str:
        """ "" when the snapshot's rows still give its digest, else what is wrong."""
        digest = ProjectionDigest(snapshot.position_seq, snapshot.chain_heads)
        try:
            for chunk in self._store.snapshot_chunks(snapshot.snapshot_id):
                chunk.add_to(digest)
        except (ValueError, KeyError, TypeError) as error:
            return f"unreadable: {type(error).__name__}"
        if (digest.lanes, digest.bookings) != (snapshot.lanes_count, snapshot.bookings_count):
            return (
                f"holds {digest.lanes} lanes and {digest.bookings} bookings, not the "
                f"{snapshot.lanes_count} and {snapshot.bookings_count} recorded"
            )
        if digest.hexdigest() != snapshot.digest:
            return "its rows do not give its recorded digest: changed or damaged"
        return ""

    def measure_rate(self) -> float:
        """Events per second of the rebuild pipeline (read, check the chain,
        fold and write), measured on a sample of the log's first events folded
        in a transaction that is rolled back. The rebuild overlaps the fold
        with the next batch's check; the sample does not, so it errs slow."""
        started = time.perf_counter()
        sample = self._store.events_after(0, self.settings.sample_events)
        if not sample:
            return 1_000_000.0
        walker = ChainWalker()
        for event in sample:
            walker.check(event)
        self._store.fold_events(
            self.owner,
            list(lanes_of(sample).values()),
            0,
            sample[-1].seq,
            self._wall.now_us(),
            dry_run=True,
        )
        elapsed = max(time.perf_counter() - started, 1e-3)
        return len(sample) / elapsed

    # Rebuilding ----------------------------------------------------------------

    def rebuild(self, route: Route, progress: ProgressFn = no_progress) -> str:
        """Rebuilds the projections along `route` and marks them current.
        Returns the digest of what was built."""
        digest = self.rebuild_uncommitted(route, progress)
        if not self.finish():
            raise RebuildFailed("the log grew during the rebuild; run it again")
        return digest

    def finish(self) -> bool:
        position = self._store.position()
        return self._store.finish_rebuild(self.owner, position.last_seq if position else -1)

    def rebuild_uncommitted(self, route: Route, progress: ProgressFn = no_progress) -> str:
        """Rebuilds, leaving the marker "rebuilding" (no move is taken meanwhile);
        returns the digest of the projections built, for a cross-check."""
        started = time.perf_counter()
        if not self._store.claim_rebuild(self.owner, self._wall.now_us(), self._lease_us()):
            raise RebuildClaimLost("another process is rebuilding the projections")
        snapshot = route.snapshot
        position = snapshot.position_seq if snapshot else 0
        total = self._store.count_events_after(position)
        with self._content_checks(position, total) as checks:
            walks = _Walks(checks, position, self._store.last_seq(), self._replay_range())
            # The log's ranges need no projection: the processes walk the first
            # ones while the database deletes the old projections (1.4 s for
            # 1,000,000 bookings) and restores a snapshot's.
            walks.fill(EARLY_WALKS)
            self._store.reset_projections(self.owner, position, self._wall.now_us())
            if snapshot is not None:
                self._restore(snapshot, progress, started)
            walker = ChainWalker(snapshot.chain_heads if snapshot else None)
            self._replay(route, walker, walks, total, progress, started)
            return self._digest_in_ranges(checks, walker.heads)

    def _digest_in_ranges(self, checks: ContentChecks, heads: Mapping[str, str]) -> str:
        """projection_digest, the bookings' lines made by `checks` in ranges of
        DIGEST_RANGE_BOOKINGS keys: in the checking processes, when there are
        any, while this thread hashes the ranges in order. Only while nothing
        writes the projections (a rebuild's marker keeps moves out): the
        ranges are read in transactions of their own."""
        ahead = self._ranges_ahead()
        pending: collections.deque[Future[tuple[int, bytes]]] = collections.deque()
        with self._store.view() as view:
            digest = _digest_of_lanes(view, heads)
            after: BookingKey | None = None
            while True:
                through = view.booking_key_after(after, DIGEST_RANGE_BOOKINGS)
                pending.append(checks.submit_booking_lines(after, through))
                if len(pending) >= ahead:
                    digest.add_booking_lines(*pending.popleft().result())
                if through is None:
                    break
                after = through
        while pending:
            digest.add_booking_lines(*pending.popleft().result())
        return digest.hexdigest()

    def _content_checks(
        self, after_seq: int, events: int | None = None
    ) -> contextlib.AbstractContextManager[ContentChecks]:
        """Checks of the contents of the events after `after_seq` (`events` of
        them, counted when not given): in other processes when they are many."""
        processes = self.settings.check_processes
        if processes > 0:
            if events is None:
                events = self._store.count_events_after(after_seq)
            if events < self.settings.parallel_min_events:
                processes = 0
        return self._store.content_checks(processes)

    def _replay(
        self,
        route: Route,
        walker: ChainWalker,
        walks: _Walks,
        total: int,
        progress: ProgressFn,
        started: float,
    ) -> None:
        """Checks and folds the log as a pipeline over ranges of
        `replay_range_events` seqs: other processes walk the next few ranges on
        their own (`walks`, WalkedRange), this thread ends the walk of the
        oldest with the heads from before it (`take_range`), and the database
        folds it in a thread of its own (one statement, without the GIL) while
        the next is taken. A range is folded only after every event in it
        checked out, and in log order."""
        ahead = self._ranges_ahead()
        pending = walks.pending
        done = 0
        with concurrent.futures.ThreadPoolExecutor(1, "ledger-rebuild-fold") as folder:
            folding: Future[None] | None = None
            while True:
                walks.fill(ahead)
                if not pending:
                    break
                after, through, walked = pending.popleft()
                taken = walked.result()
                for broken in take_range(walker, taken):
                    if broken.seq not in route.tolerated_breaks:
                        raise ChainBroken(broken)
                lanes = list(lanes_of(taken.lane_events).values())
                if folding is not None:
                    folding.result()
                    progress("replay", done, max(total, done), time.perf_counter() - started)
                folding = folder.submit(
                    self._store.fold_events, self.owner, lanes, after, through, self._wall.now_us()
                )
                done += taken.events
            if folding is not None:
                folding.result()
                progress("replay", done, max(total, done), time.perf_counter() - started)

    def _restore(
        self,
        snapshot: SnapshotInfo,
        progress: ProgressFn,
        started: float,
    ) -> None:
        digest = ProjectionDigest(snapshot.position_seq, snapshot.chain_heads)
        done = 0
        for chunk in self._store.snapshot_chunks(snapshot.snapshot_id):
            chunk.add_to(digest)
            self._store.restore_chunk(self.owner, chunk, self._wall.now_us())
            done += chunk.rows
            progress("restore", done, snapshot.rows, time.perf_counter() - started)
        if digest.hexdigest() != snapshot.digest:
            raise RebuildFailed(f"snapshot {snapshot.snapshot_id} changed while it was restored")

    def projection_digest(self) -> str:
        """The digest of the projections as they stand (for cross-checks)."""
        with self._store.view() as view:
            digest = _digest_of_lanes(view, None)
            for text in view.booking_texts():
                digest.add_booking_text(text)
        return digest.hexdigest()

    # Snapshots ---------------------------------------------------------------

    def snapshot_due(self, every_events: int) -> bool:
        """Whether the server should snapshot now: `every_events` events after
        the newest snapshot, or more when the projections are large.

        A snapshot copies every lane and booking. With a million bookings, one
        every 10,000 events would have the server copying rows much of the
        time, so the interval grows with the newest snapshot's size: each event
        pays for at most SNAPSHOT_ROWS_PER_EVENT copied rows. The tail a
        recovery replays after the snapshot grows with it, in proportion to
        the rows it restores."""
        if every_events <= 0:
            return False
        position = self._store.position()
        if position is None or position.state != STATE_CURRENT:
            return False
        newest = next(iter(self._store.snapshots()), None)
        since = newest.position_seq if newest else 0
        interval = every_events
        if newest is not None:
            interval = max(interval, newest.rows // SNAPSHOT_ROWS_PER_EVENT)
        return position.last_seq - since >= interval

    def take_snapshot(self) -> SnapshotInfo | None:
        """Snapshots the projections if they are consistent with the log, then
        keeps the newest `snapshot_keep`. None (and a warning) when they are not."""
        previous = next(iter(self._store.snapshots()), None)
        with self._store.view() as view:
            problems = projection_findings(view.facts)
            if problems:
                log.warning("no snapshot: %s", "; ".join(problems))
                return None
            assert view.facts.position is not None
            position = view.facts.position.last_seq
            heads = view.chain_heads(position)
            taken_at_us = self._wall.now_us()
            snapshot_id = self._store.begin_snapshot(position, heads, taken_at_us)
            digest = ProjectionDigest(position, heads)
            self._write_chunks(snapshot_id, view, digest)
        if previous is not None and previous.position_seq > position:
            previous = None
        walk = self._walk(previous, [position])
        verified = (
            (previous is None or previous.chain_verified)
            and walk.break_count == 0
            and walk.heads_at.get(position) == dict(heads)
        )
        self._store.complete_snapshot(snapshot_id, digest, verified)
        pruned_before = taken_at_us - self._lease_us()
        self._store.prune_snapshots(self.settings.snapshot_keep, pruned_before)
        info = SnapshotInfo(
            snapshot_id,
            position,
            taken_at_us,
            FORMAT_VERSION,
            digest.lanes,
            digest.bookings,
            digest.hexdigest(),
            heads,
            verified,
        )
        log.info(
            "snapshot %d at event %d: %d lanes, %d bookings, digest %s%s",
            snapshot_id,
            position,
            digest.lanes,
            digest.bookings,
            info.digest[:16],
            "" if verified else " (the chain before it did NOT check out)",
        )
        return info

    def _write_chunks(
        self, snapshot_id: int, view: ProjectionView, digest: ProjectionDigest
    ) -> None:
        size = self.settings.batch_events
        chunk_no = 0
        lanes: list[LanePolicy] = []
        for policy in view.lanes():
            digest.add_lane(policy)
            lanes.append(policy)
            if len(lanes) == size:
                self._store.write_snapshot_chunk(snapshot_id, chunk_no, SnapshotChunk(lanes=lanes))
                chunk_no, lanes = chunk_no + 1, []
        if lanes:
            self._store.write_snapshot_chunk(snapshot_id, chunk_no, SnapshotChunk(lanes=lanes))
            chunk_no += 1
        for chunk in view.booking_chunks(size):
            chunk.add_to(digest)
            self._store.write_snapshot_chunk(snapshot_id, chunk_no, chunk)
            chunk_no += 1

    # The whole of it -------------------------------------------------------------

    def recover(
        self, policy: RecoveryPolicy, actor: str, progress: ProgressFn = no_progress
    ) -> Outcome:
        """Assess; if needed plan, record the manifest, and rebuild if admissible."""
        assessment = self.assess()
        if assessment.consistent:
            return Outcome(True, detail="the projections are consistent with the log")
        if assessment.rebuilding_elsewhere:
            return Outcome(False, detail=assessment.findings[0])
        log.warning("projections need recovery: %s", "; ".join(assessment.findings))
        known: list[ChainBreak] = []
        # A second plan only when the rebuild met a broken link the first did not know.
        for _attempt in range(2):
            plan = self.plan(assessment, policy, known)
            manifest = plan.manifest
            outcome = "planned" if manifest.admissible else "refused"
            manifest_id = self._store.save_manifest(manifest, actor, self._wall.now_us(), outcome)
            (log.info if manifest.admissible else log.error)(
                "recovery manifest %d: %s", manifest_id, manifest.to_json()
            )
            if not manifest.admissible:
                return Outcome(False, manifest, manifest.directive)
            started = time.perf_counter()
            try:
                self._carry_out(plan, progress)
            except ChainBroken as error:
                self._record(manifest_id, "failed", started)
                log.error("rebuild stopped: %s; planning again", error)
                known.append(error.chain_break)
                continue
            except (RebuildFailed, RebuildClaimLost) as error:
                self._record(manifest_id, "failed", started)
                log.error("rebuild failed: %s", error)
                return Outcome(False, manifest, str(error))
            self._record(manifest_id, "rebuilt", started)
            self._snapshot_after_rebuild()
            return Outcome(True, manifest, manifest.directive)
        return Outcome(False, None, "the rebuild kept meeting broken links")

    def _carry_out(self, plan: Plan, progress: ProgressFn) -> None:
        digests: list[tuple[str, str]] = []
        for source_id in plan.manifest.chosen:
            built = self.rebuild_uncommitted(plan.routes[source_id], progress)
            if digests and built != digests[0][1]:
                raise RebuildFailed(
                    f"{source_id} rebuilt other projections than {digests[0][0]} "
                    f"({built[:16]} != {digests[0][1][:16]}): the sources disagree"
                )
            digests.append((source_id, built))
        if not self.finish():
            raise RebuildFailed("the log grew during the rebuild; run it again")

    def _record(self, manifest_id: int, outcome: str, started: float) -> None:
        elapsed_ms = int((time.perf_counter() - started) * 1000)
        self._store.update_manifest(manifest_id, outcome, elapsed_ms)

    def _snapshot_after_rebuild(self) -> None:
        # The next assessment then walks the chain from here, and the next
        # recovery has a fresh, verified snapshot to start from.
        try:
            newest = next(iter(self._store.snapshots()), None)
            position = self._store.position()
            if (
                newest is not None
                and position is not None
                and newest.position_seq == position.last_seq
                and not self.check_snapshot(newest)
            ):
                return  # the snapshot it was rebuilt from is already here
            self.take_snapshot()
        except StoreUnavailable:
            log.warning("no snapshot after the rebuild: database unavailable")


def projection_findings(facts: LogFacts) -> list[str]:
    """What the cheap facts say is wrong with the projections (empty: nothing)."""
    findings: list[str] = []
    position = facts.position
    if position is None:
        findings.append("the projections' position marker is missing")
    elif position.state == STATE_REBUILDING:
        findings.append(
            f"a rebuild by {position.owner or 'unknown'} stopped at event {position.last_seq}"
        )
    elif position.last_seq < facts.head_seq:
        findings.append(
            f"the projections are behind the log: applied through event {position.last_seq}, "
            f"the log ends at {facts.head_seq}"
        )
    elif position.last_seq > facts.head_seq:
        findings.append(
            f"the projections are ahead of the log: applied through event {position.last_seq}, "
            f"the log ends at {facts.head_seq}"
        )
    if facts.bookings != facts.answer_events:
        findings.append(
            f"{facts.bookings} bookings are projected but the log answers {facts.answer_events} "
            "reservations"
        )
    if facts.lanes != facts.configured_lanes:
        findings.append(
            f"{facts.lanes} lanes are projected but the log configures {facts.configured_lanes}"
        )
    if facts.stale_bookings:
        findings.append(
            f"{facts.stale_bookings} bookings differ from their latest event in the log"
        )
    return findings


# The server's side ------------------------------------------------------------------


class RecoveryGuard:
    """Decides whether the server may take moves, and keeps it so.

    READY: serving; every `consistency_check_seconds` a cheap assessment runs,
    and when it fails, a recovery. REFUSED: the planner refused; only the cheap
    assessment runs, every `check_interval_seconds`, and the server serves again
    as soon as it passes (after `ledger recover`, say). PENDING: not assessed
    yet (the database was down), a rebuild failed, or another process is
    rebuilding; the whole recovery runs again every `check_interval_seconds`.
    """

    READY = "ready"
    REFUSED = "refused"
    PENDING = "pending"

    def __init__(
        self,
        recovery: Recovery,
        policy: RecoveryPolicy,
        *,
        actor: str,
        check_interval_seconds: float,
        consistency_check_seconds: float,
        snapshot_every_events: int,
        on_change: Callable[[bool], None] = lambda ready: None,
    ) -> None:
        self.recovery = recovery
        self.policy = policy
        self._actor = actor
        self._check_interval = check_interval_seconds
        self._consistency_interval = consistency_check_seconds
        self._snapshot_every = snapshot_every_events
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = self.PENDING
        self._last_check = time.monotonic()
        self._last_consistency = time.monotonic()
        self.manifest: Manifest | None = None

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def is_ready(self) -> bool:
        return self.state == self.READY

    def _set(self, state: str) -> None:
        with self._lock:
            changed = state != self._state
            self._state = state
        if changed:
            log.log(
                logging.INFO if state == self.READY else logging.WARNING,
                "projections %s: %s",
                state,
                "taking moves" if state == self.READY else "moves are refused (RECOVERY_REQUIRED)",
            )
            self._on_change(state == self.READY)

    def required(self) -> None:
        """A move found the projections not current (the marker said so)."""
        with self._lock:
            if self._state != self.READY:
                return
        self._set(self.PENDING)

    def start(self) -> None:
        """The start-up recovery: runs before the server takes a move."""
        self._recover()

    def _recover(self) -> None:
        self._last_check = time.monotonic()
        try:
            outcome = self.recovery.recover(self.policy, self._actor)
        except StoreUnavailable:
            log.warning("recovery check: database unavailable; will retry")
            self._set(self.PENDING)
            return
        except Exception:
            # Closed, not crashed: the server stays up, refusing moves, and retries.
            log.exception("recovery failed; moves stay refused, will retry")
            self._set(self.PENDING)
            return
        self.manifest = outcome.manifest or self.manifest
        if outcome.ready:
            self._set(self.READY)
        elif outcome.manifest is not None and not outcome.manifest.admissible:
            self._set(self.REFUSED)
        else:
            self._set(self.PENDING)

    def tick(self) -> None:
        """Called by the maintenance thread at every turn."""
        now = time.monotonic()
        try:
            state = self.state
            if state == self.PENDING and now - self._last_check >= self._check_interval:
                self._recover()
            elif state == self.REFUSED and now - self._last_check >= self._check_interval:
                self._last_check = now
                if self.recovery.assess().consistent:
                    log.info("the projections are consistent with the log again")
                    self._set(self.READY)
            elif state == self.READY:
                self._tick_ready(now)
        except StoreUnavailable:
            log.warning("recovery check: database unavailable; will retry")
        except Exception:
            log.exception("recovery check failed; will retry")

    def _tick_ready(self, now: float) -> None:
        if self._consistency_interval > 0 and (
            now - self._last_consistency >= self._consistency_interval
        ):
            self._last_consistency = now
            assessment = self.recovery.assess()
            if not assessment.consistent:
                log.error("projections inconsistent: %s", "; ".join(assessment.findings))
                self._set(self.PENDING)
                self._recover()
                return
        if now - self._last_check >= self._check_interval:
            self._last_check = now
            if self.recovery.snapshot_due(self._snapshot_every):
                self.recovery.take_snapshot()
