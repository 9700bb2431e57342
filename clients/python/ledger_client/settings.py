"""Every limit and knob of the lane client, in one frozen object passed explicitly.

Each field names its unit last. The defaults are chosen for the critical path of
one model call: the ledger sits in front of every paid call, so what it may cost
in time is fixed and small.
"""

from __future__ import annotations

import dataclasses

# Why 0.25 s: in the recall jam (docs/semantics.md) a step had 2.0 s in total, lookups ate
# 0.8 s, a retry kept 1.0 s, and the model call itself was left about 0.3 s while
# large requests needed 0.4 to 0.5 s. A ledger call that can take as long as the
# model call is a second outage. A healthy ledger answers in milliseconds; 0.25 s
# covers a cold connection and a slow commit, and past it the lane is better
# served by its outage mode than by waiting.
DEFAULT_DEADLINE_SECONDS = 0.25
# How long close() lets the calls under way (model_call blocks, their Settles
# and Refunds, refunds of unanswered Reserves) finish before it cancels them:
# one cut off may leave a hold booked until it expires. The Node client's
# DEFAULT_CLOSE_GRACE_MS.
DEFAULT_CLOSE_GRACE_SECONDS = 5.0
# After the grace, close() keeps the journal open this long at most for the
# model_call blocks it cut off to journal their endings: with the channel closed
# a cut-off Settle or Reserve fails and is journaled within milliseconds, but a
# block still in its model call may never return, and close() must. A block
# ending later finds the journal closed; its hold expires. The Node client's
# CLOSE_JOURNAL_WAIT_MS.
CLOSE_JOURNAL_WAIT_SECONDS = 1.0
# The longest deadline a call may have, in the settings or given to one call.
MAX_DEADLINE_SECONDS = 60
# The shortest duration of the journal's replay (its RPCs' deadline, an
# attempt's length, the pause between attempts): the Node client's 1 ms, the
# least its timers keep.
MIN_REPLAY_SECONDS = 0.001
# Settle and Refund are idempotent, so an unconfirmed one is sent again with the
# same content; without this an ended call would expire at its hold. Three
# attempts, 20 ms and then 40 ms apart: the Node client's DEFAULT_END_ATTEMPTS
# and END_RETRY_PAUSE_MS (clients/node/lib/client.js).
DEFAULT_END_ATTEMPTS = 3
END_RETRY_PAUSE_SECONDS = 0.020
# A quarter of the server's max_concurrent_rpcs (256): the Node client's
# DEFAULT_MAX_CALLS_IN_FLIGHT.
DEFAULT_MAX_CALLS_IN_FLIGHT = 64
# The channel's message limit: every message a lane client sends or reads is
# far below 64 KiB; gRPC takes the limit as a C int and -1 as none at all.
MIN_MESSAGE_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 2**31 - 1
# gRPC's own default longest pause between reconnects.
MAX_RECONNECT_BACKOFF_MS = 120_000
# A page of events: the server's default and most (its default_page_size and
# max_page_size, docs/semantics.md "Input limits"); a larger page is refused
# here, as the server would cut it short in silence. The Node client's
# DEFAULT_PAGE_SIZE and MAX_PAGE_SIZE.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def require_int(value: object, name: str) -> None:
    """A count or an amount is an int (not a bool, a float or a str), as the
    Node client's checks require: TypeError naming the setting, before any
    comparison can fail somewhere deeper."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")


def require_number(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")


def _check_replay_seconds(name: str, value: float, most: int) -> None:
    if not MIN_REPLAY_SECONDS <= value <= most:  # NaN too
        raise ValueError(f"{name} must be in [{MIN_REPLAY_SECONDS}, {most}] seconds")


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    # Deadline of each Reserve, Settle, Refund and GetBalance on the call path.
    deadline_seconds: float = DEFAULT_DEADLINE_SECONDS
    # Deadline of each RPC made by the journal replay, which runs off the call path.
    replay_deadline_seconds: float = 2.0
    # One replay attempt handles at most this many journal entries and stops
    # after this long; the next attempt resumes where it stopped.
    max_replay_entries_per_attempt: int = 100
    max_replay_seconds_per_attempt: float = 10.0
    # How often the background replayer looks at the journal (None: never; call
    # LaneClient.replay_journal yourself).
    replay_interval_seconds: float | None = 5.0
    # The journal refuses new allowance calls past this size (fail closed), and
    # is rotated into an archive file once fully replayed and above rotate size.
    max_journal_bytes: int = 16 * 1024 * 1024
    rotate_journal_bytes: int = 1024 * 1024
    # gRPC channel: message size and how fast a lost connection is retried, so a
    # ledger that comes back is noticed within seconds, not minutes.
    max_message_bytes: int = 1024 * 1024
    initial_reconnect_backoff_ms: int = 100
    max_reconnect_backoff_ms: int = 2000
    # A refund reason sent through end() (a model call's own, CallNotSent's or
    # not_sent's, and a journaled one replayed) is made printable and cut to
    # this many characters (the server takes 1000). Not a limit on refund():
    # its reason is sent as written, refused as the server would refuse it.
    max_reason_length: int = 200
    # A model call's Settle or Refund left unconfirmed (the ledger unreachable, a
    # deadline passed) is sent again, with the same content, up to this many
    # attempts in all, pausing END_RETRY_PAUSE_SECONDS times the attempt number
    # between them (as the Node client does); then it is journaled, or, without a
    # journal, the booking expires at its hold. A model call's unanswered
    # Reserve is sent again by the same count, all its attempts within one
    # deadline_seconds (calls.ModelCall._send_reserve).
    end_attempts: int = DEFAULT_END_ATTEMPTS
    # Calls this client has at the ledger at once. One more waits for a slot up
    # to its deadline, then fails as an overloaded ledger does (LedgerOverloaded,
    # the outage mode). The server runs at most 96 calls of one grant at once
    # (max_calls_per_grant; one more is TooManyCalls): 64 keeps a lone client
    # under it, with room for calls it gave up on that the server still runs.
    max_calls_in_flight: int = DEFAULT_MAX_CALLS_IN_FLIGHT
    # A tail (watch_events) whose stream dropped opens another after the last
    # event seen, pausing as a lost connection is retried (the reconnect
    # backoffs below), for at most this long without a stream that answers;
    # then it raises the last failure. 0: never resumed.
    watch_resume_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "deadline_seconds",
            "replay_deadline_seconds",
            "max_replay_seconds_per_attempt",
            "watch_resume_seconds",
        ):
            require_number(getattr(self, name), name)
        if self.replay_interval_seconds is not None:
            require_number(self.replay_interval_seconds, "replay_interval_seconds")
        for name in (
            "max_replay_entries_per_attempt",
            "max_journal_bytes",
            "rotate_journal_bytes",
            "max_message_bytes",
            "initial_reconnect_backoff_ms",
            "max_reconnect_backoff_ms",
            "max_reason_length",
            "end_attempts",
            "max_calls_in_flight",
        ):
            require_int(getattr(self, name), name)
        if not 0 < self.deadline_seconds <= MAX_DEADLINE_SECONDS:
            raise ValueError(f"deadline_seconds must be in (0, {MAX_DEADLINE_SECONDS}]")
        _check_replay_seconds("replay_deadline_seconds", self.replay_deadline_seconds, 60)
        if not 1 <= self.max_replay_entries_per_attempt <= 10_000:
            raise ValueError("max_replay_entries_per_attempt must be in [1, 10000]")
        _check_replay_seconds(
            "max_replay_seconds_per_attempt", self.max_replay_seconds_per_attempt, 600
        )
        if self.replay_interval_seconds is not None:
            _check_replay_seconds("replay_interval_seconds", self.replay_interval_seconds, 3600)
        if not 0 < self.rotate_journal_bytes <= self.max_journal_bytes <= 1024**3:
            raise ValueError("need 0 < rotate_journal_bytes <= max_journal_bytes <= 1 GiB")
        if not 1 <= self.max_reason_length <= 1000:
            raise ValueError("max_reason_length must be in [1, 1000]")
        if not 1 <= self.end_attempts <= 10:
            raise ValueError("end_attempts must be in [1, 10]")
        if not 1 <= self.max_calls_in_flight <= 10_000:
            raise ValueError("max_calls_in_flight must be in [1, 10000]")
        if not 0 <= self.watch_resume_seconds <= 3600:  # NaN too
            raise ValueError("watch_resume_seconds must be in [0, 3600]")
        self._check_channel()

    def _check_channel(self) -> None:
        """A message limit every call's answer fits (below it each call failed
        as LedgerOverloaded, forever) and reconnect pauses that are pauses."""
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be in [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}]"
            )
        if not 1 <= self.initial_reconnect_backoff_ms <= self.max_reconnect_backoff_ms:
            raise ValueError("need 1 <= initial_reconnect_backoff_ms <= max_reconnect_backoff_ms")
        if self.max_reconnect_backoff_ms > MAX_RECONNECT_BACKOFF_MS:
            raise ValueError(f"max_reconnect_backoff_ms must be at most {MAX_RECONNECT_BACKOFF_MS}")
