"""Random walks through the real gRPC server, checked after every step.

A hypothesis RuleBasedStateMachine drives PutLane (limit and expire_charge
changes), Reserve (sizes, estimates, ttls, repeats, conflicts), Settle
(SUCCEEDED, UNKNOWN, repeats), Refund and clock moves from one microsecond to
past the window, on a fresh lane per example. The test keeps its own model of
the contract and, after each step, holds the server to:

(a) GetBalance equals a replay of ALL the lane's events from ListEvents at the
    current clock, and equals the model's balance. The replay is written here
    from the contract (spent = sum of amounts with now - window < reserved_at
    <= now; an open hold past its deadline counts as its expire charge); it
    does not use ledger_service.domain.window.
(b) No admitted Reserve left spent above the limit: each `reserved` event's
    spent_after_nanos equals the replay just after it and is <= its limit.
(c) Refunds charge 0; no charge exceeds its hold (and so its cap) unless it
    came from a SUCCEEDED usage.

Every answer is also compared with the model: decisions, holds, caps, exact
retry_after, charges, error codes, and repeats returning the first answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction
from typing import Any

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import event as note_case
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

# The default max_charge_multiple of a lane (README): a SUCCEEDED charge above
# this many times the booking's cap is refused.
DEFAULT_MAX_CHARGE_MULTIPLE = 100

SECOND_US = 1_000_000
WINDOW_US = 3_600 * SECOND_US
HOLD_TTL_US = 60 * SECOND_US
PRICE_IN = 100_000
PRICE_OUT = 400_000
BYTES_PER_TOKEN = Fraction(7, 2)
LIMITS_NANOS = (2_000, 5_000, 10_000, 20_000)
# Clock moves: a microsecond, a deadline, half a window, and around a whole one.
ADVANCES_US = (
    1,
    1_000,
    SECOND_US,
    59 * SECOND_US,
    HOLD_TTL_US,
    1_800 * SECOND_US,
    WINDOW_US - 1,
    WINDOW_US,
    WINDOW_US + 1,
)
# Far apart, so that each example's lane lives in its own stretch of time.
EXAMPLE_SPACING_US = 10 * WINDOW_US
MACHINE_SETTINGS = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
_lane_numbers = itertools.count()


def cap_of(request_bytes: int, max_output_tokens: int) -> int:
    """The contract's cap, written from the formula with exact fractions."""
    tokens_in = math.ceil(Fraction(request_bytes) / BYTES_PER_TOKEN)
    return math.ceil(Fraction(tokens_in * PRICE_IN, 1_000_000)) + math.ceil(
        Fraction(max_output_tokens * PRICE_OUT, 1_000_000)
    )


def real_cost(price: tuple[int, int], input_tokens: int, output_tokens: int) -> int:
    return math.ceil(Fraction(input_tokens * price[0], 1_000_000)) + math.ceil(
        Fraction(output_tokens * price[1], 1_000_000)
    )


@dataclasses.dataclass
class ModelBooking:
    reservation_id: str
    arguments: dict[str, Any]
    admitted: bool
    hold_nanos: int
    reserved_at_us: int
    expires_at_us: int
    expire_charge_hold: bool
    price: tuple[int, int]
    first_answer: Any
    # open, settled, unknown, refunded, expired, rejected
    state: str
    amount_nanos: int
    # The content and answer of the settle or refund that last ended it.
    ending: tuple[Any, ...] | None = None
    ending_answer: Any = None
    # Settle contents that were answered before a later correction.
    earlier_settles: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)

    def effective_state(self, now_us: int) -> str:
        if self.state == "open" and now_us >= self.expires_at_us:
            return "expired"
        return self.state

    def amount_at(self, now_us: int) -> int:
        if self.state == "open" and now_us >= self.expires_at_us:
            return self.hold_nanos if self.expire_charge_hold else 0
        return self.amount_nanos


@dataclasses.dataclass
class ReplayedBooking:
    reserved_at_us: int
    expires_at_us: int
    hold_nanos: int
    expire_charge_hold: bool
    amount_nanos: int
    ended: bool = False


@dataclasses.dataclass
class Replay:
    """The lane rebuilt from its events alone."""

    limit_nanos: int = 0
    window_us: int = 0
    expire_charge_hold: bool = True
    bookings: dict[str, ReplayedBooking] = dataclasses.field(default_factory=dict)

    def apply(self, event: Any) -> None:
        if event.kind == "lane_configured":
            self.limit_nanos = event.policy.limit_nanos
            self.window_us = micros(event.policy.window)
            self.expire_charge_hold = event.policy.expire_charge != pb.ZERO
        elif event.kind == "reserved":
            assert event.reservation_id not in self.bookings, event
            assert event.amount_nanos == event.hold_nanos <= event.cap_nanos, event
            self.bookings[event.reservation_id] = ReplayedBooking(
                reserved_at_us=micros(event.reserved_at),
                expires_at_us=micros(event.expires_at),
                hold_nanos=event.hold_nanos,
                expire_charge_hold=self.expire_charge_hold,
                amount_nanos=event.amount_nanos,
            )
        elif event.kind == "denied":
            assert event.amount_nanos == 0, event
        elif event.kind in ("settled", "refunded", "expired"):
            booking = self.bookings[event.reservation_id]
            check_ending(event, booking)
            booking.amount_nanos = event.amount_nanos
            booking.ended = True
        else:
            raise AssertionError(f"an event kind this walk never causes: {event.kind}")

    def totals(self, now_us: int) -> tuple[int, int, int]:
        """(held, charged, open bookings) at now_us, from the contract's formula."""
        held = charged = open_count = 0
        for booking in self.bookings.values():
            if not now_us - self.window_us < booking.reserved_at_us <= now_us:
                continue
            if not booking.ended and now_us < booking.expires_at_us:
                held += booking.amount_nanos
                open_count += 1
            elif not booking.ended:
                charged += booking.hold_nanos if booking.expire_charge_hold else 0
            else:
                charged += booking.amount_nanos
        return held, charged, open_count


def check_ending(event: Any, booking: ReplayedBooking) -> None:
    """(c): refunds charge 0; only a SUCCEEDED usage may charge above the hold."""
    if event.kind == "refunded":
        assert event.amount_nanos == 0, event
    elif event.kind == "expired":
        assert event.amount_nanos == (booking.hold_nanos if booking.expire_charge_hold else 0)
    elif event.outcome != pb.SUCCEEDED:
        assert event.outcome == pb.UNKNOWN, event
        assert event.amount_nanos <= booking.hold_nanos, event


def micros(value: Any) -> int:
    return int(value.seconds) * SECOND_US + int(value.nanos) // 1000


def rpc_code(call: Any) -> tuple[Any, grpc.StatusCode]:
    """(answer, OK) or (None, the error's code)."""
    try:
        return call(), grpc.StatusCode.OK
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return None, error.code()


class LedgerMachine(RuleBasedStateMachine):
    harness: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.lane = ""
        self.now_us = 0
        self.limit_nanos = LIMITS_NANOS[-1]
        self.expire_charge_hold = True
        self.bookings: dict[str, ModelBooking] = {}
        self.ids = itertools.count()
        self.replay = Replay()
        self.last_seq = 0

    # Model ----------------------------------------------------------------------

    def in_window(self, booking: ModelBooking) -> bool:
        return booking.admitted and (
            self.now_us - WINDOW_US < booking.reserved_at_us <= self.now_us
        )

    def model_totals(self) -> tuple[int, int, int]:
        held = charged = open_count = 0
        for booking in self.bookings.values():
            if not self.in_window(booking):
                continue
            if booking.effective_state(self.now_us) == "open":
                held += booking.amount_nanos
                open_count += 1
            else:
                charged += booking.amount_at(self.now_us)
        return held, charged, open_count

    def check_balance(self, balance: Any) -> None:
        held, charged, open_count = self.model_totals()
        spent = held + charged
        assert (balance.lane, balance.limit_nanos) == (self.lane, self.limit_nanos)
        assert (balance.held_nanos, balance.charged_nanos) == (held, charged), balance
        assert balance.spent_nanos == spent
        assert balance.available_nanos == self.limit_nanos - spent
        assert balance.overrun_nanos == max(0, spent - self.limit_nanos)
        assert balance.open_bookings == open_count
        assert micros(balance.as_of) == self.now_us

    def retry_after_us(self, needed_nanos: int) -> int:
        freed = 0
        for booking in sorted(
            (b for b in self.bookings.values() if self.in_window(b)),
            key=lambda b: b.reserved_at_us,
        ):
            freed += booking.amount_at(self.now_us)
            if freed >= needed_nanos:
                return booking.reserved_at_us + WINDOW_US
        raise AssertionError("a hold within the limit always fits once the window empties")

    def pick(self, index: int) -> ModelBooking:
        """Half the time one of the three latest bookings, so that moves pile up on
        the same booking (settle, then refund, then settle again) often enough."""
        everything = list(self.bookings.values())
        if index % 2 == 0:
            return everything[-1 - (index // 2) % min(3, len(everything))]
        return everything[(index // 2) % len(everything)]

    def expire_if_due(self, booking: ModelBooking) -> None:
        """A move on a booking past its deadline finds it expired."""
        if booking.effective_state(self.now_us) == "expired" and booking.state == "open":
            booking.amount_nanos = booking.amount_at(self.now_us)
            booking.state = "expired"

    # Rules ----------------------------------------------------------------------

    @initialize()
    def fresh_lane(self) -> None:
        number = next(_lane_numbers)
        self.lane = f"walk-{number}"
        # Past the clock too: a long walk may have moved it beyond its own stretch,
        # and a ledger's time never runs back before its last event.
        start_us = max(
            self.harness.START_US + number * EXAMPLE_SPACING_US,
            self.harness.now_us() + EXAMPLE_SPACING_US,
        )
        self.now_us = self.harness.set_time_us(start_us)
        self.put_lane_policy(self.limit_nanos, True)

    def put_lane_policy(self, limit_nanos: int, expire_charge_hold: bool) -> None:
        self.harness.make_lane(
            self.lane,
            limit_nanos=limit_nanos,
            window_seconds=WINDOW_US // SECOND_US,
            hold_ttl_seconds=HOLD_TTL_US // SECOND_US,
            expire_charge=pb.HOLD if expire_charge_hold else pb.ZERO,
        )
        self.limit_nanos = limit_nanos
        self.expire_charge_hold = expire_charge_hold

    @rule(limit_nanos=st.sampled_from(LIMITS_NANOS), expire_charge_hold=st.booleans())
    def put_lane(self, limit_nanos: int, expire_charge_hold: bool) -> None:
        self.put_lane_policy(limit_nanos, expire_charge_hold)

    @rule(
        request_bytes=st.integers(0, 200_000),
        max_output_tokens=st.integers(0, 4_000),
        estimate_nanos=st.none() | st.integers(0, 25_000),
        ttl_us=st.none() | st.sampled_from([1, SECOND_US, 30 * SECOND_US, HOLD_TTL_US]),
    )
    def reserve(
        self,
        request_bytes: int,
        max_output_tokens: int,
        estimate_nanos: int | None,
        ttl_us: int | None,
    ) -> None:
        self.reserve_one(request_bytes, max_output_tokens, estimate_nanos, ttl_us)

    @rule(
        request_bytes=st.integers(50_000, 200_000),
        estimate_nanos=st.integers(500, 5_000),
        ttl_us=st.sampled_from([SECOND_US, HOLD_TTL_US]),
    )
    def reserve_with_an_estimate(
        self, request_bytes: int, estimate_nanos: int, ttl_us: int
    ) -> None:
        """The common case, drawn twice as often: a lane that knows its typical cost."""
        self.reserve_one(request_bytes, 500, estimate_nanos, ttl_us)

    def reserve_one(
        self,
        request_bytes: int,
        max_output_tokens: int,
        estimate_nanos: int | None,
        ttl_us: int | None,
    ) -> None:
        reservation_id = f"r{next(self.ids)}"
        arguments = {
            "lane": self.lane,
            "request_bytes": request_bytes,
            "max_output_tokens": max_output_tokens,
            "estimate_nanos": estimate_nanos,
            "ttl_us": ttl_us,
        }
        answer = self.harness.reserve(reservation_id, **arguments)
        cap = cap_of(request_bytes, max_output_tokens)
        hold = cap if estimate_nanos is None else min(estimate_nanos, cap)
        held, charged, _ = self.model_totals()
        available = self.limit_nanos - held - charged
        assert (answer.cap_nanos, answer.hold_nanos) == (cap, hold), answer
        assert micros(answer.reserved_at) == self.now_us
        admitted = hold <= available
        decision = pb.Decision.Name(answer.decision)
        note_case(f"reserve: {decision} {pb.DenialReason.Name(answer.denial_reason)}")
        if admitted:
            assert answer.decision == pb.ADMITTED, (answer, available)
            expires = self.now_us + (HOLD_TTL_US if ttl_us is None else ttl_us)
            assert micros(answer.expires_at) == expires
        elif hold > self.limit_nanos:
            assert answer.decision == pb.DENIED
            assert answer.denial_reason == pb.HOLD_EXCEEDS_LIMIT
            assert not answer.HasField("retry_after")
        else:
            assert answer.decision == pb.DENIED, (answer, available)
            assert answer.denial_reason == pb.BUDGET_EXHAUSTED
            assert micros(answer.retry_after) == self.retry_after_us(hold - available)
        self.bookings[reservation_id] = ModelBooking(
            reservation_id=reservation_id,
            arguments=arguments,
            admitted=admitted,
            hold_nanos=hold,
            reserved_at_us=self.now_us,
            expires_at_us=micros(answer.expires_at) if admitted else 0,
            expire_charge_hold=self.expire_charge_hold,
            price=(PRICE_IN, PRICE_OUT),
            first_answer=answer,
            state="open" if admitted else "rejected",
            amount_nanos=hold if admitted else 0,
        )
        self.check_balance(answer.balance)

    @rule()
    def reserve_above_the_lane_hold_ttl(self) -> None:
        failure = self.harness.fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda: self.harness.reserve("too-long", lane=self.lane, ttl_us=HOLD_TTL_US + 1),
        )
        assert failure.field == "ttl"

    @precondition(lambda self: self.bookings)
    @rule(index=st.integers(0, 10**6))
    def repeat_reserve(self, index: int) -> None:
        booking = self.pick(index)
        answer = self.harness.reserve(booking.reservation_id, **booking.arguments)
        # The first answer, saying it repeats it.
        assert answer.already_reserved and not booking.first_answer.already_reserved
        answer.already_reserved = False
        assert answer == booking.first_answer

    @precondition(lambda self: self.bookings)
    @rule(index=st.integers(0, 10**6))
    def reuse_an_id_with_other_arguments(self, index: int) -> None:
        booking = self.pick(index)
        changed = {
            **booking.arguments,
            "max_output_tokens": booking.arguments["max_output_tokens"] + 1,
        }
        self.harness.fails(
            grpc.StatusCode.ALREADY_EXISTS,
            lambda: self.harness.reserve(booking.reservation_id, **changed),
        )

    @precondition(lambda self: self.bookings)
    @rule(
        index=st.integers(0, 10**6),
        input_tokens=st.integers(0, 150_000),
        output_tokens=st.integers(0, 4_000),
        billed_nanos=st.none() | st.integers(0, 30_000),
    )
    def settle_succeeded(
        self, index: int, input_tokens: int, output_tokens: int, billed_nanos: int | None
    ) -> None:
        content = (pb.SUCCEEDED, input_tokens, output_tokens, billed_nanos)
        self.settle(self.pick(index), content)

    @precondition(lambda self: self.bookings)
    @rule(index=st.integers(0, 10**6), billed_nanos=st.none() | st.integers(0, 30_000))
    def settle_unknown(self, index: int, billed_nanos: int | None) -> None:
        self.settle(self.pick(index), (pb.UNKNOWN, 0, 0, billed_nanos))

    @precondition(
        lambda self: any(b.ending and b.ending[0] != "refund" for b in self.bookings.values())
    )
    @rule(index=st.integers(0, 10**6))
    def repeat_settle(self, index: int) -> None:
        ended = [b for b in self.bookings.values() if b.ending and b.ending[0] != "refund"]
        booking = ended[index % len(ended)]
        assert booking.ending is not None
        self.settle(booking, booking.ending)

    def settle(self, booking: ModelBooking, content: tuple[Any, ...]) -> None:
        outcome, input_tokens, output_tokens, billed_nanos = content
        answer, code = rpc_code(
            lambda: self.harness.settle(
                booking.reservation_id,
                outcome,
                lane=self.lane,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                billed_nanos=billed_nanos,
            )
        )
        self.expire_if_due(booking)
        state = booking.state
        note_case(f"settle {pb.Outcome.Name(outcome)} on {state}: {code.name}")
        if state in ("rejected", "refunded"):
            assert code is FAILED_PRECONDITION, (state, code)
            return
        if booking.ending == content:
            assert answer == booking.ending_answer, "a repeat returns the first answer"
            return
        if state == "settled":
            if content in booking.earlier_settles:
                # A repeat of a settle that a later success corrected: the contract
                # does not say which answer it gets, only that nothing changes.
                assert code in (grpc.StatusCode.OK, FAILED_PRECONDITION), code
            else:
                assert code is FAILED_PRECONDITION, code
            return
        if outcome == pb.UNKNOWN and state in ("unknown", "expired"):
            # Late news of nothing: the current charge stands.
            assert code is grpc.StatusCode.OK, (state, content, code)
            assert (answer.charged_nanos, answer.state) == (
                booking.amount_nanos,
                pb.SETTLED_UNKNOWN if state == "unknown" else pb.EXPIRED,
            )
            self.check_balance(answer.balance)
            return
        if outcome == pb.SUCCEEDED and input_tokens == 0 and billed_nanos is None:
            # No evidence of a call: refused, nothing changes.
            assert code is grpc.StatusCode.INVALID_ARGUMENT, code
            return
        if output_tokens > booking.arguments["max_output_tokens"]:
            # More output than the provider was allowed to write: refused, nothing changes.
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (state, content, code)
            return
        cap = cap_of(booking.arguments["request_bytes"], booking.arguments["max_output_tokens"])
        if outcome == pb.SUCCEEDED:
            charge = (
                billed_nanos
                if billed_nanos is not None
                else real_cost(booking.price, input_tokens, output_tokens)
            )
            if charge > DEFAULT_MAX_CHARGE_MULTIPLE * cap:
                # No request of its size could cost that: refused, nothing changes.
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (state, content, code, cap)
                return
            assert code is grpc.StatusCode.OK, (state, content, code)
            booking.state = "settled"
        else:
            assert code is grpc.StatusCode.OK, (state, content, code)
            charge = (
                booking.hold_nanos
                if billed_nanos is None
                else min(booking.hold_nanos, billed_nanos)
            )
            booking.state = "unknown"
        assert answer.charged_nanos == charge, (answer, content, booking)
        assert answer.state == (pb.SETTLED if outcome == pb.SUCCEEDED else pb.SETTLED_UNKNOWN)
        booking.amount_nanos = charge
        if booking.ending is not None:
            booking.earlier_settles.append(booking.ending)
        booking.ending, booking.ending_answer = content, answer
        self.check_balance(answer.balance)

    @precondition(lambda self: self.bookings)
    @rule(index=st.integers(0, 10**6), status=st.sampled_from([403, 429, 0]))
    def refund(self, index: int, status: int) -> None:
        booking = self.pick(index)
        answer, code = rpc_code(
            lambda: self.harness.refund(
                booking.reservation_id, status, lane=self.lane, reason="" if status else "unsent"
            )
        )
        self.expire_if_due(booking)
        note_case(f"refund on {booking.state}: {code.name}")
        if booking.state in ("rejected", "settled", "unknown"):
            # The contract: a refund after a settle (UNKNOWN included) contradicts it.
            assert code is FAILED_PRECONDITION, (booking.state, code)
            return
        assert code is grpc.StatusCode.OK, (booking.state, code)
        if booking.state == "refunded":
            assert answer == booking.ending_answer, "a repeated refund returns the first answer"
            return
        booking.state = "refunded"
        booking.amount_nanos = 0
        booking.ending, booking.ending_answer = ("refund",), answer
        self.check_balance(answer.balance)

    @rule(length_us=st.sampled_from(ADVANCES_US))
    def advance(self, length_us: int) -> None:
        self.now_us = self.harness.advance_us(length_us)

    @precondition(lambda self: any(b.admitted for b in self.bookings.values()))
    @rule(ages_out=st.booleans(), offset_us=st.sampled_from([-1, 0, 1]))
    def go_to_an_edge(self, ages_out: bool, offset_us: int) -> None:
        """Sets the clock next to the next deadline or age-out edge, to the microsecond."""
        edges = sorted(
            (b.reserved_at_us + WINDOW_US) if ages_out else b.expires_at_us
            for b in self.bookings.values()
            if b.admitted
        )
        upcoming = [edge + offset_us for edge in edges if edge + offset_us > self.now_us]
        if upcoming:
            self.now_us = self.harness.set_time_us(upcoming[0])

    # Invariants -------------------------------------------------------------------

    @invariant()
    def balance_equals_the_replay_of_every_event(self) -> None:
        if not self.lane:
            return
        new_events = self.harness.events(self.lane, after_seq=self.last_seq)
        for event in new_events:
            self.replay.apply(event)
            self.last_seq = event.seq
            if event.kind == "reserved":
                # (b): the balance right after an admission, replayed at its instant.
                held, charged, _ = self.replay.totals(micros(event.occurred_at))
                assert event.spent_after_nanos == held + charged, event
                assert event.limit_nanos == self.replay.limit_nanos
                assert event.spent_after_nanos <= event.limit_nanos, event
        balance = self.harness.balance(self.lane)
        held, charged, open_count = self.replay.totals(self.now_us)
        assert (balance.held_nanos, balance.charged_nanos) == (held, charged), (
            balance,
            self.replay,
        )
        assert balance.open_bookings == open_count
        assert balance.limit_nanos == self.replay.limit_nanos
        self.check_balance(balance)


def test_ledger_state_machine(ledger_harness: Any) -> None:
    machine = type("BoundLedgerMachine", (LedgerMachine,), {"harness": ledger_harness})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)
