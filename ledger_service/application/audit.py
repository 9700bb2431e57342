"""The audit of a lane's window: how its spend splits into real charges, estimates,
open holds and refusals, how often its Reserves were denied, and what that means.

The recall jam (docs/semantics.md) was a window full of estimates: UNKNOWN outcomes booked
far above the real bill and holds that expired, $0.4989 booked against $0.50 while
real spend was about $0.0014, and 1,539 of 1,685 calls denied. The audit puts those
numbers side by side so that one look at a lane says "check its ledger before
blaming the provider".

`summarize` is pure: tallies in, figures, flags and one sentence out. `Auditor`
reads the tallies in one read-only transaction. The audit of a lane covers the
same bookings as its balance: the lane's budget, i.e. its own bookings and those
of every lane below it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

from ledger_service.application.budgets import lane_time
from ledger_service.application.ledger import lane_row
from ledger_service.application.ports import StateTally, Store, StoreTransaction
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.clock import Clock
from ledger_service.domain.policies import MAX_BUDGET_DEPTH
from ledger_service.domain.window import Balance, WindowTotals

DEFAULT_BIGGEST = 5
MAX_BIGGEST = 100
# Flags fire at these shares, in percent.
NEAR_LIMIT_PERCENT = 90
HIGH_DENIAL_RATE_PERCENT = 10
# MOSTLY_ESTIMATES needs the estimates to be at least this share of the limit too:
# a few cents of estimates in a large budget block nothing and are not the jam.
MOSTLY_ESTIMATES_FLOOR_PERCENT = 5
NANOS_PER_UNIT = 10**9


class Flag(enum.Enum):
    # More of the window's charges are estimates (UNKNOWN, expired) than real ones,
    # and the estimates are at least 5% of the limit.
    MOSTLY_ESTIMATES = "MOSTLY_ESTIMATES"
    # Spent is at least 90% of the limit.
    NEAR_LIMIT = "NEAR_LIMIT"
    # More than 10% of the window's Reserves were denied.
    HIGH_DENIAL_RATE = "HIGH_DENIAL_RATE"


@dataclasses.dataclass(frozen=True)
class Part:
    """Some of the window's bookings: how many, and what they count now."""

    count: int = 0
    amount_nanos: int = 0


@dataclasses.dataclass(frozen=True)
class Audit:
    lane: str
    balance: Balance
    succeeded: Part
    unknown: Part
    expired: Part
    # Open holds: amount_nanos is what they hold.
    open: Part
    # Refused calls and calls never sent: charged zero, so only counted.
    refunded_count: int
    reconciled: Part
    # Charges an operator's correction replaced: real, as the operator said.
    corrected: Part
    # Reserves answered inside the window (admitted or denied), and the denied.
    reserve_count: int
    denied_count: int
    biggest: tuple[Booking, ...]
    # When the oldest booking with an amount ages out, and what that frees.
    next_release_at_us: int | None
    next_release_nanos: int
    flags: tuple[Flag, ...]
    summary: str

    @property
    def estimated_charged_nanos(self) -> int:
        return self.unknown.amount_nanos + self.expired.amount_nanos

    @property
    def real_charged_nanos(self) -> int:
        return (
            self.succeeded.amount_nanos + self.reconciled.amount_nanos + self.corrected.amount_nanos
        )

    @property
    def denial_rate(self) -> float:
        return self.denied_count / self.reserve_count if self.reserve_count else 0.0

    @property
    def estimated_to_real_ratio(self) -> float:
        real = self.real_charged_nanos
        return self.estimated_charged_nanos / real if real else 0.0


def summarize(
    lane: str,
    limit_nanos: int,
    window_us: int,
    now_us: int,
    tallies: Iterable[StateTally],
    biggest: Sequence[Booking] = (),
    next_release: tuple[int, int] | None = None,
) -> Audit:
    """The audit of one window from its tallies by state (see StoreTransaction.window_tally).

    The balance is computed from the same tallies, so that the parts always add
    up to it even when other requests commit while the audit is read.
    """
    parts = _parts_by_state(tallies)
    rejected = parts.get(BookingState.REJECTED, Part())
    assert rejected.amount_nanos == 0, "a denied Reserve books nothing"
    open_part = parts.get(BookingState.OPEN, Part())
    charged = sum(
        part.amount_nanos
        for state, part in parts.items()
        if state not in (BookingState.OPEN, BookingState.REJECTED)
    )
    balance = Balance(
        lane,
        limit_nanos,
        window_us,
        now_us,
        WindowTotals(open_part.amount_nanos, charged, open_part.count),
    )
    release_at_us, release_nanos = next_release if next_release is not None else (None, 0)
    audit = Audit(
        lane=lane,
        balance=balance,
        succeeded=parts.get(BookingState.SETTLED, Part()),
        unknown=parts.get(BookingState.SETTLED_UNKNOWN, Part()),
        expired=parts.get(BookingState.EXPIRED, Part()),
        open=open_part,
        refunded_count=parts.get(BookingState.REFUNDED, Part()).count,
        reconciled=parts.get(BookingState.RECONCILED, Part()),
        corrected=parts.get(BookingState.CORRECTED, Part()),
        reserve_count=sum(part.count for part in parts.values()),
        denied_count=rejected.count,
        biggest=tuple(biggest),
        next_release_at_us=None if release_at_us is None else release_at_us + window_us,
        next_release_nanos=release_nanos,
        flags=(),
        summary="",
    )
    flags = flags_of(audit)
    return dataclasses.replace(audit, flags=flags, summary=summary_of(audit, flags))


def _parts_by_state(tallies: Iterable[StateTally]) -> dict[BookingState, Part]:
    parts: dict[BookingState, Part] = {}
    for tally in tallies:
        before = parts.get(tally.state, Part())
        parts[tally.state] = Part(
            before.count + tally.count, before.amount_nanos + tally.amount_nanos
        )
    return parts


def flags_of(audit: Audit) -> tuple[Flag, ...]:
    flags: list[Flag] = []
    limit = audit.balance.limit_nanos
    if _mostly_estimates(audit):
        flags.append(Flag.MOSTLY_ESTIMATES)
    if limit > 0 and audit.balance.spent_nanos * 100 >= limit * NEAR_LIMIT_PERCENT:
        flags.append(Flag.NEAR_LIMIT)
    if audit.denied_count * 100 > audit.reserve_count * HIGH_DENIAL_RATE_PERCENT:
        flags.append(Flag.HIGH_DENIAL_RATE)
    return tuple(flags)


def _mostly_estimates(audit: Audit) -> bool:
    """Estimates outweigh real charges, and are enough of the limit to matter."""
    estimated = audit.estimated_charged_nanos
    floor = estimated * 100 >= audit.balance.limit_nanos * MOSTLY_ESTIMATES_FLOOR_PERCENT
    return estimated > audit.real_charged_nanos and floor


def summary_of(audit: Audit, flags: Sequence[Flag]) -> str:
    """One sentence: what the window holds, then what it means."""
    balance = audit.balance
    window = window_text(balance.window_us)
    if audit.reserve_count == 0:
        return f"Lane {audit.lane} booked nothing in its {window} window."
    spent = (
        f"Lane {audit.lane} has spent {money_text(balance.spent_nanos)} of "
        f"{money_text(balance.limit_nanos)} in its {window} window"
    )
    split = (
        f"{money_text(audit.real_charged_nanos)} real charges, "
        f"{money_text(audit.estimated_charged_nanos)} estimates "
        f"({audit.unknown.count} UNKNOWN, {audit.expired.count} expired) and "
        f"{money_text(audit.open.amount_nanos)} in {_count_of(audit.open.count, 'open hold')}"
    )
    denied = (
        f"{audit.denied_count} of {audit.reserve_count} Reserves "
        f"({audit.denial_rate:.0%}) were denied"
    )
    if Flag.MOSTLY_ESTIMATES in flags:
        times = (
            f"{_times_text(audit.estimated_to_real_ratio)} the real charges"
            if audit.real_charged_nanos
            else "with no real charge at all"
        )
        return (
            f"{spent}, mostly estimates, {times}: {split}; {denied}; "
            "check the lane's timeouts and expired holds before blaming the provider."
        )
    if Flag.NEAR_LIMIT in flags:
        # The flag starts at 90% and has no end: past the limit, "close" would understate it.
        overrun = balance.overrun_nanos
        where = f"over its limit by {money_text(overrun)}" if overrun else "close to its limit"
        return f"{spent}, {where}: {split}; {denied}."
    if Flag.HIGH_DENIAL_RATE in flags:
        # Denials without a full window: what was denied then has aged out or been corrected since.
        return f"{spent}, with many Reserves denied: {split}; {denied}."
    return f"{spent}: {split}; {denied}."


def _times_text(ratio: float) -> str:
    return f"{ratio:.0f} times" if ratio >= 10 else f"{ratio:.1f} times"


def money_text(nanos: int) -> str:
    """Nanos as a short amount of the lane's currency: 498_900_000 -> '$0.4989'."""
    whole, fraction = divmod(abs(nanos), NANOS_PER_UNIT)
    digits = f"{fraction:09d}".rstrip("0").ljust(2, "0")
    return f"{'-' if nanos < 0 else ''}${whole}.{digits}"


def window_text(window_us: int) -> str:
    """The largest unit that states the window exactly: 86_400 s -> '1d'."""
    for unit, length_us in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000)):
        if window_us and window_us % length_us == 0:
            return f"{window_us // length_us}{unit}"
    if window_us % 1_000_000 == 0:
        return f"{window_us // 1_000_000}s"
    return f"{window_us}us"


class Auditor:
    """Reads a lane's audit in one read-only transaction, at one instant."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    def audit(self, lane: str, biggest: int = DEFAULT_BIGGEST) -> Audit:
        biggest = max(0, min(biggest, MAX_BIGGEST))

        def work(tx: StoreTransaction) -> Audit:
            policy = lane_row(tx, tx.get_lane(lane), lane)
            # The lane's time, as a balance reads it: a lagging replica's bare
            # clock would leave out what a faster one booked ahead.
            now_us = lane_time(tx, [policy], self._clock.now_us())
            window_us = policy.window_us
            budget = [name for level in tx.subtree(lane, MAX_BUDGET_DEPTH) for name in level]
            tallies = tx.window_tally(budget, now_us, window_us)
            top = tx.biggest_bookings(budget, now_us, window_us, biggest) if biggest else ()
            release = tx.next_release(budget, now_us, window_us)
            return summarize(lane, policy.limit_nanos, window_us, now_us, tallies, top, release)

        return self._store.run(work, write=False, snapshot=True)


def _count_of(count: int, noun: str) -> str:
    """ "1 open hold", "2 open holds"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
