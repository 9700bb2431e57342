"""Verification: the whole log against its hash chain, and every projected lane,
booking and window total against a replay of the log.

Lane by lane (a chain is per lane), so memory holds one lane's bookings at a
time. The replay uses `domain.replay.Projection`, the same folds as the live
path; a window's totals include the bookings of the lanes below it (parent
budgets), computed from the replayed policies.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterator, Mapping

from ledger_service.domain.bookings import Booking
from ledger_service.domain.chain import ChainWalker
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.policies import LanePolicy, members
from ledger_service.domain.replay import Projection
from ledger_service.domain.window import WindowTotals, totals_of
from ledger_service.recovery.rebuild import ProgressFn, lanes_of, no_progress, projection_findings
from ledger_service.recovery.store import AcceptedBreak, SqlRecoveryStore
from ledger_service.storage.chaining import STATE_REBUILDING

MAX_KEPT_FINDINGS = 100


@dataclasses.dataclass
class VerificationReport:
    # Broken links first: they explain the mismatches that follow from them.
    broken_links: list[str] = dataclasses.field(default_factory=list)
    mismatches: list[str] = dataclasses.field(default_factory=list)
    # Broken links an operator's recovery accepted (`ledger recover --max-risk
    # 1`): named every time, not findings (docs/recovery.md).
    accepted: list[str] = dataclasses.field(default_factory=list)
    accepted_count: int = 0
    finding_count: int = 0
    events: int = 0
    lanes: int = 0
    bookings: int = 0
    unsealed_events: int = 0
    # The owner of a rebuild the marker names: it may be running as verify
    # reads, its projections half made ("" when no rebuild holds them).
    rebuilding_owner: str = ""

    @property
    def ok(self) -> bool:
        return self.finding_count == 0

    @property
    def findings(self) -> list[str]:
        return [*self.broken_links, *self.mismatches][:MAX_KEPT_FINDINGS]

    def accept(self, described: str) -> None:
        self.accepted_count += 1
        if len(self.accepted) < MAX_KEPT_FINDINGS:
            self.accepted.append(described)

    def add(self, finding: str, *, broken_link: bool = False) -> None:
        self.finding_count += 1
        kept = self.broken_links if broken_link else self.mismatches
        if len(kept) < MAX_KEPT_FINDINGS:
            kept.append(finding)


def _first_difference(expected: object, found: object) -> str:
    for field in dataclasses.fields(expected):  # type: ignore[arg-type]
        left, right = getattr(expected, field.name), getattr(found, field.name)
        if left != right:
            return f"{field.name} is {right!r} in the projection, {left!r} in the log"
    return "they differ"


class Verifier:
    def __init__(self, store: SqlRecoveryStore, batch_events: int = 1000) -> None:
        self._store = store
        self._batch = batch_events
        self._latest_us = 0
        self._accepted: Mapping[str, AcceptedBreak] = {}

    def _events(self, lane: str = "", kinds: tuple[str, ...] = ()) -> Iterator[Event]:
        after = 0
        while True:
            batch = self._store.events_after(after, self._batch, lane=lane, kinds=kinds)
            yield from batch
            if len(batch) < self._batch:
                return
            after = batch[-1].seq

    def verify(self, now_us: int, progress: ProgressFn = no_progress) -> VerificationReport:
        """The file's integrity (SQLite), then the log against its chain and the
        projections against a replay, all read at one instant: moves may
        commit meanwhile. A damaged file raises StoreDamaged."""
        with self._store.view():
            self._store.check_integrity()
            return self._verify(now_us, progress)

    def _verify(self, now_us: int, progress: ProgressFn) -> VerificationReport:
        report = VerificationReport()
        self._latest_us = 0  # the latest instant of any event, as the lanes are read
        self._accepted = self._store.accepted_breaks()
        facts = self._store.facts()
        if facts.position is not None and facts.position.state == STATE_REBUILDING:
            report.rebuilding_owner = facts.position.owner or "unknown"
        for finding in projection_findings(facts, rebuild_may_run=True):
            report.add(finding)
        # A lane configured without a policy is left to its lane's replay to name.
        configured = self._events(kinds=(EventKind.LANE_CONFIGURED.value,))
        policies = {p.lane: p for p in lanes_of(e for e in configured if e.policy is not None)}
        budgets = _budgets(policies)
        # Each lane's bookings are summed in the window of every budget it is in.
        windows: dict[str, set[int]] = {}
        for lane, lanes in budgets.items():
            for member in lanes:
                windows.setdefault(member, set()).add(policies[lane].window_us)
        projected = {policy.lane: policy for policy in self._store.lanes()}
        own_totals: dict[tuple[str, int], WindowTotals] = {}
        total = self._store.count_events_after(0)
        for lane in sorted(set(self._store.log_lanes()) | set(projected)):
            replayed = self._verify_lane(
                lane, projected.get(lane), report, lambda done: progress("verify", done, total, 0.0)
            )
            for window_us in windows.get(lane, ()):
                own_totals[(lane, window_us)] = totals_of(replayed.values(), now_us, window_us)
            progress("verify", report.events, total, 0.0)
        self._verify_windows(policies, budgets, own_totals, now_us, report)
        return report

    def _verify_lane(
        self,
        lane: str,
        projected_policy: LanePolicy | None,
        report: VerificationReport,
        events_done: Callable[[int], None],
    ) -> Mapping[str, Booking]:
        walker = ChainWalker()
        projection = Projection()
        for event in self._events(lane=lane):
            report.events += 1
            if report.events % self._batch == 0:
                events_done(report.events)  # within a lane too: one lane may hold them all
            self._latest_us = max(self._latest_us, event.occurred_at_us)
            found = walker.check(event)
            if found is not None:
                described = found.describe()
                accepted = self._accepted.get(described)
                if accepted is None:
                    report.add(f"broken link: {described}", broken_link=True)
                else:
                    when = datetime.datetime.fromtimestamp(
                        accepted.created_at_us / 1e6, datetime.UTC
                    ).isoformat(timespec="seconds")
                    report.accept(
                        f"broken link: {described} (accepted by recovery manifest "
                        f"{accepted.manifest_id} at {when}, {accepted.actor})"
                    )
            try:
                projection.apply(event)
            except (AssertionError, KeyError, ValueError) as error:
                report.add(f"event {event.seq} (lane {lane!r}) cannot be replayed: {error}")
        report.unsealed_events += walker.unsealed
        report.lanes += 1
        replayed_policy = projection.lanes.get(lane)
        if replayed_policy is None:
            report.add(f"lane {lane!r} is projected but no event configures it")
        elif projected_policy is None:
            report.add(f"lane {lane!r} is configured in the log but missing from the projection")
        elif replayed_policy != projected_policy:
            report.add(f"lane {lane!r}: {_first_difference(replayed_policy, projected_policy)}")
        replayed = {rid: booking for (_, rid), booking in projection.bookings.items()}
        # The projection is streamed against the replay: one lane's bookings
        # are held once, not twice.
        unseen = set(replayed)
        for found_booking in self._store.projected_bookings(lane):
            rid = found_booking.reservation_id
            report.bookings += 1
            expected = replayed.get(rid)
            unseen.discard(rid)
            if expected is None:
                report.add(f"booking {lane}/{rid} is projected but not in the log")
            elif expected != found_booking:
                report.add(f"booking {lane}/{rid}: {_first_difference(expected, found_booking)}")
        for rid in sorted(unseen):
            report.bookings += 1
            report.add(f"booking {lane}/{rid} is in the log but missing from the projection")
        return replayed

    def _verify_windows(
        self,
        policies: Mapping[str, LanePolicy],
        budgets: Mapping[str, list[str]],
        own_totals: Mapping[tuple[str, int], WindowTotals],
        now_us: int,
        report: VerificationReport,
    ) -> None:
        for lane in sorted(policies):
            window_us = policies[lane].window_us
            held = charged = open_count = 0
            for member in budgets[lane]:
                part = own_totals.get((member, window_us), WindowTotals())
                held += part.held_nanos
                charged += part.charged_nanos
                open_count += part.open_bookings
            expected = WindowTotals(held, charged, open_count)
            found = self._store.window_totals(lane, now_us, window_us)
            kept = self._store.kept_window(policies[lane], now_us)
            if kept is not None and kept[0] > self._latest_us:
                # A move dates itself no earlier than its budgets' kept windows.
                report.add(
                    f"lane {lane!r} kept window is moved to {kept[0]}, after the "
                    f"log's last event at {self._latest_us}"
                )
            for what, totals in (("window", found), ("kept window", kept[1] if kept else None)):
                if totals is not None and totals != expected:
                    report.add(
                        f"lane {lane!r} {what} at {now_us}: projected held/charged/open "
                        f"{totals.held_nanos}/{totals.charged_nanos}/{totals.open_bookings}, "
                        f"replayed {held}/{charged}/{open_count}"
                    )


def _budgets(policies: Mapping[str, LanePolicy]) -> dict[str, list[str]]:
    """Each lane's budget: the lanes whose bookings its window sums (`members`)."""
    children: dict[str, list[str]] = {}
    for policy in policies.values():
        if policy.parent:
            children.setdefault(policy.parent, []).append(policy.lane)
    return {lane: members(lane, lambda name: children.get(name, ())) for lane in policies}
