"""Assess, plan, rebuild and snapshot the projections; `RecoveryGuard`, the
server's side of it (docs/recovery.md)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from ledger_service.domain.chain import ChainBreak, ChainWalker, altered, event_hash
from ledger_service.domain.clock import MICROS_PER_SECOND, Clock
from ledger_service.domain.counts import counted
from ledger_service.domain.errors import StoreDamaged, StoreUnavailable
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.policies import LanePolicy, policy_from_dict
from ledger_service.recovery import plan as planner
from ledger_service.recovery.plan import Manifest, RecoveryPolicy, Source
from ledger_service.recovery.snapshots import (
    FORMAT_VERSION,
    ChainPoint,
    ProjectionDigest,
    SnapshotInfo,
)
from ledger_service.recovery.store import (
    MANIFEST_REBUILT,
    EventRefused,
    LogFacts,
    MarkerMoved,
    Position,
    RebuildClaimLost,
    RebuildFailed,
    SqlRecoveryStore,
    marker_key,
)
from ledger_service.recovery.walk import Helpers, Walk, ranges
from ledger_service.storage import migrate, translate
from ledger_service.storage.chaining import STATE_CURRENT, STATE_REBUILDING

log = logging.getLogger("ledger.recovery")

FULL_LOG_SOURCE = "log"
# The differing bookings whose latest event an assessment checks for alteration.
MAX_ALTERED_CHECKED = 100
# The server's snapshots come at most this many copied rows per event apart
# (see Recovery.snapshot_due).
SNAPSHOT_ROWS_PER_EVENT = 10

# (phase, done, total, elapsed_seconds)
ProgressFn = Callable[[str, int, int, float], None]


def no_progress(phase: str, done: int, total: int, elapsed_seconds: float) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    batch_events: int = 1000
    sample_events: int = 2000
    snapshot_keep: int = 2
    lease_seconds: float = 30.0
    # A walk or rebuild of at least parallel_min_events events has its events'
    # contents checked by this many helper processes (walk.Helpers); 0: none.
    check_processes: int = 0
    parallel_min_events: int = 50_000
    # Seqs per range of a replay (0: batch_events; docs/benchmarks.md).
    replay_range_events: int = 0
    # Accept the log's last event as the position to restore to, even when the
    # marker or a snapshot says the projections had gone further (events lost).
    accept_log_head: bool = False


@dataclasses.dataclass(frozen=True)
class Assessment:
    facts: LogFacts
    findings: tuple[str, ...]
    rebuilding_elsewhere: bool = False
    # Latest events of differing bookings that no longer hash to their hash:
    # altered after append, wherever the walk from the verified point began.
    altered: tuple[ChainBreak, ...] = ()

    @property
    def consistent(self) -> bool:
        return not self.findings and not self.rebuilding_elsewhere


@dataclasses.dataclass(frozen=True)
class Route:
    """How one source rebuilds: from a snapshot (or from nothing) plus events."""

    source_id: str
    snapshot: SnapshotInfo | None
    # Breaks the plan knew of and the policy accepted: the rebuild goes on past them.
    tolerated: tuple[ChainBreak, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    manifest: Manifest
    routes: Mapping[str, Route]


@dataclasses.dataclass(frozen=True)
class Outcome:
    ready: bool
    manifest: Manifest | None = None
    detail: str = ""
    # The owner of another process's rebuild that holds the marker, which
    # this one waits for ("" when none).
    waiting_for: str = ""


class ChainBroken(Exception):
    def __init__(self, chain_break: ChainBreak) -> None:
        super().__init__(chain_break.describe())
        self.chain_break = chain_break


def lanes_of(batch: Iterable[Event]) -> list[LanePolicy]:
    """The lanes as the batch's lane_configured events leave them (the same
    fold as the live path: `policy_from_dict`)."""
    lanes: dict[str, LanePolicy] = {}
    for event in batch:
        if event.kind is EventKind.LANE_CONFIGURED:
            if event.policy is None:
                raise RebuildFailed(f"event {event.seq} configures a lane without a policy")
            lanes[event.lane] = policy_from_dict(event.policy, event.seq, event.occurred_at_us)
    return list(lanes.values())


class Recovery:
    def __init__(
        self, store: SqlRecoveryStore, wall_clock: Clock, settings: RecoverySettings, owner: str
    ) -> None:
        self.store = store
        self._wall = wall_clock
        self.settings = settings
        self.owner = owner

    # Assessment -------------------------------------------------------------

    def assess(self) -> Assessment:
        """The marker, counts, each booking against its latest event, and the
        chain from the last verified point to the log's end (the new point)."""
        # The snapshots before the facts: read after, a replica's new snapshot
        # could be past the log's end seen (the log grown, not events missing).
        snapshots = self.store.snapshots()
        facts = self.store.facts()
        position = facts.position
        now_us, lease_us = self._wall.now_us(), self._lease_us()
        if position is not None and position.leased_to_another(self.owner, now_us, lease_us):
            found = f"a rebuild by {position.owner} is in progress (event {position.last_seq})"
            return Assessment(facts, (found,), rebuilding_elsewhere=True)
        findings = list(projection_findings(facts))
        altered = self._altered_latest_events(facts)
        findings.extend(f"broken link: {found.describe()}" for found in altered)
        for snapshot in snapshots:
            if snapshot.position_seq > facts.head_seq:
                findings.append(
                    f"snapshot {snapshot.snapshot_id} is at event {snapshot.position_seq}, "
                    f"beyond the log's last event {facts.head_seq}: events are missing"
                )
        final = self.store.final_seq()
        anchor, walk = self._walk_from_trusted(snapshots, facts.head_seq, final, None)
        if walk.break_count:
            findings.append(
                f"the hash chain is broken at {counted(walk.break_count, 'event')}; first: "
                f"{walk.breaks[0].describe()}"
            )
        elif _verified_from(anchor) and final > (anchor.position_seq if anchor else 0):
            # Every link up to `final` now checked out: the next walk starts there.
            self._save_verified_point(ChainPoint(final, walk.heads_at[final]))
        return Assessment(facts, tuple(findings), altered=altered)

    def _save_verified_point(self, point: ChainPoint) -> None:
        """Moves the verified point forward to `point`, whose links all checked out."""
        try:
            self.store.save_checkpoint(point, self._wall.now_us())
        except StoreUnavailable:  # only a shortcut: a read-only file must not fail the look
            log.warning("the verified point of the chain was not saved: database unavailable")

    def _altered_latest_events(self, facts: LogFacts) -> tuple[ChainBreak, ...]:
        """Latest events of differing bookings altered after append: no rebuild
        from a snapshot would make those bookings agree with the log."""
        if not facts.stale_bookings:
            return ()
        return tuple(
            altered(event.seq, event.lane)
            for event in self.store.stale_latest_events(MAX_ALTERED_CHECKED)
            if event.hash and event_hash(event.previous_hash, event) != event.hash
        )

    def _walk_from_trusted(
        self,
        snapshots: Sequence[SnapshotInfo],
        head_seq: int,
        position: int,
        through_seq: int | None,
    ) -> tuple[SnapshotInfo | ChainPoint | None, Walk]:
        """`_walk` from the newest of the last verified point and the snapshots
        within the log, noting the heads at `position`. A snapshot's heads are
        trusted until the walk breaks; then its digest is checked, and a
        snapshot that fails it is passed over for the next start."""
        checkpoint = self.store.checkpoint()
        points: list[SnapshotInfo | ChainPoint] = [
            point
            for point in (*snapshots, checkpoint)
            if point is not None and point.position_seq <= head_seq
        ]
        while True:
            # A verified point before a snapshot at the same event: it needs no trust.
            anchor = max(
                points, key=lambda p: (p.position_seq, isinstance(p, ChainPoint)), default=None
            )
            walk = self._walk(anchor, (position,), through_seq)
            if not walk.break_count or not isinstance(anchor, SnapshotInfo):
                return anchor, walk
            problem = self.check_snapshot(anchor)
            if not problem:
                return anchor, walk
            log.warning("snapshot %d is not walked from: %s", anchor.snapshot_id, problem)
            points = [point for point in points if point is not anchor]

    def _lease_us(self) -> int:
        return int(self.settings.lease_seconds * MICROS_PER_SECOND)

    def _walk(
        self,
        anchor: SnapshotInfo | ChainPoint | None,
        positions: Sequence[int],
        through_seq: int | None = None,
    ) -> Walk:
        """Checks every event after `anchor` through `through_seq` (default: the
        log's end), noting the heads at each of `positions`."""
        walk = Walk()
        heads = dict(anchor.chain_heads) if anchor else {}
        after = anchor.position_seq if anchor else 0
        head = self.store.last_seq() if through_seq is None else through_seq
        pending = sorted(position for position in positions if position >= after)
        ends = ranges(after, head, self._replay_range(), pending)
        while pending and pending[0] == after:
            walk.heads_at[pending.pop(0)] = dict(heads)
        with Helpers(self.store, self._processes(after)) as helpers:
            for taken in helpers.walk(heads, after, ends):
                for found in taken.breaks:
                    walk.note(found)
                walk.unsealed += taken.unsealed
                heads = dict(taken.heads)
                while pending and pending[0] <= taken.through_seq:
                    walk.heads_at[pending.pop(0)] = dict(heads)
        for position in pending:
            walk.heads_at[position] = dict(heads)
        return walk

    def _processes(self, after_seq: int) -> int:
        """Helper processes for the events after `after_seq` (starting them costs a second)."""
        events = self.store.count_events_after(after_seq)
        return self.settings.check_processes if events >= self.settings.parallel_min_events else 0

    def _replay_range(self) -> int:
        return max(1, self.settings.replay_range_events or self.settings.batch_events)

    # Planning ----------------------------------------------------------------

    def plan(
        self,
        assessment: Assessment,
        policy: RecoveryPolicy,
        known_breaks: Sequence[ChainBreak] = (),
        known_refusals: Mapping[int, EventRefused] | None = None,
    ) -> Plan:
        """`known_breaks`, `known_refusals`: what a rebuild of an earlier plan
        stopped at (refusals by the seq its source's replay starts after)."""
        facts = assessment.facts
        snapshots = list(self.store.snapshots())
        # The log's end read after the snapshots, not the assessment's: other
        # replicas may have appended and snapshotted since (see assess).
        head = max(facts.head_seq, self.store.last_seq())
        missing = self._missing_events(facts, snapshots, head)
        findings = [*assessment.findings, *([missing] if missing else [])]
        usable = [s for s in snapshots if s.position_seq <= head][: self.settings.snapshot_keep]
        digests = {s.snapshot_id: self.check_snapshot(s) for s in usable}
        valid = [s for s in usable if not digests[s.snapshot_id]]
        anchor = valid[-1] if valid else None
        walk = self._walk(anchor, [s.position_seq for s in usable])
        for found in (*assessment.altered, *known_breaks):
            if found not in walk.breaks:
                walk.note(found)
        now_us = self._wall.now_us()
        grounds = _Grounds(
            walk,
            bool(missing),
            lambda after_seq: self.store.fold_events(
                self.owner, [], after_seq, head, now_us, dry_run=True
            ),
            dict(known_refusals or {}),
        )
        try:
            grounds.rate = self.measure_rate()
        except EventRefused as refused:
            # The sample is the log's first events: this is the first the log refuses.
            grounds.replays[0] = refused
            grounds.rate = self.measure_rate(before_seq=refused.seq)
        while True:
            built = [
                self._log_source(facts, anchor, grounds),
                *(
                    self._snapshot_source(s, digests[s.snapshot_id], grounds, assessment.altered)
                    for s in usable
                ),
            ]
            breaks = {
                source.source_id: [found.describe() for found in route.tolerated]
                for source, route in built
            }
            manifest = planner.plan([source for source, _ in built], policy, findings, breaks)
            if anchor is None or FULL_LOG_SOURCE not in manifest.chosen:
                return Plan(manifest, {source.source_id: route for source, route in built})
            # The whole log would be replayed, and its links before the anchor were
            # taken on the snapshot's word: check them now, before anything is
            # written, so that a broken one refuses the plan instead of stopping
            # a rebuild half-way.
            prefix = self._walk(None, (), through_seq=anchor.position_seq)
            for found in prefix.breaks:
                walk.note(found)
            walk.unsealed += prefix.unsealed
            anchor = None

    def _missing_events(self, facts: LogFacts, snapshots: Sequence[SnapshotInfo], head: int) -> str:
        """The finding when the projections or a snapshot went past the log's
        end `head` ("" when none did, or the operator accepts the log's head)."""
        required = max([head, *(snapshot.position_seq for snapshot in snapshots)])
        if facts.position is not None and facts.position.state == STATE_CURRENT:
            required = max(required, facts.position.last_seq)
        if required <= head or self.settings.accept_log_head:
            return ""
        return (
            f"the projections or a snapshot reached event {required} but the log ends at "
            f"{head}: no source holds the events in between"
        )

    def _log_source(
        self, facts: LogFacts, anchor: SnapshotInfo | None, grounds: _Grounds
    ) -> tuple[Source, Route]:
        walk, rate = grounds.walk, grounds.rate
        risk = planner.RISK_VERIFIED
        detail = f"replay all {counted(facts.event_count, 'event')} at {rate:.0f} events/s"
        if walk.break_count:
            risk = planner.RISK_UNVERIFIABLE
            detail += (
                f"; {counted(walk.break_count, 'broken link')}, first {walk.breaks[0].describe()}"
            )
        elif anchor is not None and not anchor.chain_verified:
            risk = planner.RISK_UNVERIFIABLE
            detail += f"; links before snapshot {anchor.snapshot_id} did not check out"
        elif walk.unsealed:
            risk = planner.RISK_UNSEALED
            detail += f"; {counted(walk.unsealed, 'event')} predate the hash chain"
        # Only past a broken link can an event the fold needs be missing, or
        # where a tail's replay refused one (the whole log's then refuses too).
        refused = None
        if walk.break_count or any(found is not None for found in grounds.replays.values()):
            refused = grounds.refusal(0)
        if refused is not None:
            detail += f"; its replay cannot succeed: {refused}"
        source = Source(
            FULL_LOG_SOURCE,
            planner.replay_cost_seconds(facts.event_count, rate),
            risk,
            detail,
            possible=not grounds.lost and refused is None,
        )
        return source, Route(FULL_LOG_SOURCE, None, tuple(walk.breaks))

    def _snapshot_source(
        self,
        snapshot: SnapshotInfo,
        problem: str,
        grounds: _Grounds,
        altered_latest: Sequence[ChainBreak],
    ) -> tuple[Source, Route]:
        walk, rate = grounds.walk, grounds.rate
        tail = self.store.count_events_after(snapshot.position_seq)
        source_id = f"snapshot-{snapshot.snapshot_id}"
        detail = (
            f"snapshot {snapshot.snapshot_id} at event {snapshot.position_seq} "
            f"({counted(snapshot.rows, 'row')}) + a tail of {counted(tail, 'event')} "
            f"at {rate:.0f}/s"
        )
        risk = planner.RISK_VERIFIED
        breaks = [found for found in walk.breaks if found.seq > snapshot.position_seq]
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
        covered = [found for found in altered_latest if found.seq <= snapshot.position_seq]
        if covered:
            # Its bookings hold what the event said before it was altered: the
            # projections it gives can never agree with the log.
            detail += f"; the log was altered before it, first {covered[0].describe()}"
        position = snapshot.position_seq
        refused = grounds.refusal(position) if breaks else grounds.replays.get(position)
        if refused is not None:
            detail += f"; the tail's replay cannot succeed: {refused}"
        source = Source(
            source_id,
            planner.replay_cost_seconds(snapshot.rows + tail, rate),
            risk,
            detail,
            # A snapshot whose rows do not give its digest can never be restored
            # (the restore checks it): --max-risk 1 must not pick it over the log.
            possible=not grounds.lost and not covered and refused is None and not problem,
        )
        return source, Route(source_id, snapshot, tuple(breaks))

    def check_snapshot(self, snapshot: SnapshotInfo) -> str:
        """ "" when the snapshot's rows still give its digest, else what is wrong."""
        digest = ProjectionDigest(snapshot.position_seq, snapshot.chain_heads)
        try:
            for chunk in self.store.snapshot_chunks(snapshot.snapshot_id):
                chunk.add_to(digest)
        except (ValueError, KeyError, TypeError) as error:
            # Most often an older release's snapshot (another chunk format, or
            # its rows lack a later column), which FORMAT_VERSION did not tell apart.
            why = str(error)[:200]
            if isinstance(error, KeyError):
                why = f"a chunk lacks the field {error}"
            elif isinstance(error, TypeError):
                why = "a chunk's rows are not laid out as this release lays them"
            return f"unreadable: {why} (made by another release, or damaged)"
        if (digest.lanes, digest.bookings) != (snapshot.lanes_count, snapshot.bookings_count):
            return (
                f"holds {counted(digest.lanes, 'lane')} and "
                f"{counted(digest.bookings, 'booking')}, not the "
                f"{snapshot.lanes_count} and {snapshot.bookings_count} recorded"
            )
        if digest.hexdigest() != snapshot.digest:
            return "its rows do not give its recorded digest: changed or damaged"
        return ""

    def measure_rate(self, before_seq: int | None = None) -> float:
        """Events per second of the rebuild's path over the log's first events
        (before `before_seq`), folded in a transaction rolled back; errs slow."""
        started = time.perf_counter()
        sample = self.store.events_after(0, self.settings.sample_events)
        if before_seq is not None:
            sample = [event for event in sample if event.seq < before_seq]
        if not sample:
            return 1_000_000.0
        walker = ChainWalker()
        for event in sample:
            walker.check(event)
        lanes, now_us = lanes_of(sample), self._wall.now_us()
        self.store.fold_events(self.owner, lanes, 0, sample[-1].seq, now_us, dry_run=True)
        elapsed = max(time.perf_counter() - started, 1e-3)
        return len(sample) / elapsed

    # Rebuilding ----------------------------------------------------------------

    def rebuild(self, route: Route, progress: ProgressFn = no_progress) -> str:
        """Rebuilds along `route`, marks the projections current and returns
        their digest; a rebuild that stops releases its claim."""
        try:
            digest = self.rebuild_uncommitted(route, progress)
            self.finish()
        except RebuildClaimLost:
            raise
        except BaseException:
            self.release()
            raise
        return digest

    def release(self) -> None:
        """Gives up our claim, if any (unanswered: it lapses with its lease)."""
        with contextlib.suppress(StoreUnavailable):
            self.store.release_rebuild(self.owner)

    def finish(self) -> None:
        """Marks the rebuilt projections current, unless the log grew meanwhile."""
        position = self.store.position()
        if not self.store.finish_rebuild(self.owner, position.last_seq if position else -1):
            raise RebuildFailed("the log grew during the rebuild; run it again")

    def rebuild_uncommitted(
        self,
        route: Route,
        progress: ProgressFn = no_progress,
        assessed: tuple[str, str, int] | Literal["any"] | None = "any",
    ) -> str:
        """Rebuilds, leaving the marker "rebuilding", and returns the digest.
        `assessed`: the marker_key the plan was made under, or "any". Each
        range is folded once the walk checked it."""
        started = time.perf_counter()
        if not self.store.claim_rebuild(
            self.owner, self._wall.now_us(), self._lease_us(), assessed
        ):
            raise RebuildClaimLost(self.claimed_elsewhere())
        snapshot = route.snapshot
        position = snapshot.position_seq if snapshot else 0
        heads = dict(snapshot.chain_heads) if snapshot else {}
        total = self.store.count_events_after(position)
        tolerated = {found.seq for found in route.tolerated}
        ends = ranges(position, self.store.last_seq(), self._replay_range())
        with (
            Helpers(self.store, self._processes(position)) as helpers,
            concurrent.futures.ThreadPoolExecutor(1, "ledger-rebuild-fold") as folder,
        ):
            self.store.reset_projections(self.owner, position, self._wall.now_us())
            if snapshot is not None:
                self._restore(snapshot, progress, started)
            done, folding = 0, None
            # Every link from a verified start checked out: a verified point.
            verified, through = _verified_from(snapshot), position
            for taken in helpers.walk(heads, position, ends):
                for broken in taken.breaks:
                    if broken.seq not in tolerated:
                        raise ChainBroken(broken)
                    verified = False
                # The database folds a range (without the GIL) while the next is walked.
                if folding is not None:
                    folding.result()
                    progress("replay", done, max(total, done), time.perf_counter() - started)
                lanes = lanes_of(taken.lane_events)
                folding = folder.submit(
                    self.store.fold_events,
                    *(self.owner, lanes, taken.after_seq, taken.through_seq, self._wall.now_us()),
                )
                heads = dict(taken.heads)
                done += taken.events
                through = taken.through_seq
            if folding is not None:
                folding.result()
                progress("replay", done, max(total, done), time.perf_counter() - started)
        # Not past the commit horizon: a seq below it may still commit (PostgreSQL).
        if verified and position < through <= self.store.final_seq():
            # The snapshot taken next, and the next start, walk on from here.
            self._save_verified_point(ChainPoint(through, heads))
        return self.projection_digest(heads)

    def claimed_elsewhere(self) -> str:
        """Who holds the rebuild, and when a dead holder's claim lapses: after
        a kill -9 the bare 'another process' left an operator guessing."""
        position = self.store.position()
        if position is None or not position.owner:
            return "another process is rebuilding the projections"
        lapses_us = position.updated_at_us + self._lease_us() - self._wall.now_us()
        return (
            f"a rebuild by {position.owner} holds the projections; if that process is "
            f"gone (killed), its claim lapses in {max(lapses_us, 0) / 1e6:.0f} s "
            f"(rebuild_lease_seconds {self.settings.lease_seconds:g}): run this again then"
        )

    def _restore(self, snapshot: SnapshotInfo, progress: ProgressFn, started: float) -> None:
        digest = ProjectionDigest(snapshot.position_seq, snapshot.chain_heads)
        done = 0
        for chunk in self.store.snapshot_chunks(snapshot.snapshot_id):
            chunk.add_to(digest)
            self.store.restore_chunk(self.owner, chunk, self._wall.now_us())
            done += chunk.rows
            progress("restore", done, snapshot.rows, time.perf_counter() - started)
        if digest.hexdigest() != snapshot.digest:
            raise RebuildFailed(f"snapshot {snapshot.snapshot_id} changed while it was restored")

    def projection_digest(self, heads: Mapping[str, str] | None = None) -> str:
        """The digest of the projections as they stand: what a snapshot of them
        gives (`heads`: those a walk ended with, else read from the log)."""
        with self.store.view() as view:
            position = view.position()
            seq = position.last_seq if position else 0
            if heads is None:
                heads = view.chain_heads(seq)
            digest = ProjectionDigest(seq, {lane: head for lane, head in heads.items() if head})
            for chunk in view.chunks(self.settings.batch_events):
                chunk.add_to(digest)
        return digest.hexdigest()

    # Snapshots ---------------------------------------------------------------

    def current_position(self) -> Position | None:
        """The marker's position when it says the projections are current."""
        position = self.store.position()
        return position if position is not None and position.state == STATE_CURRENT else None

    def snapshot_due(self, every_events: int, position: Position | None = None) -> bool:
        """Whether `every_events` events (or the newest snapshot's rows over
        SNAPSHOT_ROWS_PER_EVENT, if more) passed since the newest snapshot."""
        if every_events <= 0:
            return False
        position = position or self.current_position()
        if position is None:
            return False
        newest = next(iter(self.store.snapshots()), None)
        if newest is None:
            return position.last_seq >= every_events
        interval = max(every_events, newest.rows // SNAPSHOT_ROWS_PER_EVENT)
        return position.last_seq - newest.position_seq >= interval

    def take_snapshot(self) -> SnapshotInfo | None:
        """Snapshots consistent projections (else None), keeping `snapshot_keep`."""
        snapshots = self.store.snapshots()
        with self.store.settled_view() as view:
            facts = view.facts()
            problems = projection_findings(facts)
            if problems:
                log.warning("no snapshot: %s", "; ".join(problems))
                return None
            assert facts.position is not None
            position = facts.position.last_seq
            heads = view.chain_heads(position)
            taken_at_us = self._wall.now_us()
            snapshot_id = self.store.begin_snapshot(position, heads, taken_at_us)
            digest = ProjectionDigest(position, heads)
            for chunk_no, chunk in enumerate(view.chunks(self.settings.batch_events)):
                chunk.add_to(digest)
                self.store.write_snapshot_chunk(snapshot_id, chunk_no, chunk)
        previous, walk = self._walk_from_trusted(snapshots, position, position, position)
        verified = (
            _verified_from(previous)
            and walk.break_count == 0
            and walk.heads_at.get(position) == dict(heads)
        )
        info = self.store.complete_snapshot(snapshot_id, digest, verified)
        self.store.prune_snapshots(self.settings.snapshot_keep, taken_at_us - self._lease_us())
        log.info(
            "snapshot %d at event %d: %s, %s, digest %s%s",
            snapshot_id,
            position,
            counted(info.lanes_count, "lane"),
            counted(info.bookings_count, "booking"),
            info.digest[:16],
            "" if verified else " (the chain before it did NOT check out)",
        )
        return info

    # The whole of it -------------------------------------------------------------

    def recover(
        self, policy: RecoveryPolicy, actor: str, progress: ProgressFn = no_progress
    ) -> Outcome:
        """Assess; if needed plan, record the manifest, and rebuild if admissible."""
        assessment = self.assess()
        if assessment.consistent:
            return Outcome(True, detail="the projections are consistent with the log")
        if assessment.rebuilding_elsewhere:
            owner = assessment.facts.position.owner if assessment.facts.position else ""
            return Outcome(False, detail=assessment.findings[0], waiting_for=owner or "?")
        log.warning("projections need recovery: %s", "; ".join(assessment.findings))
        attempts = _Attempts(assessment, marker_key(assessment.facts.position))
        # A second plan only when the rebuild met a broken link, or an event
        # its fold refuses, that the first did not know.
        for _attempt in range(2):
            outcome = self._attempt(policy, actor, progress, attempts)
            if outcome is not None:
                return outcome
        self.release()
        return Outcome(False, None, "the rebuild kept meeting broken links")

    def _attempt(
        self, policy: RecoveryPolicy, actor: str, progress: ProgressFn, attempts: _Attempts
    ) -> Outcome | None:
        """Plans, records the manifest and rebuilds if admissible; None: plan
        again with what `attempts` now holds."""
        try:
            plan = self.plan(attempts.assessment, policy, attempts.known, attempts.refusals)
        except RebuildFailed as error:
            # The log's events cannot be read as the rebuild reads them
            # (a lane configured without a policy).
            detail = (
                f"cannot plan a rebuild: {error}; `ledger verify` names the damage; "
                "restore the database from a backup (docs/recovery.md)"
            )
            log.error("%s", detail)
            if attempts.retried:
                self.release()
            return Outcome(False, None, detail)
        manifest = plan.manifest
        outcome = "planned" if manifest.admissible else "refused"
        manifest_id = self.store.save_manifest(manifest, actor, self._wall.now_us(), outcome)
        (log.info if manifest.admissible else log.error)(
            "recovery manifest %d: %s", manifest_id, manifest.to_json()
        )
        if not manifest.admissible:
            if attempts.retried:  # a rebuild of ours stopped: our claim goes
                self.release()
            return Outcome(False, manifest, manifest.directive)
        started = time.perf_counter()
        try:
            self._carry_out(plan, progress, attempts)
        except MarkerMoved:
            # Another replica saw the same and rebuilt first: whole again,
            # most likely, and a second rebuild would refuse every move anew.
            self._record(manifest_id, "superseded", started)
            if self.assess().consistent:
                log.info("another process recovered the projections meanwhile")
                return Outcome(True, detail="another process recovered the projections meanwhile")
            return Outcome(False, None, "the projections changed while the rebuild was planned")
        except (ChainBroken, EventRefused) as error:
            # Planned again with the broken link, or with the event the fold
            # needs missing where no broken link told (before a snapshot, say),
            # which _carry_out noted: that source is then not possible.
            self._record(manifest_id, "failed", started)
            log.error("rebuild stopped: %s; planning again", error)
            if isinstance(error, ChainBroken):
                attempts.known.append(error.chain_break)
            return None
        except (RebuildFailed, RebuildClaimLost) as error:
            self._record(manifest_id, "failed", started)
            log.error("rebuild failed: %s", error)
            self.release()
            return Outcome(False, manifest, str(error))
        except BaseException:
            # Ctrl-C, SIGTERM: the claim goes now, not when its lease lapses.
            self.release()
            raise
        return self._judge_rebuilt(plan, manifest_id, started, attempts)

    def _judge_rebuilt(
        self, plan: Plan, manifest_id: int, started: float, attempts: _Attempts
    ) -> Outcome | None:
        """The outcome once the projections agree with the log; None: plan
        again, past the broken links found before the snapshot rebuilt from."""
        manifest = plan.manifest
        rebuilt = self.store.facts()
        attempts.claim_on = marker_key(rebuilt.position)
        differ = projection_findings(rebuilt)
        if not differ:
            self._record(manifest_id, MANIFEST_REBUILT, started)
            self.snapshot_after_rebuild()
            return Outcome(True, manifest, manifest.directive)
        # The source gave projections the log does not: a snapshot that
        # holds what the log no longer says (events removed before it).
        # The links before it, taken on its word, are walked for the
        # break; planned again with it, no such snapshot is possible.
        self._record(manifest_id, "failed", started)
        snapshot = plan.routes[manifest.chosen[0]].snapshot
        found = self._walk(None, (), snapshot.position_seq).breaks if snapshot else []
        log.error(
            "the projections rebuilt from %s do not match the log (%s)%s",
            ", ".join(manifest.chosen),
            "; ".join(differ),
            f"; the log was changed before it, first {found[0].describe()}" if found else "",
        )
        if not found:
            return Outcome(
                False,
                manifest,
                "the rebuilt projections do not match the log; "
                "`ledger verify` names the damage (docs/recovery.md)",
            )
        attempts.assessment = dataclasses.replace(
            attempts.assessment, altered=(*attempts.assessment.altered, *found)
        )
        return None

    def _carry_out(self, plan: Plan, progress: ProgressFn, attempts: _Attempts) -> None:
        digests: list[tuple[str, str]] = []
        for index, source_id in enumerate(plan.manifest.chosen):
            # The first source claims under the marker assessed; the next ones
            # (min_viable_sources) rebuild again under our own claim.
            route = plan.routes[source_id]
            try:
                built = self.rebuild_uncommitted(
                    route, progress, attempts.claim_on if index == 0 else "any"
                )
            except EventRefused as refused:  # by the seq its source's replay starts after
                attempts.refusals[route.snapshot.position_seq if route.snapshot else 0] = refused
                raise
            if digests and built != digests[0][1]:
                raise RebuildFailed(
                    f"{source_id} rebuilt other projections than {digests[0][0]} "
                    f"({built[:16]} != {digests[0][1][:16]}): the sources disagree"
                )
            digests.append((source_id, built))
        self.finish()

    def _record(self, manifest_id: int, outcome: str, started: float) -> None:
        elapsed_ms = int((time.perf_counter() - started) * 1000)
        self.store.update_manifest(manifest_id, outcome, elapsed_ms)

    def snapshot_after_rebuild(self) -> SnapshotInfo | None:
        """The snapshot the rebuilt projections start from: a new one, or the
        one the rebuild came from when it is at the log's end (None: none taken)."""
        # The next assessment then walks the chain from here, and the next
        # recovery has a fresh, verified snapshot to start from.
        try:
            newest = next(iter(self.store.snapshots()), None)
            position = self.store.position()
            if (
                newest is not None
                and position is not None
                and newest.position_seq == position.last_seq
                and not self.check_snapshot(newest)
            ):
                return newest  # the snapshot it was rebuilt from is already here
            return self.take_snapshot()
        except StoreUnavailable:
            log.warning("no snapshot after the rebuild: database unavailable")
            return None


@dataclasses.dataclass
class _Attempts:
    """What one recovery's rebuilds stopped at, for the plan made again after one."""

    assessment: Assessment
    # The marker a claim expects: the assessment's, then the one our own
    # rebuild left (a plan made again after it finished).
    claim_on: tuple[str, str, int] | None
    known: list[ChainBreak] = dataclasses.field(default_factory=list)
    refusals: dict[int, EventRefused] = dataclasses.field(default_factory=dict)

    @property
    def retried(self) -> bool:
        """Whether a rebuild of ours stopped: its claim is ours to give up."""
        return bool(self.known or self.refusals)


@dataclasses.dataclass
class _Grounds:
    """What every source of one plan is judged on: the walk of the chain,
    whether events are missing from the log's end, the rate measured, and
    whether the replay after a seq would succeed (None: it would), by seq."""

    walk: Walk
    lost: bool
    # The rebuild's fold after a seq, run dry (rolled back).
    fold: Callable[[int], None]
    replays: dict[int, EventRefused | None]
    rate: float = 0.0

    def refusal(self, after_seq: int) -> EventRefused | None:
        """The first event after `after_seq` the fold refuses (None: none),
        folded at most once per seq for one plan."""
        if after_seq not in self.replays:
            if self.replays.get(0, False) is None:
                # The whole log folds: so does every tail of it.
                return None
            try:
                self.fold(after_seq)
                self.replays[after_seq] = None
            except EventRefused as refused:
                self.replays[after_seq] = refused
        return self.replays[after_seq]


def _verified_from(anchor: SnapshotInfo | ChainPoint | None) -> bool:
    """Whether a clean walk from `anchor` proves every link before its end."""
    return not isinstance(anchor, SnapshotInfo) or anchor.chain_verified


def projection_findings(facts: LogFacts, *, rebuild_may_run: bool = False) -> list[str]:
    """What the cheap facts say is wrong with the projections (empty: nothing).
    `rebuild_may_run`: the caller has not checked the claim's lease (verify),
    so a rebuild the marker names may still be running."""
    findings: list[str] = []
    position = facts.position
    if position is None:
        findings.append("the projections' position marker is missing")
    elif position.state == STATE_REBUILDING:
        owner = position.owner or "unknown"
        findings.append(
            f"a rebuild by {owner} holds the projections, applied through event "
            f"{position.last_seq}: it is running, or it stopped before it finished"
            if rebuild_may_run
            else f"a rebuild by {owner} stopped at event {position.last_seq}"
        )
    elif position.last_seq != facts.head_seq:
        side = "behind" if position.last_seq < facts.head_seq else "ahead of"
        findings.append(
            f"the projections are {side} the log: applied through event {position.last_seq}, "
            f"the log ends at {facts.head_seq}"
        )
    if facts.bookings != facts.answer_events:
        findings.append(
            f"{counted(facts.bookings, 'booking')} {_are(facts.bookings)} projected but the "
            f"log answers {counted(facts.answer_events, 'reservation')}"
        )
    if facts.lanes != facts.configured_lanes:
        findings.append(
            f"{counted(facts.lanes, 'lane')} {_are(facts.lanes)} projected but the log "
            f"configures {facts.configured_lanes}"
        )
    if facts.stale_lanes:
        findings.append(
            f"{counted(facts.stale_lanes, 'lane')} {_differ(facts.stale_lanes)} latest "
            "configuration in the log"
        )
    if facts.stale_bookings:
        findings.append(
            f"{counted(facts.stale_bookings, 'booking')} {_differ(facts.stale_bookings)} "
            "latest event in the log"
        )
    return findings


# The server's side ------------------------------------------------------------------


class RecoveryGuard:
    """Decides whether the server may take moves (docs/recovery.md). READY:
    serving, assessed every `consistency_check_seconds`. REFUSED: the planner
    refused; assessed every `check_interval_seconds`, serving once it passes.
    PENDING: not assessed yet, a rebuild failed, or another process rebuilds;
    the whole recovery runs every `check_interval_seconds`."""

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
        prepare: Callable[[], None] | None = None,
        on_damage: Callable[[StoreDamaged], None] = lambda damage: None,
    ) -> None:
        """`prepare` (the migration) runs before each recovery until it once
        succeeds; `on_damage` hears of damage the recovery met."""
        self.recovery = recovery
        self._on_damage = on_damage
        self._prepare = prepare
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
        self._waiting_for = ""  # the owner of the other rebuild last logged

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def is_ready(self) -> bool:
        return self.state == self.READY

    def operator_steps(self) -> str:
        """What an operator must do while the planner refuses ("" in any other
        state): no recovery runs by itself until then."""
        manifest = self.manifest
        if self.state != self.REFUSED or manifest is None:
            return ""
        return _OPERATOR_STEPS.get(manifest.verdict.value, "")

    def _set(self, state: str) -> None:
        with self._lock:
            changed = state != self._state
            self._state = state
        if changed:
            said = (
                "taking moves" if state == self.READY else "moves are refused (RECOVERY_REQUIRED)"
            )
            steps = self.operator_steps()
            if steps:
                said += f"; {steps}; this server serves again by itself once the projections "
                said += "are whole (docs/recovery.md)"
            level = logging.INFO if state == self.READY else logging.WARNING
            log.log(level, "projections %s: %s", state, said)
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
        outcome: Outcome | None = None
        try:
            if self._prepare is not None:
                self._prepare()
                self._prepare = None
            outcome = self.recovery.recover(self.policy, self._actor)
        except StoreDamaged as damage:  # the store logs it; maintenance stops these checks
            self._on_damage(damage)
        except StoreUnavailable as error:
            _log_unavailable(error)
        except migrate.RevisionRefused as error:  # a newer (or older) release's schema
            log.error("%s; health stays NOT_SERVING", error)
        except Exception:
            # Closed, not crashed: the server stays up, refusing moves, and retries.
            log.exception("recovery failed; moves stay refused, will retry")
        if outcome is None:
            self._set(self.PENDING)
            return
        self.manifest = outcome.manifest or self.manifest
        if outcome.waiting_for and outcome.waiting_for != self._waiting_for:
            # The state stays PENDING, which _set does not log again.
            log.warning(
                "projections pending: %s; moves are refused (RECOVERY_REQUIRED) until it "
                "ends, or, if that process is gone (killed), until its claim lapses "
                "%g s after its last heartbeat (rebuild_lease_seconds); checked every %g s",
                outcome.detail,
                self.recovery.settings.lease_seconds,
                self._check_interval,
            )
        self._waiting_for = outcome.waiting_for
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
        except StoreUnavailable as error:
            if translate.schema_missing(error):
                # The database answers without the ledger's tables (dropped, or
                # another swapped in): no move can be served until they are back.
                self.required()
            _log_unavailable(error)
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
            position = self.recovery.current_position()
            if position is None:
                # A rebuild began elsewhere (`ledger rebuild`, another replica)
                # or the row was deleted: seen on an idle server too.
                self.required()
                return
            if self.recovery.snapshot_due(self._snapshot_every, position):
                self.recovery.take_snapshot()


def _log_unavailable(error: StoreUnavailable) -> None:
    """With the database's own words: health may answer while every check fails."""
    said = translate.driver_message(error)
    why = translate.unavailable_words(error, "database unavailable")
    log.warning("recovery check: %s%s; will retry", why, f" ({said})" if said else "")


# What an operator can do about each refusal (docs/recovery.md, the planner).
_OPERATOR_STEPS = {
    "EXCEEDS_BUDGET": "the rebuild would take longer than the server may spend on its own: "
    "`ledger verify` names the damage; `ledger recover --budget-seconds N`, with N above "
    "the cost in the manifest, rebuilds",
    "RISK_TOO_HIGH": "no source is safe enough to rebuild from: `ledger verify` names the "
    "damage; restore the database from a backup, or accept the log as it is with "
    "`ledger recover --budget-seconds N --max-risk 1`",
    "HARD_ABORT": "events acknowledged are missing from the log's end, or its replay would "
    "refuse an event (the manifest's sources say which): `ledger verify` names the damage; "
    "restore the database from a backup, or, only for events missing from the end and if "
    "the log is known to be right, `ledger recover --budget-seconds N --accept-log-head`",
}


def _are(count: int) -> str:
    return "is" if count == 1 else "are"


def _differ(count: int) -> str:
    return "differs from its" if count == 1 else "differ from their"
