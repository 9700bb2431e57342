"""The official `openai` and `anthropic` SDKs, booked through the ledger.

    from ledger_client.providers import anthropic_client, openai_client

    openai = openai_client(ledger, api_key=KEY)  # an openai.OpenAI
    claude = anthropic_client(ledger, api_key=KEY)  # an anthropic.Anthropic
    aopenai = async_openai_client(ledger, api_key=KEY)  # an openai.AsyncOpenAI
    aclaude = async_anthropic_client(ledger, api_key=KEY)  # an anthropic.AsyncAnthropic

The sync ones build the SDK client on `httpx2.Client(transport=LedgerTransport(ledger))`,
the async ones on `httpx2.AsyncClient(transport=AsyncLedgerTransport(ledger))`.
Both transports follow the same rules (the same functions: the request plan,
the endings, the stream's usage); only the driving differs. The transport
books every create call, one booking per HTTP attempt:

- OpenAI `POST .../chat/completions` and `POST .../responses`, Anthropic
  `POST .../v1/messages`; any other request passes through untouched, unbooked.
- Before sending: a reservation id is chosen, tagged on the request (the
  `X-Ledger-Reservation-Id` header always; in the body OpenAI's
  `metadata.ledger_reservation_id` (a chat completion's only when it is
  stored, `store: true`: OpenAI refuses its metadata otherwise), Anthropic's
  `metadata.user_id`, where the caller has not set them), and the ledger
  reserves the tagged body's bytes
  and its max tokens. A missing max is set in the body to
  `default_max_output_tokens`, so the bound the ledger holds is the one the
  provider enforces. A denial raises `Denied`, and nothing is sent.
- After: `CallHandle.answered` / `failed` end the booking by the one table in
  outcomes.py (any 4xx refunded; usage settles SUCCEEDED; a 5xx without usage,
  a timeout or a lost connection UNKNOWN), the usage read by `usage_of`. A
  3xx ran nothing: refunded (a redirect followed is a request booked anew).
  Nor did a request never sent whole (no connection made, or the body's
  write timed out): refunded as not sent.
- A stream (`stream: true`, answered with `text/event-stream`) is passed on
  chunk by chunk, never buffered whole; its usage is read from its final
  events, and the booking ends when the stream ends or is closed. A stream
  that stops before its usage arrived is UNKNOWN.

The async transport runs every ledger call (the Reserve, each ending) in a
worker thread (`anyio.to_thread.run_sync`, so under asyncio or trio): the
lane client is synchronous gRPC, and a slow ledger must not block the event
loop. A caller cancelled while its Reserve runs gets the cancellation at once;
the booking that Reserve makes is then refunded as not sent. An ending, once
started, runs to its end (its own deadline bounds it) even if the caller is
cancelled meanwhile.

Needs the optional extras: `pip install 'ledger-client[openai]'` or
`'ledger-client[anthropic]'` (both bring `httpx2`). The rest of ledger_client
never imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.to_thread
import httpx2

from ledger_client import canonical_json
from ledger_client.bookings import new_reservation_id
from ledger_client.calls import CallHandle, ModelCall
from ledger_client.outcomes import CallFailure, Settlement, Usage
from ledger_client.usage import usage_of

if TYPE_CHECKING:
    import anthropic
    import openai

    from ledger_client.client import LaneClient


RESERVATION_HEADER = "X-Ledger-Reservation-Id"
OPENAI_METADATA_KEY = "ledger_reservation_id"
# OpenAI takes at most 16 metadata pairs: a full one is left as it is.
OPENAI_MAX_METADATA_KEYS = 16
# The output bound reserved, and written into the body, when a request has none.
DEFAULT_MAX_OUTPUT_TOKENS = 4096
# One server-sent event larger than this is not read for usage (the stream
# still passes through; the booking then ends UNKNOWN, at its hold).
MAX_EVENT_BYTES = 16 * 1024 * 1024
UNKNOWN_MODEL_NAME = "unknown"
CANCELLED_REASON = "cancelled before sending"

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class CallStyle(enum.Enum):
    """The provider calls the transport books."""

    OPENAI_CHAT = "openai_chat"  # POST .../chat/completions
    OPENAI_RESPONSES = "openai_responses"  # POST .../responses
    ANTHROPIC_MESSAGES = "anthropic_messages"  # POST .../v1/messages


# The body's max-token fields, in the order they are looked for; the first is
# the one written when none is set.
_MAX_TOKEN_FIELDS = {
    CallStyle.OPENAI_CHAT: ("max_completion_tokens", "max_tokens"),
    CallStyle.OPENAI_RESPONSES: ("max_output_tokens",),
    CallStyle.ANTHROPIC_MESSAGES: ("max_tokens",),
}
# The events whose `response.usage` is the final usage of a Responses stream.
_RESPONSES_FINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed"}
)


def call_style(request: httpx2.Request) -> CallStyle | None:
    """Which booked call a request is, or None: it passes through unbooked."""
    if request.method != "POST":
        return None
    path = request.url.path.rstrip("/")
    if path.endswith("/chat/completions"):
        return CallStyle.OPENAI_CHAT
    if path.endswith("/responses"):
        return CallStyle.OPENAI_RESPONSES
    if path.endswith("/v1/messages"):
        return CallStyle.ANTHROPIC_MESSAGES
    return None


# Before sending -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedCall:
    """A booked request as it goes out: tagged, with the numbers reserved."""

    request: httpx2.Request
    body: bytes
    model: str
    max_output_tokens: int
    stream: bool


def prepare_request(
    request: httpx2.Request,
    style: CallStyle,
    reservation_id: str,
    *,
    default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    tag_body: bool = True,
) -> PreparedCall:
    """The request to send: tagged with the reservation id (header and body),
    its max tokens made explicit, and for an OpenAI chat stream usage asked for."""
    raw = request.read()
    parsed = _json_object(raw)
    headers = httpx2.Headers(request.headers)
    for name in ("content-length", "transfer-encoding"):
        if name in headers:
            del headers[name]
    headers[RESERVATION_HEADER] = reservation_id
    if parsed is None:
        # Not a JSON object: booked as it is, at the default bound, untagged.
        body, model, max_output_tokens, stream = (
            raw,
            UNKNOWN_MODEL_NAME,
            default_max_output_tokens,
            False,
        )
    else:
        edited = dict(parsed)
        max_output_tokens = _ensure_max_tokens(edited, style, default_max_output_tokens)
        max_output_tokens *= _choices(edited, style)
        stream = edited.get("stream") is True
        if stream and style is CallStyle.OPENAI_CHAT:
            options = edited.get("stream_options")
            edited["stream_options"] = {
                **(options if isinstance(options, Mapping) else {}),
                "include_usage": True,
            }
        if tag_body:
            _tag_body(edited, style, reservation_id)
        body = raw if edited == parsed else _dumps(edited)
        model_field = edited.get("model")
        model = model_field if isinstance(model_field, str) and model_field else UNKNOWN_MODEL_NAME
    if stream:
        # The stream is read for its usage as it passes: keep it uncompressed.
        headers["accept-encoding"] = "identity"
    sent = httpx2.Request(
        request.method, request.url, headers=headers, content=body, extensions=request.extensions
    )
    return PreparedCall(sent, body, model, max_output_tokens, stream)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _dumps(body: Mapping[str, Any]) -> bytes:
    # The Node client's JSON.stringify text: the same body, the same request_bytes.
    return canonical_json.dump_bytes(body)


_MAX_SAFE_INTEGER = 2**53 - 1


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count_of(value: object) -> int | None:
    """A bound as a count, or None. An integral JSON number is one, 100.0 too:
    JavaScript's JSON.parse reads it as 100, and the Node client books that."""
    if isinstance(value, float) and value.is_integer() and 0 <= value <= _MAX_SAFE_INTEGER:
        return int(value)
    if isinstance(value, int) and _is_count(value):
        return value
    return None


def _ensure_max_tokens(body: dict[str, Any], style: CallStyle, default: int) -> int:
    fields = _MAX_TOKEN_FIELDS[style]
    for name in fields:
        count = _count_of(body.get(name))
        if count is not None:
            return count
    if all(body.get(name) is None for name in fields):
        body[fields[0]] = default
    # A bound that is not a count: the provider refuses it (a 4xx, refunded).
    return default


def _choices(body: Mapping[str, Any], style: CallStyle) -> int:
    """How many choices a chat asks for (`n`): each may use the whole output
    bound, so the call's output bound is the bound times n. A count of at
    least 1 is taken; anything else (left out, null, 0, not a count) is 1,
    and an `n` the provider does not take it refuses (a 4xx, refunded)."""
    if style is not CallStyle.OPENAI_CHAT:
        return 1
    count = _count_of(body.get("n"))
    return count if count is not None and count >= 1 else 1


def _tag_body(body: dict[str, Any], style: CallStyle, reservation_id: str) -> None:
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        return
    current = dict(metadata or {})
    if style is CallStyle.ANTHROPIC_MESSAGES:
        if current.get("user_id") is None:
            current["user_id"] = reservation_id
            body["metadata"] = current
        return
    if style is CallStyle.OPENAI_CHAT and body.get("store") is not True:
        # OpenAI refuses a chat completion's metadata unless it is stored
        # ("The 'metadata' parameter is only allowed when 'store' is
        # enabled."): such a call is tagged in the header only.
        return
    if OPENAI_METADATA_KEY not in current and len(current) < OPENAI_MAX_METADATA_KEYS:
        current[OPENAI_METADATA_KEY] = reservation_id
        body["metadata"] = current


# After: how one booking ends -----------------------------------------------------


def failure_of(error: BaseException) -> CallFailure:
    """How an exception from the HTTP transport is read (see also not-sent)."""
    if isinstance(error, httpx2.TimeoutException | TimeoutError):
        return CallFailure.TIMEOUT
    if isinstance(error, httpx2.TransportError | OSError):
        return CallFailure.CONNECTION_LOST
    return CallFailure.EXCEPTION


def _never_sent(error: BaseException) -> str | None:
    """Why no whole request of this attempt reached the provider, or None (it
    may have): no connection was made, or the body's write timed out before
    its last byte, so the provider cannot have run it."""
    if isinstance(error, httpx2.ConnectError | httpx2.ConnectTimeout | httpx2.PoolTimeout):
        return f"could not connect: {type(error).__name__}"
    if isinstance(error, httpx2.WriteTimeout):
        return f"not sent whole: {type(error).__name__}"
    return None


class Booking:
    """One HTTP attempt's booking, ended once (a stream may end it from the
    thread that reads it or from the one that closes it)."""

    def __init__(self, call: ModelCall, handle: CallHandle) -> None:
        self._call = call
        self.handle = handle
        self._lock = threading.Lock()
        self.ended = False

    @property
    def reservation_id(self) -> str:
        return self.handle.reservation_id

    def answered(self, http_status: int, usage: Usage | None) -> None:
        self._end(lambda: self.handle.answered(http_status, usage))

    def failed(
        self, error: BaseException, http_status: int = 0, usage: Usage | None = None
    ) -> None:
        if usage is not None:  # known usage wins over any failure
            self.answered(http_status or 200, usage)
        elif http_status == 0 and (reason := _never_sent(error)) is not None:
            self.not_sent(reason)
        else:
            self._end(lambda: self.handle.failed(failure_of(error), http_status))

    def not_sent(self, reason: str) -> None:
        """Nothing of this attempt left the lane: refunded."""
        self._end(lambda: self.handle.not_sent(reason))

    def cut_off(self, http_status: int, usage: Usage | None) -> None:
        """A stream that stopped, or was closed, before it ended."""
        if usage is not None:
            self.answered(http_status, usage)
        else:
            self._end(lambda: self.handle.failed(CallFailure.CONNECTION_LOST, http_status))

    def _end(self, report: Callable[[], Settlement]) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended = True
            report()
            # A usage the ledger refuses is settled UNKNOWN there (ModelCall).
            self._call.__exit__(None, None, None)


# Streams -------------------------------------------------------------------------


class StreamUsage:
    """Reads a server-sent event stream, chunk by chunk, for its final usage.
    Keeps only the event being read, never the stream."""

    def __init__(self, style: CallStyle) -> None:
        self._style = style
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._broken = False
        self._anthropic: dict[str, Any] | None = None
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if self._broken:
            return
        self._buffer.extend(chunk)
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).rstrip(b"\r")
            del self._buffer[: end + 1]
            self._line(line)
        if len(self._buffer) + self._data_bytes > MAX_EVENT_BYTES:
            self._give_up()

    def _give_up(self) -> None:
        self._broken = True
        self._buffer.clear()
        self._data.clear()
        self.usage = None

    def _line(self, line: bytes) -> None:
        if not line:
            data = b"\n".join(self._data)
            self._data.clear()
            self._data_bytes = 0
            if data and data != b"[DONE]":
                self._event(data)
            return
        field, _, value = line.partition(b":")
        if field == b"data":
            value = value[1:] if value.startswith(b" ") else value
            self._data.append(value)
            self._data_bytes += len(value)

    def _event(self, data: bytes) -> None:
        event = _json_object(data)
        if event is None:
            return
        try:
            if self._style is CallStyle.OPENAI_CHAT:
                if isinstance(event.get("usage"), Mapping):
                    self.usage = usage_of(event)
            elif self._style is CallStyle.OPENAI_RESPONSES:
                if event.get("type") in _RESPONSES_FINAL_EVENTS:
                    response = event.get("response")
                    self.usage = usage_of(response if isinstance(response, Mapping) else None)
            else:
                self._anthropic_event(event)
        except ValueError:  # a count that is not a count: no usage
            self.usage = None

    def _anthropic_event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message")
            usage = message.get("usage") if isinstance(message, Mapping) else None
            self._anthropic = dict(usage) if isinstance(usage, Mapping) else {}
        elif kind == "message_delta":
            delta_usage = event.get("usage")
            merged = dict(self._anthropic or {})
            if isinstance(delta_usage, Mapping):
                # The delta's counts are cumulative; a null one leaves the start's.
                merged.update({k: v for k, v in delta_usage.items() if v is not None})
            self._anthropic = merged
            # Only the delta carries the output tokens: usage is known from here.
            self.usage = usage_of(merged)


class StreamEnding:
    """How a passing stream's booking ends, for both stream wrappers: read for
    its usage chunk by chunk; ended, settled from that usage; broken or closed
    first, cut off (UNKNOWN unless the usage had arrived). The endings are
    blocking ledger calls (the async wrapper runs them off the event loop)."""

    def __init__(self, booking: Booking, http_status: int, style: CallStyle) -> None:
        self.booking = booking
        self.http_status = http_status
        self._usage = StreamUsage(style)

    def feed(self, chunk: bytes) -> None:
        self._usage.feed(chunk)

    def ended(self) -> None:
        self.booking.answered(self.http_status, self._usage.usage)

    def broke(self, error: BaseException) -> None:
        self.booking.failed(error, self.http_status, self._usage.usage)

    def closed(self) -> None:
        self.booking.cut_off(self.http_status, self._usage.usage)

    def abandoned(self) -> None:
        """The stream was collected, neither ended nor closed (never iterated,
        nothing ran a close): cut off, as closed. In a thread of its own, since
        a finalizer runs wherever collection happens, even on the event loop or
        under this booking's lock."""
        if self.booking.ended:
            return
        # RuntimeError: the interpreter is shutting down, and the hold expires.
        with contextlib.suppress(RuntimeError):
            threading.Thread(target=self.closed, name="ledger-dropped-stream", daemon=True).start()


class BookedStream(httpx2.SyncByteStream):
    """A response stream passed on as it comes, ending its booking when it ends
    or is closed first (see StreamEnding)."""

    def __init__(
        self, inner: httpx2.SyncByteStream, booking: Booking, http_status: int, style: CallStyle
    ) -> None:
        self._inner = inner
        self._ending = StreamEnding(booking, http_status, style)

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in self._inner:
                self._ending.feed(chunk)
                yield chunk
        except GeneratorExit:  # the reader stopped: close() ends the booking
            raise
        except BaseException as error:
            self._ending.broke(error)
            raise
        self._ending.ended()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._ending.closed()

    def __del__(self) -> None:
        self._ending.abandoned()


class AsyncBookedStream(httpx2.AsyncByteStream):
    """BookedStream for an async response stream: the same endings, run off
    the event loop, when it ends or is closed (`aclose`) first."""

    def __init__(
        self, inner: httpx2.AsyncByteStream, booking: Booking, http_status: int, style: CallStyle
    ) -> None:
        self._inner = inner
        self._iterator: AsyncIterator[bytes] | None = None
        self._ending = StreamEnding(booking, http_status, style)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self._iterator = self._inner.__aiter__()
        try:
            async for chunk in self._iterator:
                self._ending.feed(chunk)
                yield chunk
        except GeneratorExit:  # the reader stopped: aclose() ends the booking
            raise
        except BaseException as error:
            await self._end(self._ending.broke, error)
            raise
        await self._end(self._ending.ended)

    async def aclose(self) -> None:
        try:
            iterator, self._iterator = self._iterator, None
            if isinstance(iterator, AsyncGenerator):
                await iterator.aclose()
            await self._inner.aclose()
        finally:
            await self._end(self._ending.closed)

    async def _end(self, report: Callable[[Unpack[_Ts]], None], *args: *_Ts) -> None:
        if not self._ending.booking.ended:  # no thread for a booking already ended
            await run_off_loop(report, *args)

    def __del__(self) -> None:
        self._ending.abandoned()


def _is_event_stream(response: httpx2.Response) -> bool:
    content_type = response.headers.get("content-type", "")
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


class Answer(enum.Enum):
    """How a booked request's response is read, sync or async."""

    REFUSED = "refused"  # a 4xx: refunded, the body left to the SDK
    REDIRECTED = "redirected"  # a 3xx: nothing ran, refunded; the SDK's client follows it
    STREAM = "stream"  # an event stream asked for: booked as it passes (StreamEnding)
    BODY = "body"  # read whole here, settled by the usage in it (or UNKNOWN)


def answer_of(response: httpx2.Response, prepared: PreparedCall) -> Answer:
    status = response.status_code
    if 300 <= status < 400:
        return Answer.REDIRECTED
    if 400 <= status < 500:
        return Answer.REFUSED
    if prepared.stream and 200 <= status < 300 and _is_event_stream(response):
        return Answer.STREAM
    return Answer.BODY


def redirected_reason(http_status: int) -> str:
    """A redirect runs no model: its booking is refunded with this reason (a
    request the SDK's client sends again to the new address is booked anew)."""
    return f"redirected (HTTP {http_status}): the provider ran nothing"


def body_usage(content: bytes) -> Usage | None:
    """The usage in a whole response body, or None (then a 2xx or 5xx is UNKNOWN)."""
    try:
        return usage_of(_json_object(content))
    except ValueError:
        return None


# Off the event loop ------------------------------------------------------------------


async def run_off_loop(function: Callable[[Unpack[_Ts]], _T], *args: *_Ts) -> _T:
    """A blocking ledger call, run in a worker thread so the event loop goes on.
    Shielded from cancel scopes: once started it runs to its end, its own
    deadline bounding it (a native asyncio cancel stops only the waiting)."""
    with anyio.CancelScope(shield=True):  # never cancelled itself: swallows nothing
        result = await anyio.to_thread.run_sync(function, *args)
    return result


async def reserve_off_loop(
    reserve: Callable[[httpx2.Request, CallStyle], tuple[Booking, PreparedCall]],
    request: httpx2.Request,
    style: CallStyle,
) -> tuple[Booking, PreparedCall]:
    """The Reserve, in a worker thread. A caller cancelled meanwhile gets the
    cancellation at once, and the booking made is refunded as not sent (by the
    worker if it is still reserving, else here)."""
    lock = threading.Lock()
    made: list[tuple[Booking, PreparedCall]] = []
    abandoned = False

    def run() -> tuple[Booking, PreparedCall]:
        result = reserve(request, style)
        with lock:
            made.append(result)
            late = abandoned
        if late:
            result[0].not_sent(CANCELLED_REASON)
        return result

    try:
        return await anyio.to_thread.run_sync(run)
    except BaseException:
        with lock:
            abandoned = True
            reserved = list(made)
        for booking, _ in reserved:
            await run_off_loop(booking.not_sent, CANCELLED_REASON)
        raise


# The transports ------------------------------------------------------------------------

_SDK_ERRORS: dict[tuple[type[BaseException], type[Exception]], type[Exception]] = {}


def _sdk_error_base(style: CallStyle) -> type[Exception] | None:
    """The anthropic SDK wraps any other exception a transport raises in an
    APIConnectionError, and retries it; one of its own it raises as it is."""
    if style is not CallStyle.ANTHROPIC_MESSAGES:
        return None  # the openai SDK lets a foreign exception through as it is
    try:
        import anthropic
    except ImportError:
        return None
    return anthropic.AnthropicError


def _for_sdk(error: Exception, style: CallStyle) -> Exception:
    """The same error (still a `Denied`, a `LedgerError`, ...), made an
    exception of the SDK's own when the SDK would otherwise wrap it."""
    base = _sdk_error_base(style)
    if base is None or isinstance(error, base):
        return error
    key = (type(error), base)
    kind = _SDK_ERRORS.get(key)
    if kind is None:
        kind = type(type(error).__name__, (type(error), base), {"__module__": __name__})
        _SDK_ERRORS[key] = kind
    converted = kind.__new__(kind)
    converted.args = error.args
    converted.__dict__.update(error.__dict__)
    return converted


@dataclasses.dataclass(frozen=True)
class BookingOptions:
    """How a transport books: the output bound of a request that names none
    (written into its body), the ledger's model name for the provider's (the
    provider's own by default), whether the body carries the reservation id
    (the header always does), and the holds' ttl (the lane's by default)."""

    default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    ledger_model: Callable[[str], str] | None = None
    tag_body: bool = True
    ttl: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if not _is_count(self.default_max_output_tokens):
            raise ValueError("default_max_output_tokens must be a non-negative integer")
        # Checked here, not at each request inside the SDK's call.
        if self.ledger_model is not None and not callable(self.ledger_model):
            kind = type(self.ledger_model).__name__
            raise TypeError(
                f"ledger_model must be a function of the provider's model name, not a {kind}"
                " (for a dict d: lambda name: d.get(name, name))"
            )
        if self.ttl is not None and not isinstance(self.ttl, datetime.timedelta):
            raise TypeError(f"ttl must be a datetime.timedelta, not {type(self.ttl).__name__}")
        if not isinstance(self.tag_body, bool):
            raise TypeError(f"tag_body must be a bool, not {type(self.tag_body).__name__}")


class _Booker:
    """What both transports share: their settings and the Reserve (plan the
    request, reserve it, or raise the denial as the SDK should see it)."""

    def __init__(self, lane_client: LaneClient, options: BookingOptions | None) -> None:
        options = options or BookingOptions()
        self.lane_client = lane_client
        self.options = options
        self.default_max_output_tokens = options.default_max_output_tokens
        self.ledger_model = options.ledger_model
        self.tag_body = options.tag_body
        self.ttl = options.ttl

    def _reserve(self, request: httpx2.Request, style: CallStyle) -> tuple[Booking, PreparedCall]:
        """Blocking; the request's body already read. Raises Denied: nothing is sent."""
        try:
            return self._reserve_as_is(request, style)
        except Exception as error:
            converted = _for_sdk(error, style)
            if converted is error:
                raise
            raise converted from error

    def _reserve_as_is(
        self, request: httpx2.Request, style: CallStyle
    ) -> tuple[Booking, PreparedCall]:
        reservation_id = new_reservation_id()
        prepared = prepare_request(
            request,
            style,
            reservation_id,
            default_max_output_tokens=self.default_max_output_tokens,
            tag_body=self.tag_body,
        )
        model = self.ledger_model(prepared.model) if self.ledger_model else prepared.model
        call = self.lane_client.model_call(
            model,
            prepared.body,
            prepared.max_output_tokens,
            ttl=self.ttl,
            reservation_id=reservation_id,
        )
        handle = call.__enter__()  # raises Denied: nothing is sent
        return Booking(call, handle), prepared


class LedgerTransport(_Booker, httpx2.BaseTransport):
    """An httpx2 transport that books each OpenAI / Anthropic create call with
    the ledger; see the module's docstring. One booking per HTTP attempt: an
    SDK's own retries each reserve again.

    `ledger_model` maps the body's `model` to the name the lane's prices use
    (default: as it is). `tag_body=False` leaves the body's metadata alone (the
    header is still sent). `ttl` is passed to each Reserve."""

    def __init__(
        self,
        lane_client: LaneClient,
        inner: httpx2.BaseTransport | None = None,
        options: BookingOptions | None = None,
    ) -> None:
        super().__init__(lane_client, options)
        self.inner = inner if inner is not None else httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        style = call_style(request)
        if style is None:
            return self.inner.handle_request(request)
        request.read()
        booking, prepared = self._reserve(request, style)
        try:
            response = self.inner.handle_request(prepared.request)
        except BaseException as error:
            booking.failed(error)
            raise
        status = response.status_code
        answer = answer_of(response, prepared)
        if answer is Answer.REFUSED:
            booking.answered(status, None)
        elif answer is Answer.REDIRECTED:
            booking.not_sent(redirected_reason(status))
        elif answer is Answer.STREAM:
            assert isinstance(response.stream, httpx2.SyncByteStream)
            response.stream = BookedStream(response.stream, booking, status, style)
        else:
            try:
                content = response.read()
            except BaseException as error:
                try:
                    response.close()
                finally:
                    booking.failed(error, status)
                raise
            booking.answered(status, body_usage(content))
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncLedgerTransport(_Booker, httpx2.AsyncBaseTransport):
    """LedgerTransport for the async SDK clients (`openai.AsyncOpenAI`,
    `anthropic.AsyncAnthropic`): the same rules and settings, each ledger call
    (the Reserve, every ending) run in a worker thread, off the event loop."""

    def __init__(
        self,
        lane_client: LaneClient,
        inner: httpx2.AsyncBaseTransport | None = None,
        options: BookingOptions | None = None,
    ) -> None:
        super().__init__(lane_client, options)
        self.inner = inner if inner is not None else httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        style = call_style(request)
        if style is None:
            return await self.inner.handle_async_request(request)
        await request.aread()
        booking, prepared = await reserve_off_loop(self._reserve, request, style)
        try:
            response = await self.inner.handle_async_request(prepared.request)
        except BaseException as error:
            await run_off_loop(booking.failed, error)
            raise
        status = response.status_code
        answer = answer_of(response, prepared)
        if answer is Answer.REFUSED:
            await run_off_loop(booking.answered, status, None)
        elif answer is Answer.REDIRECTED:
            await run_off_loop(booking.not_sent, redirected_reason(status))
        elif answer is Answer.STREAM:
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = AsyncBookedStream(response.stream, booking, status, style)
        else:
            try:
                content = await response.aread()
            except BaseException as error:
                try:
                    await response.aclose()
                finally:
                    await run_off_loop(booking.failed, error, status)
                raise
            await run_off_loop(booking.answered, status, body_usage(content))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


# The SDK clients ----------------------------------------------------------------------


def openai_client(
    lane_client: LaneClient,
    *,
    inner: httpx2.BaseTransport | None = None,
    options: BookingOptions | None = None,
    **openai_kwargs: Any,
) -> openai.OpenAI:
    """An `openai.OpenAI` whose create calls are booked with `lane_client`.
    The other keywords go to `openai.OpenAI` (api_key, base_url, timeout,
    max_retries, ...)."""
    import openai

    # The SDK's own client class: its default timeout, limits and redirects.
    transport = LedgerTransport(lane_client, inner, options)
    return openai.OpenAI(
        http_client=openai.DefaultHttpxClient(transport=transport), **openai_kwargs
    )


def anthropic_client(
    lane_client: LaneClient,
    *,
    inner: httpx2.BaseTransport | None = None,
    options: BookingOptions | None = None,
    **anthropic_kwargs: Any,
) -> anthropic.Anthropic:
    """An `anthropic.Anthropic` whose message calls are booked with
    `lane_client`. The other keywords go to `anthropic.Anthropic`."""
    import anthropic

    transport = LedgerTransport(lane_client, inner, options)
    http_client = anthropic.DefaultHttpxClient(transport=transport)
    return anthropic.Anthropic(http_client=http_client, **anthropic_kwargs)


def async_openai_client(
    lane_client: LaneClient,
    *,
    inner: httpx2.AsyncBaseTransport | None = None,
    options: BookingOptions | None = None,
    **openai_kwargs: Any,
) -> openai.AsyncOpenAI:
    """An `openai.AsyncOpenAI` whose create calls are booked with
    `lane_client`, its ledger calls run off the event loop. The other keywords
    go to `openai.AsyncOpenAI`."""
    import openai

    transport = AsyncLedgerTransport(lane_client, inner, options)
    http_client = openai.DefaultAsyncHttpxClient(transport=transport)
    return openai.AsyncOpenAI(http_client=http_client, **openai_kwargs)


def async_anthropic_client(
    lane_client: LaneClient,
    *,
    inner: httpx2.AsyncBaseTransport | None = None,
    options: BookingOptions | None = None,
    **anthropic_kwargs: Any,
) -> anthropic.AsyncAnthropic:
    """An `anthropic.AsyncAnthropic` whose message calls are booked with
    `lane_client`, its ledger calls run off the event loop. The other keywords
    go to `anthropic.AsyncAnthropic`."""
    import anthropic

    transport = AsyncLedgerTransport(lane_client, inner, options)
    http_client = anthropic.DefaultAsyncHttpxClient(transport=transport)
    return anthropic.AsyncAnthropic(http_client=http_client, **anthropic_kwargs)
