"""What a lane does while the ledger cannot be reached, chosen by its operator.

- `deny` (fail closed): every call falls back until the ledger answers again.
- `allowance`: at most `max_nanos` and `max_calls` of calls the ledger has not
  booked yet, priced locally with the ledger's own formula. Each such call is
  journaled before it is made and replayed to the ledger later; the allowance
  frees up only as the ledger acknowledges the replayed calls, so a long outage
  spends it once, not once per reconnect. There is no unbounded setting.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import threading
from collections.abc import Mapping

from ledger_client.bookings import MAX_AMOUNT_NANOS, DenialReason, ReserveArguments, check_name
from ledger_client.journal import Journal, JournalEntry, JournalError, Source, now_text
from ledger_client.outcomes import Ending, Settlement
from ledger_client.pricing import DEFAULT_BYTES_PER_TOKEN_MILLI, ModelPrice, cap_nanos
from ledger_client.settings import require_int

MAX_ALLOWANCE_CALLS = 100_000
MAX_OVERHEAD_TOKENS = 10_000_000


class OutageMode(enum.Enum):
    DENY = "deny"
    ALLOWANCE = "allowance"


@dataclasses.dataclass(frozen=True)
class OutagePolicy:
    mode: OutageMode
    # Where calls the ledger has not heard of are kept. Required for an
    # allowance; with `deny` it still lets endings that could not be sent, and
    # Reserves that got no answer, reach the ledger later.
    journal_path: pathlib.Path | None = None
    max_nanos: int = 0
    max_calls: int = 0
    # Local prices for the allowance: the lane's prices in the ledger, copied.
    prices: Mapping[str, ModelPrice] = dataclasses.field(default_factory=dict)
    bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI
    overhead_tokens: int = 0

    @classmethod
    def deny(cls, journal_path: pathlib.Path | str | None = None) -> OutagePolicy:
        path = None if journal_path is None else _journal_path(journal_path)
        return cls(OutageMode.DENY, journal_path=path)

    @classmethod
    def allowance(
        cls,
        *,
        max_nanos: int,
        max_calls: int,
        journal_path: pathlib.Path | str,
        prices: Mapping[str, ModelPrice],
        bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI,
        overhead_tokens: int = 0,
    ) -> OutagePolicy:
        return cls(
            OutageMode.ALLOWANCE,
            journal_path=_journal_path(journal_path),
            max_nanos=max_nanos,
            max_calls=max_calls,
            prices=dict(prices),
            bytes_per_token_milli=bytes_per_token_milli,
            overhead_tokens=overhead_tokens,
        )

    def __post_init__(self) -> None:
        if self.mode is OutageMode.DENY:
            return
        if self.journal_path is None:
            raise ValueError("an outage allowance needs a journal_path")
        for name in ("max_nanos", "max_calls", "bytes_per_token_milli", "overhead_tokens"):
            require_int(getattr(self, name), name)
        for model, price in self.prices.items():
            # A price under a name the ledger refuses could never price a call.
            check_name("model", model)
            if not isinstance(price, ModelPrice):
                raise TypeError(f"prices[{model!r}] must be a ModelPrice")
        if not 1 <= self.max_calls <= MAX_ALLOWANCE_CALLS:
            raise ValueError(f"max_calls must be between 1 and {MAX_ALLOWANCE_CALLS}")
        if not 1 <= self.max_nanos <= MAX_AMOUNT_NANOS:
            raise ValueError(f"max_nanos must be between 1 and {MAX_AMOUNT_NANOS}")
        if not self.prices:
            raise ValueError("an outage allowance needs the lane's prices")
        if not 100 <= self.bytes_per_token_milli <= 64_000:
            raise ValueError("bytes_per_token_milli must be between 100 and 64000")
        if not 0 <= self.overhead_tokens <= MAX_OVERHEAD_TOKENS:
            raise ValueError(f"overhead_tokens must be between 0 and {MAX_OVERHEAD_TOKENS}")

    def local_cap_nanos(self, arguments: ReserveArguments) -> int | None:
        """The most this call can cost by the ledger's byte cap, or None for an
        unpriced model. The allowance is spent at this, never at an estimate."""
        price = self.prices.get(arguments.model)
        if price is None:
            return None
        return cap_nanos(
            price,
            arguments.request_bytes,
            arguments.max_output_tokens,
            self.bytes_per_token_milli,
            self.overhead_tokens,
        )

    def local_hold_nanos(self, arguments: ReserveArguments) -> int | None:
        """What the ledger would hold for this call, or None for an unpriced model."""
        cap = self.local_cap_nanos(arguments)
        if cap is None or arguments.estimate_nanos is None:
            return cap
        return min(arguments.estimate_nanos, cap)

    def local_charge_nanos(self, entry: JournalEntry, ending: Ending) -> int:
        """What the ledger will charge for this ending, as far as the lane can tell."""
        if ending.settlement is Settlement.REFUND:
            return 0
        usage = ending.usage
        if ending.settlement is Settlement.SETTLE_UNKNOWN:
            if usage is not None and usage.billed_nanos is not None:
                return min(entry.local_hold_nanos, usage.billed_nanos)
            return entry.local_hold_nanos
        assert usage is not None
        if usage.billed_nanos is not None:
            return usage.billed_nanos
        price = self.prices.get(entry.arguments.model)
        assert price is not None, "an allowance entry always has a local price"
        return price.real_cost(
            usage.input_tokens,
            usage.output_tokens,
            usage.cached_input_tokens,
            usage.cache_write_tokens,
        )


def _journal_path(journal_path: pathlib.Path | str) -> pathlib.Path:
    # pathlib reads "" as ".", the working directory: never a journal.
    if journal_path == "" or not isinstance(journal_path, str | os.PathLike):
        raise ValueError("journal_path must be a non-empty path")
    return pathlib.Path(journal_path)


@dataclasses.dataclass(frozen=True)
class AllowanceVerdict:
    admitted: bool
    hold_nanos: int = 0
    denial_reason: DenialReason | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class AllowanceUse:
    nanos: int
    calls: int


class Allowance:
    """The bounded local allowance. Its use is derived from the journal (the
    allowance entries not yet replayed), so it survives a restart of the lane."""

    def __init__(self, policy: OutagePolicy, journal: Journal) -> None:
        assert policy.mode is OutageMode.ALLOWANCE
        self._policy = policy
        self._journal = journal
        self._lock = threading.Lock()

    def used(self) -> AllowanceUse:
        nanos = calls = 0
        for entry in self._journal.pending():
            if entry.source is Source.ALLOWANCE:
                calls += 1
                nanos += (
                    self._open_cost(entry) if _cost_unknown(entry) else entry.local_charge_nanos
                )
        return AllowanceUse(nanos, calls)

    def _open_cost(self, entry: JournalEntry) -> int:
        """An open call, or one ended UNKNOWN without a bill, may cost its cap,
        whatever estimate lowered its hold."""
        cap = self._policy.local_cap_nanos(entry.arguments)
        return entry.local_hold_nanos if cap is None else max(cap, entry.local_hold_nanos)

    def take(self, lane: str, arguments: ReserveArguments, trace_id: str = "") -> AllowanceVerdict:
        """Admits one call on the allowance and journals it (fsync'd) before
        answering, or says why not."""
        hold = self._policy.local_hold_nanos(arguments)
        cap = self._policy.local_cap_nanos(arguments)
        if hold is None or cap is None:
            return AllowanceVerdict(
                False,
                denial_reason=DenialReason.LEDGER_UNAVAILABLE,
                message="the ledger is unreachable and the allowance has no price for this model",
            )
        with self._lock:
            use = self.used()
            if use.calls + 1 > self._policy.max_calls:
                return _exhausted(f"all {self._policy.max_calls} allowance calls are used")
            # Admitted at its cap: an estimate lowers the ledger's hold, not
            # what the call may cost, and the allowance bounds the cost.
            if use.nanos + cap > self._policy.max_nanos:
                return _exhausted(
                    f"a call capped at {cap} nanos does not fit the "
                    f"{max(0, self._policy.max_nanos - use.nanos)} nanos left of the allowance"
                )
            entry = JournalEntry(
                lane, arguments, Source.ALLOWANCE, hold, now_text(), trace_id=trace_id
            )
            try:
                self._journal.record_reserve(entry)
            except (JournalError, OSError):
                return _exhausted("the journal cannot take another call")
            return AllowanceVerdict(True, hold_nanos=hold)

    def record_end(self, reservation_id: str, ending: Ending) -> None:
        """Journals how an allowance call ended, with what it will cost."""
        entry = self._journal.entry(reservation_id)
        assert entry is not None and entry.source is Source.ALLOWANCE
        self._journal.record_end(
            reservation_id, ending, self._policy.local_charge_nanos(entry, ending)
        )


def _cost_unknown(entry: JournalEntry) -> bool:
    """Whether nothing says what the call cost: still open, or ended UNKNOWN
    (timed out, cut off, the lane died) without a billed amount. The ledger
    will charge its hold, the estimate when one lowered it, but the provider
    may bill up to the cap: the allowance bounds what may have been spent."""
    ending = entry.ending
    if ending is None:
        return True
    usage = ending.usage
    return ending.settlement is Settlement.SETTLE_UNKNOWN and (
        usage is None or usage.billed_nanos is None
    )


def _exhausted(message: str) -> AllowanceVerdict:
    return AllowanceVerdict(
        False,
        denial_reason=DenialReason.ALLOWANCE_EXHAUSTED,
        message=f"the ledger is unreachable and {message}",
    )
