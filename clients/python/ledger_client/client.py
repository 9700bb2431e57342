"""LaneClient: one per lane, one channel, short deadlines on every call."""

from __future__ import annotations

import contextvars
import datetime
import functools
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Generator, Iterator
from types import TracebackType
from typing import Any, TypeVar

import grpc

from ledger_client import convert
from ledger_client.bookings import (
    MAX_AMOUNT_NANOS,
    Balance,
    BookingState,
    Refunded,
    Reservation,
    ReserveArguments,
    Settled,
    check_http_status,
    check_name,
    check_range,
    check_refund_reason,
    check_reservation_id,
    new_reservation_id,
)
from ledger_client.calls import BackgroundRefunds, CallGate, CallSupport, ModelCall, RecentIds
from ledger_client.channels import (
    TlsSettings,
    address_host,
    check_grant,
    client_probe_context,
    is_local_address,
    open_channel,
    refuses_client_certificate,
    roots_load,
    serves_tls,
)
from ledger_client.context import payload_bytes
from ledger_client.errors import (
    ClientClosed,
    LedgerError,
    LedgerOverloaded,
    LedgerUnavailable,
    TlsMismatch,
    from_rpc_error,
    invalid_argument,
)
from ledger_client.events import (
    EventPage,
    LedgerEvent,
    Resumption,
    Watches,
    all_pages,
    check_after_seq,
    check_page_size,
    stream_events,
    tail,
)
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_client.journal import Journal
from ledger_client.outage import Allowance, OutageMode, OutagePolicy
from ledger_client.outcomes import Ending, Settlement, Usage
from ledger_client.replay import Replayer, ReplayReport
from ledger_client.settings import (
    CLOSE_JOURNAL_WAIT_SECONDS,
    DEFAULT_CLOSE_GRACE_SECONDS,
    DEFAULT_PAGE_SIZE,
    MAX_DEADLINE_SECONDS,
    ClientSettings,
    require_number,
)

log = logging.getLogger("ledger_client")

_Response = TypeVar("_Response")
# The reason a draining server refuses a call with before doing any work.
SHUTTING_DOWN = "SHUTTING_DOWN"


def new_trace_id() -> str:
    return secrets.token_hex(16)


def current_or_new_trace_id() -> str:
    """The current OpenTelemetry span's trace id when there is one (the lane's
    span, with `opentelemetry-api` installed), else a fresh one."""
    try:
        from ledger_client import tracing
    except ImportError:  # the optional `tracing` extra is not installed
        return new_trace_id()
    return tracing.current_trace_id() or new_trace_id()


def check_trace_id(trace_id: object) -> None:
    """A W3C trace id: 32 lowercase hex digits, not all zero. The ledger
    ignores any other traceparent and records a trace of its own per call,
    so a Reserve and its Settle would no longer share the trace asked for."""
    if not (
        isinstance(trace_id, str)
        and len(trace_id) == 32
        and all(c in "0123456789abcdef" for c in trace_id)
        and trace_id != "0" * 32
    ):
        raise invalid_argument(
            "trace_id", "must be 32 lowercase hex digits, not all zero (a W3C trace id)"
        )


def _traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


# Targets gRPC resolves itself: `dns:///host:port`, `unix:///path`, `ipv4:a,b`, ...
_GRPC_URI_SCHEMES = ("dns", "unix", "xds", "google-c2p")
_GRPC_SCHEMES = (
    "dns:",
    "unix:",
    "unix-abstract:",
    "ipv4:",
    "ipv6:",
    "vsock:",
    "xds:",
    "google-c2p:",
)


def check_address(address: object) -> None:
    """The ledger's HOST:PORT, before a channel is made: an unset variable
    (os.environ.get gives None) failed inside the channel code, naming nothing."""
    if not isinstance(address, str):
        raise TypeError(
            f"address: must be the ledger's HOST:PORT as a string, not {type(address).__name__}"
        )
    if not address.strip():
        raise ValueError("address: is empty; give the ledger's HOST:PORT")
    # What follows gRPC takes and then fails on every call as UNAVAILABLE, or
    # reaches another port (it wraps 99999 to 34463): a lane would run on its
    # outage mode for good. Its own schemes (dns:, ipv4:, unix:, ...) pass.
    if address != address.lstrip():
        raise ValueError("address: starts with a space; give the ledger's HOST:PORT")
    scheme, separator, _ = address.partition("://")
    if separator and scheme not in _GRPC_URI_SCHEMES:
        raise ValueError(
            f"address: {scheme[:20]}:// is no gRPC target; give the ledger's HOST:PORT"
        )
    if address.startswith(_GRPC_SCHEMES):
        return
    host, separator, port = address.rstrip().rpartition(":")
    if not separator or (":" in host and not host.endswith("]")):
        return  # no port (gRPC's default, 443), or a bare IPv6 address
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"address: the port must be a number from 1 to 65535, not {port[:20]!r}")


def _check_types(**given: tuple[object, type]) -> None:
    """LaneClient's keyword objects: each None or of its type. Otherwise they
    failed deep inside, an AttributeError naming none of them."""
    for name, (value, kind) in given.items():
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}: must be a {kind.__name__}, not {type(value).__name__}")


def check_lane(lane: object) -> None:
    """The lane's name by the ledger's rule for names: InvalidArgument (field
    `lane`) before any call, as for a Reserve's arguments."""
    check_name("lane", lane)


def _request_bytes(request: object) -> int:
    """A payload's bytes as sent, or an int taken as the size. A float or None
    is refused: its JSON text ("7000" for 7000.0) is no size of a request."""
    if isinstance(request, bool | float) or request is None:
        kind = type(request).__name__
        raise TypeError(f"request must be a payload or its size in bytes (an int), not a {kind}")
    if isinstance(request, int):
        return request
    try:
        return len(payload_bytes(request))
    except TypeError as error:  # a value JSON cannot carry
        raise TypeError(f"request: {error}") from None
    except ValueError as error:  # text with no UTF-8 (a lone surrogate)
        raise ValueError(f"request: {error}") from None


def _given_or_new(reservation_id: str | None) -> str:
    """A fresh id only when none was given: an empty one is refused by
    ReserveArguments, as by the Node client, never replaced (a resend with
    it would book twice)."""
    return new_reservation_id() if reservation_id is None else reservation_id


def _micros_of(ttl: datetime.timedelta | None) -> int | None:
    if ttl is None:
        return None
    if not isinstance(ttl, datetime.timedelta):
        raise invalid_argument("ttl", "must be a datetime.timedelta")
    return ttl // datetime.timedelta(microseconds=1)


# gRPC's whole text for a plaintext channel a TLS ledger hung up on, as for a
# server going away: only a handshake of the client's own tells them apart.
_SOCKET_CLOSED = "Socket closed"
# gRPC's handshake texts for a TLS channel that refused the ledger's
# certificate: its chain does not reach root_certificates (or the certificate
# expired), or it does not carry the name checked. No outage says either.
_CERTIFICATE_UNTRUSTED = "CERTIFICATE_VERIFY_FAILED"
_NAME_NOT_IN_CERTIFICATE = "Hostname Verification Check failed"


class LaneClient:
    """The lane's side of the ledger. Build one per lane and keep it: it holds
    one channel (thread-safe), the outage journal and its replayer.

    Every RPC has its own deadline, `settings.deadline_seconds` (0.25 s by
    default; see settings.py for why), or the one a call passes.
    """

    def __init__(
        self,
        address: str,
        lane: str,
        *,
        grant: str | None = None,
        tls: TlsSettings | None = None,
        outage: OutagePolicy | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        check_address(address)
        check_lane(lane)
        _check_types(grant=(grant, str), tls=(tls, TlsSettings), outage=(outage, OutagePolicy),
                     settings=(settings, ClientSettings))  # fmt: skip
        if grant is not None:
            check_grant(grant)
        self.lane = lane
        self.settings = settings or ClientSettings()
        self.outage = outage or OutagePolicy.deny()
        self._grant = grant
        self._journal: Journal | None = None
        self._replayer: Replayer | None = None
        self._allowance: Allowance | None = None
        self._refunds = BackgroundRefunds()
        self._model_call_ids = RecentIds()
        self._slots = threading.BoundedSemaphore(self.settings.max_calls_in_flight)
        self._gate = CallGate()
        # The lane's event streams open now (watch_events): close() ends them.
        self._watches = Watches()
        # The client as the calls it already admitted reach it (a block's
        # Settle, a background refund, a replay): never refused while closing.
        self._admitted = _Admitted(self)
        self._closed = False
        # Held while a call starts and while close() closes the channel: no call
        # ever starts on a closed channel (with the tracing interceptor grpcio
        # builds each call's handle on the channel anew, and on a closed one
        # that is a segmentation fault, not an error).
        self._starting = threading.Lock()
        self._address = address
        self._tls = tls
        # The mutual-TLS probe's handshake, built at its first use (_tls_refused).
        self._client_probe: ssl.SSLContext | None = None
        # Whether tls.root_certificates load, asked at the first TLS failure.
        self._roots_load: bool | None = None
        if grant is not None and tls is None and not is_local_address(address):
            # Once per client: a grant is a bearer credential, readable on the wire.
            log.warning(
                "ledger_client: the grant for lane %s goes to %s without TLS: it travels "
                "unencrypted (pass tls=TlsSettings(...))",
                lane,
                address,
            )
        self._channel = _traced(open_channel(address, tls, self.settings), address)
        try:
            self._stub = pb_grpc.LedgerStub(self._channel)
            self._open_journal()
        except BaseException:
            self._channel.close()
            raise

    def _open_journal(self) -> None:
        if self.outage.journal_path is None:
            return
        self._journal = Journal(
            self.outage.journal_path,
            self.lane,
            max_bytes=self.settings.max_journal_bytes,
            rotate_bytes=self.settings.rotate_journal_bytes,
        )
        self._replayer = Replayer(self._admitted, self._journal, self.settings)
        if self.outage.mode is OutageMode.ALLOWANCE:
            self._allowance = Allowance(self.outage, self._journal)
        if self.settings.replay_interval_seconds is not None:
            self._replayer.start(self.settings.replay_interval_seconds)

    def close(self, grace_seconds: float = DEFAULT_CLOSE_GRACE_SECONDS) -> None:
        """Refuses new calls at once (ClientClosed), stops the replayer, waits
        up to `grace_seconds` for the calls under way (model_call blocks with
        their Settles and Refunds, other RPCs, refunds of unanswered Reserves)
        to finish, then closes the channel, cancelling what is left
        (ClientClosed), and the journal. Idempotent. Called inside a
        model_call block, it does not wait for that block, which ends its
        booking as usual: the channel and journal close as it leaves."""
        require_number(grace_seconds, "grace_seconds")
        if not 0 <= grace_seconds <= MAX_DEADLINE_SECONDS:  # NaN too; as the Node client's graceMs
            raise ValueError(f"grace_seconds must be in [0, {MAX_DEADLINE_SECONDS}]")
        self._gate.close()
        # A tail never ends by itself: it ends now, not at the grace.
        self._watches.close()
        if self._replayer is not None:
            self._replayer.stop()
        end = time.monotonic() + grace_seconds
        own = self._gate.enclosing()
        self._gate.wait(grace_seconds, keep=len(own))
        self._refunds.wait(max(end - time.monotonic(), 0.0))
        if own:
            self._gate.defer(own, self._close_channel)
            return
        self._close_channel()

    def _close_channel(self) -> None:
        """The end of close(): calls still under way are cut off. The journal
        stays open for the blocks cut off to journal their endings (a cut-off
        Reserve, its refund in doubt), at most CLOSE_JOURNAL_WAIT_SECONDS."""
        with self._starting:
            self._closed = True
            # Calls still under way are cut off; later ones never start.
            self._channel.close()
        if self._journal is not None:
            self._gate.wait_blocks(CLOSE_JOURNAL_WAIT_SECONDS)
            self._journal.close()

    def __enter__(self) -> LaneClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def journal(self) -> Journal | None:
        return self._journal

    # The RPCs ------------------------------------------------------------------

    def _deadline(self, deadline_seconds: float | None) -> float:
        """A call's own deadline, in the range the settings allow; None: the settings'."""
        if deadline_seconds is None:
            return self.settings.deadline_seconds
        if (
            isinstance(deadline_seconds, bool)
            or not isinstance(deadline_seconds, int | float)
            or not 0 < deadline_seconds <= MAX_DEADLINE_SECONDS
        ):
            raise invalid_argument(
                "deadline_seconds", f"must be a number of seconds in (0, {MAX_DEADLINE_SECONDS}]"
            )
        return float(deadline_seconds)

    def _invoke(
        self,
        method: grpc.UnaryUnaryMultiCallable[Any, _Response],
        request: object,
        deadline_seconds: float | None,
        trace_id: str,
    ) -> _Response:
        """One RPC, counted for close(). One made for a call already under way
        (through `_Admitted`: a block's Settle, a refund, a replay) goes on
        while the client closes; any other is refused then."""
        if _ADMITTED.get():
            self._gate.join()
        else:
            self._gate.admit()  # ClientClosed once closing
        try:
            return self._invoke_counted(method, request, deadline_seconds, trace_id)
        finally:
            self._gate.done()

    def _metadata(self, trace_id: str) -> tuple[tuple[str, str], ...]:
        """A call's headers: the grant, and the caller's trace when it has one."""
        metadata: list[tuple[str, str]] = []
        if self._grant is not None:
            metadata.append(("authorization", f"Bearer {self._grant}"))
        if trace_id:
            metadata.append(("traceparent", _traceparent(trace_id)))
        return tuple(metadata)

    def _invoke_counted(
        self,
        method: grpc.UnaryUnaryMultiCallable[Any, _Response],
        request: object,
        deadline_seconds: float | None,
        trace_id: str,
    ) -> _Response:
        metadata = self._metadata(trace_id)
        timeout = self._deadline(deadline_seconds)
        started = time.monotonic()
        if not self._slots.acquire(timeout=timeout):
            limit = self.settings.max_calls_in_flight
            raise LedgerOverloaded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "",
                f"this client already has {limit} calls at the ledger (max_calls_in_flight), "
                "none of which ended within the deadline",
            )
        try:
            try:
                return self._send(method, request, metadata, started + timeout)
            except LedgerUnavailable as refused:
                # A draining replica did no work (SHUTTING_DOWN): once more, in
                # the time left, where the channel reaches another replica.
                if refused.reason != SHUTTING_DOWN or time.monotonic() >= started + timeout:
                    raise
                return self._send(method, request, metadata, started + timeout)
        finally:
            self._slots.release()

    def _send(
        self,
        method: grpc.UnaryUnaryMultiCallable[Any, _Response],
        request: object,
        metadata: tuple[tuple[str, str], ...],
        deadline: float,
    ) -> _Response:
        try:
            with self._starting:
                if self._closed:
                    # A call that waited for a slot past close()'s grace: the
                    # lane's own doing, not an outage.
                    raise ClientClosed("the lane client closed: the call was not sent")
                call = method.future(
                    request,
                    timeout=max(deadline - time.monotonic(), 0.001),
                    metadata=metadata,
                    wait_for_ready=False,
                )
            return call.result()
        except grpc.RpcError as error:
            if self._closed and isinstance(error, grpc.Call):
                # close() cancelled it once its grace was over.
                raise ClientClosed(
                    "the lane client closed while the call was under way: "
                    "the ledger may have applied it",
                    may_have_applied=True,
                ) from error
            raise self._mistaken_for_outage(from_rpc_error(error), deadline) from error

    def _mistaken_for_outage(self, error: LedgerError, deadline: float) -> LedgerError:
        """A bare UNAVAILABLE that is this client's TLS setting, not an outage:
        TlsMismatch naming what to fix (see _tls_refused for a TLS channel). A
        plaintext channel's "Socket closed" is TlsMismatch when the ledger
        answers a TLS handshake, asked in the call's time left. Asked anew each
        time, never remembered: the server behind the address can change (a TLS
        ledger restarted as plaintext, a proxy), and a remembered answer would
        then turn a real outage into TlsMismatch and stop the lane's allowance."""
        if error.code is not grpc.StatusCode.UNAVAILABLE or error.reason:
            return error
        if self._tls is not None:
            return self._tls_refused(error, deadline)
        if not self._probed(error, deadline, serves_tls):
            return error
        return self._mismatch(
            error,
            "serves TLS and this client speaks plaintext: pass tls=TlsSettings(...) "
            "(root_certificates, and certificate_chain and private_key if it demands a "
            "client certificate)",
        )

    def _tls_refused(self, error: LedgerError, deadline: float) -> LedgerError:
        """A TLS channel's failure that is its own settings. gRPC's handshake
        text says when this client refused the ledger's certificate (its CA,
        its names); a "Socket closed" is the ledger refusing this client's
        certificate (or its lack of one) when a TLS 1.3 handshake with it, in
        the call's time left, is refused too (channels.refuses_client_certificate)."""
        assert self._tls is not None
        tls = self._tls
        if _CERTIFICATE_UNTRUSTED in error.message:
            detail = error.message.partition(_CERTIFICATE_UNTRUSTED)[2].split(":")[:2]
            roots = "root_certificates" if tls.root_certificates else "the system's roots"
            return self._mismatch(
                error,
                f"has a certificate that {roots} do not trust ({_CERTIFICATE_UNTRUSTED}"
                f"{':'.join(detail).rstrip()}): give root_certificates in TlsSettings the CA "
                "that signed the ledger's certificate",
            )
        if _NAME_NOT_IN_CERTIFICATE in error.message:
            name = tls.server_name or address_host(self._address) or self._address
            given = "server_name" if tls.server_name else "the address"
            return self._mismatch(
                error,
                f"has a certificate that does not carry the name {name!r} ({given}): set "
                "server_name in TlsSettings to a name the certificate carries, or reach the "
                "ledger by one",
            )
        if self._roots_load is None:
            self._roots_load = roots_load(tls)
        if not self._roots_load:
            return self._mismatch(
                error,
                "is not reached: root_certificates in TlsSettings do not load (not PEM "
                "certificates): give the PEM of the CA that signed the ledger's certificate",
            )
        if self._client_probe is None:
            self._client_probe = client_probe_context(tls)
        if self._client_probe is None:
            # Only a client certificate that does not load makes none: gRPC
            # cannot use it either ("Failed to create security handshaker").
            return self._mismatch(
                error,
                "is not reached: certificate_chain and private_key in TlsSettings do not "
                "load as a pair (a key that is not the certificate's, an encrypted key, or "
                "not PEM): give the certificate with its own unencrypted key",
            )
        refused = functools.partial(refuses_client_certificate, context=self._client_probe)
        if not self._probed(error, deadline, refused):
            return error
        if tls.certificate_chain is None:
            return self._mismatch(
                error,
                "asks for a client certificate (mutual TLS) and this client has none: give "
                "certificate_chain and private_key in TlsSettings",
            )
        return self._mismatch(
            error,
            "does not trust this client's certificate (certificate_chain in TlsSettings): "
            "give one signed by a CA the ledger takes client certificates from (its "
            "--tls-client-ca), with its private_key",
        )

    def _probed(
        self, error: LedgerError, deadline: float, probe: Callable[[str, float], bool | None]
    ) -> bool:
        """Whether a "Socket closed" is the mistake `probe` asks the ledger
        about, answered yes in the call's time left."""
        return (
            _SOCKET_CLOSED in error.message
            and deadline > time.monotonic()
            and bool(probe(self._address, deadline))
        )

    def _mismatch(self, error: LedgerError, what: str) -> TlsMismatch:
        return TlsMismatch(error.code, "", f"the ledger at {self._address} {what}")

    def reserve(
        self,
        model: str,
        request_bytes: int,
        max_output_tokens: int,
        *,
        reservation_id: str | None = None,
        estimate_nanos: int | None = None,
        ttl: datetime.timedelta | None = None,
        deadline_seconds: float | None = None,
    ) -> Reservation:
        """Books a hold, or is denied (a normal answer: `admitted` is False)."""
        arguments = ReserveArguments(
            reservation_id=_given_or_new(reservation_id),
            model=model,
            request_bytes=request_bytes,
            max_output_tokens=max_output_tokens,
            estimate_nanos=estimate_nanos,
            ttl_us=_micros_of(ttl),
        )
        self._gate.check()
        # A refund of an unanswered Reserve of this id may have ended the booking
        # this Reserve would be admitted to (calls.BackgroundRefunds).
        self._refunds.clear(
            self._admitted, arguments.reservation_id, "", self._deadline(deadline_seconds)
        )
        return self.reserve_arguments(arguments, deadline_seconds=deadline_seconds)

    def reserve_arguments(
        self,
        arguments: ReserveArguments,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Reservation:
        request = convert.reserve_request(self.lane, arguments)
        response: pb.ReserveResponse = self._invoke(
            self._stub.Reserve, request, deadline_seconds, trace_id
        )
        return convert.reservation(arguments.reservation_id, response)

    def settle(
        self,
        reservation_id: str,
        usage: Usage | None = None,
        *,
        http_status: int = 0,
        billed_at_most_nanos: int | None = None,
        deadline_seconds: float | None = None,
    ) -> Settled:
        """With usage: SUCCEEDED at the real cost. Without: UNKNOWN, charged at
        the hold (or at `billed_at_most_nanos` when that is lower)."""
        check_http_status(http_status, 100, 599)
        if billed_at_most_nanos is not None:
            check_range("billed_nanos", billed_at_most_nanos, 0, MAX_AMOUNT_NANOS)
            if usage is not None:
                raise invalid_argument(
                    "billed_at_most_nanos",
                    "bounds a settle without usage (UNKNOWN); with usage, the bill goes in"
                    " Usage.billed_nanos",
                )
        if usage is not None:
            ending = Ending(Settlement.SETTLE_SUCCEEDED, http_status, usage)
        else:
            bound = (
                None if billed_at_most_nanos is None else Usage(billed_nanos=billed_at_most_nanos)
            )
            ending = Ending(Settlement.SETTLE_UNKNOWN, http_status, bound)
        result = self.end(reservation_id, ending, deadline_seconds=deadline_seconds)
        assert isinstance(result, Settled)
        return result

    def refund(
        self,
        reservation_id: str,
        *,
        http_status: int = 0,
        reason: str = "",
        deadline_seconds: float | None = None,
    ) -> Refunded:
        """The provider refused the call (its 4xx status), or it was never sent
        (http_status 0 and a reason)."""
        check_http_status(http_status, 400, 499)
        ending = Ending(Settlement.REFUND, http_status, None, reason)
        check_refund_reason(reason)
        result = self._send_end(reservation_id, ending, deadline_seconds, "")
        assert isinstance(result, Refunded)
        return result

    def end(
        self,
        reservation_id: str,
        ending: Ending,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Settled | Refunded:
        """Sends the move an Ending stands for: Settle or Refund. A Refund's
        reason (a model call's, from its callback or exception) is made
        printable and cut to `max_reason_length` first."""
        if not isinstance(ending, Ending):
            raise TypeError(
                f"ending: must be an Ending (ledger_client.outcomes), not {type(ending).__name__}"
            )
        if ending.settlement is Settlement.REFUND:
            ending = _printable_reason(ending, self.settings.max_reason_length)
        return self._send_end(reservation_id, ending, deadline_seconds, trace_id)

    def _send_end(
        self,
        reservation_id: str,
        ending: Ending,
        deadline_seconds: float | None,
        trace_id: str,
    ) -> Settled | Refunded:
        check_reservation_id(reservation_id)
        if ending.settlement is Settlement.REFUND:
            refund = convert.refund_request(self.lane, reservation_id, ending)
            refunded: pb.RefundResponse = self._invoke(
                self._stub.Refund, refund, deadline_seconds, trace_id
            )
            return convert.refunded(refunded)
        settle = convert.settle_request(self.lane, reservation_id, ending)
        settled: pb.SettleResponse = self._invoke(
            self._stub.Settle, settle, deadline_seconds, trace_id
        )
        return convert.settled(settled)

    def balance(self, *, deadline_seconds: float | None = None) -> Balance:
        request = pb.GetBalanceRequest(lane=self.lane)
        response: pb.Balance = self._invoke(self._stub.GetBalance, request, deadline_seconds, "")
        return convert.balance(response)

    def booking_state(
        self, reservation_id: str, *, deadline_seconds: float | None = None
    ) -> BookingState:
        check_reservation_id(reservation_id)
        request = pb.GetBookingRequest(lane=self.lane, reservation_id=reservation_id)
        response: pb.Booking = self._invoke(self._stub.GetBooking, request, deadline_seconds, "")
        return convert.booking_state(response.state)

    # The lane's events -------------------------------------------------------------

    def list_events(
        self,
        *,
        after_seq: int = 0,
        page_size: int = DEFAULT_PAGE_SIZE,
        deadline_seconds: float | None = None,
    ) -> EventPage:
        """One page of the lane's events after `after_seq`, oldest first: at
        most `page_size` (1 to MAX_PAGE_SIZE), fewer where the server's message
        limit ends it early. Needs a grant with the `read` scope on the lane."""
        check_after_seq(after_seq)
        check_page_size(page_size)
        request = pb.ListEventsRequest(lane=self.lane, after_seq=after_seq, page_size=page_size)
        response: pb.ListEventsResponse = self._invoke(
            self._stub.ListEvents, request, deadline_seconds, ""
        )
        events = tuple(convert.event(message) for message in response.events)
        more = bool(response.next_page_token) and bool(events)
        return EventPage(events, events[-1].seq if more else None)

    def all_events(
        self,
        *,
        after_seq: int = 0,
        page_size: int = DEFAULT_PAGE_SIZE,
        deadline_seconds: float | None = None,
    ) -> Iterator[LedgerEvent]:
        """Every event of the lane after `after_seq`, page by page (one
        list_events call each, as the caller iterates), to the log's end as
        it stands then."""
        check_after_seq(after_seq)
        check_page_size(page_size)
        self._gate.check()
        return all_pages(
            lambda cursor: self.list_events(
                after_seq=cursor, page_size=page_size, deadline_seconds=deadline_seconds
            ),
            after_seq,
        )

    def watch_events(
        self, *, after_seq: int = 0, deadline_seconds: float | None = None
    ) -> Generator[LedgerEvent, None, None]:
        """A generator of the lane's events after `after_seq`, then of each new
        one as it is committed. A stream that drops (an outage, a server
        restarting) is opened again after the last event it gave, for up to
        `settings.watch_resume_seconds`. Each stream must be accepted within
        the deadline. Stop it with `close()` on the generator (or by leaving
        the loop and dropping it); `close()` of the client ends it too."""
        check_after_seq(after_seq)
        timeout = self._deadline(deadline_seconds)
        self._gate.check()
        resumption = Resumption(
            self.settings.watch_resume_seconds,
            self.settings.initial_reconnect_backoff_ms / 1000,
            self.settings.max_reconnect_backoff_ms / 1000,
        )
        return tail(
            lambda after: self._stream(after, timeout), self._watches, after_seq, resumption
        )

    def _stream(self, after_seq: int, timeout: float) -> Generator[LedgerEvent | None, None, None]:
        """One WatchEvents stream of the lane (events.stream_events)."""
        request = pb.WatchEventsRequest(lane=self.lane, after_seq=after_seq)
        metadata = self._metadata("")
        with self._starting:  # never a call on a closed channel (see __init__)
            if self._closed:
                return
            call = self._stub.WatchEvents(request, metadata=metadata, wait_for_ready=False)
        yield from stream_events(call, self._watches, timeout, convert.event)

    # One model call --------------------------------------------------------------

    def model_call(
        self,
        model: str,
        request: object,
        max_output_tokens: int,
        *,
        estimate_nanos: int | None = None,
        ttl: datetime.timedelta | None = None,
        trace_id: str | None = None,
        reservation_id: str | None = None,
    ) -> ModelCall:
        """A context manager around one model call; see calls.py. `request` is
        the request's size in bytes (an int) or the payload itself, measured
        by `payload_bytes` (a dict or a list as its compact JSON). The booking
        takes `reservation_id` when given (e.g. already tagged on the request),
        else a fresh one. ClientClosed after close()."""
        self._gate.check()
        request_bytes = _request_bytes(request)
        arguments = ReserveArguments(
            reservation_id=_given_or_new(reservation_id),
            model=model,
            request_bytes=request_bytes,
            max_output_tokens=max_output_tokens,
            estimate_nanos=estimate_nanos,
            ttl_us=_micros_of(ttl),
        )
        if trace_id:
            check_trace_id(trace_id)
        return ModelCall(self._support(), arguments, trace_id or current_or_new_trace_id())

    def _support(self) -> CallSupport:
        return CallSupport(
            self._admitted,
            self.lane,
            self._journal,
            self._allowance,
            self._replayer,
            self._refunds,
            self.settings.end_attempts,
            self.settings.deadline_seconds,
            self._gate,
            self._model_call_ids,
        )

    # The journal -----------------------------------------------------------------

    def replay_journal(self, max_entries: int | None = None) -> ReplayReport:
        """One bounded replay attempt, now, in this thread."""
        self._gate.check()
        if self._replayer is None:
            return ReplayReport()
        return self._replayer.replay_once(max_entries)


# Set while `_Admitted` makes a move, in the thread that makes it.
_ADMITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("ledger_admitted", default=False)


class _Admitted:
    """The client's moves for calls it already admitted (calls.CallLedger),
    through its own reserve_arguments and end."""

    def __init__(self, client: LaneClient) -> None:
        self._client = client

    def reserve_arguments(
        self,
        arguments: ReserveArguments,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Reservation:
        token = _ADMITTED.set(True)
        try:
            return self._client.reserve_arguments(
                arguments, deadline_seconds=deadline_seconds, trace_id=trace_id
            )
        finally:
            _ADMITTED.reset(token)

    def end(
        self,
        reservation_id: str,
        ending: Ending,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Settled | Refunded:
        token = _ADMITTED.set(True)
        try:
            return self._client.end(
                reservation_id, ending, deadline_seconds=deadline_seconds, trace_id=trace_id
            )
        finally:
            _ADMITTED.reset(token)


def _traced(channel: grpc.Channel, address: str) -> grpc.Channel:
    """The channel with OpenTelemetry tracing (tracing.py) when opentelemetry-api is installed."""
    try:
        from ledger_client import tracing
    except ImportError:  # the optional `tracing` extra is not installed
        return channel
    return tracing.instrument(channel, address)


def _printable_reason(ending: Ending, max_length: int) -> Ending:
    """The ledger takes a printable reason of bounded length; make it one."""
    reason = "".join(character if character.isprintable() else " " for character in ending.reason)
    reason = reason[:max_length].strip() or ("refused" if ending.http_status else "not sent")
    if reason == ending.reason:
        return ending
    return Ending(ending.settlement, ending.http_status, ending.usage, reason)
