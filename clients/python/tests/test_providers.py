"""The real `openai` and `anthropic` SDKs, over real HTTP to a local fake
provider (provider_fakes.py), booked through LedgerTransport with a real ledger.

Each case checks the booking through the ledger (state, charge, the tokens it
recorded), that the provider got the reservation id in the header and the
body, and that the bytes the ledger booked are the bytes the provider got.
"""

from __future__ import annotations

import gc
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

# The extras are installed by `make install`: a missing SDK fails here, never skips.
import anthropic
import grpc
import httpx2
import openai
import pytest
from client_ledger import TEST_SETTINGS, Admin, LedgerProcess, new_lane_name
from ledger_client import (
    DenialReason,
    Denied,
    LaneClient,
    ReservationConflict,
    is_context_overflow,
    providers,
)
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_client.providers import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    OPENAI_METADATA_KEY,
    RESERVATION_HEADER,
    BookingOptions,
    anthropic_client,
    openai_client,
)
from provider_fakes import (
    ANTHROPIC_FORBIDDEN,
    ANTHROPIC_OVERFLOW,
    ANTHROPIC_RATE_LIMITED,
    ANTHROPIC_SERVER_ERROR,
    MODEL,
    OPENAI_FORBIDDEN,
    OPENAI_OVERFLOW,
    OPENAI_RATE_LIMITED,
    OPENAI_SERVER_ERROR,
    FakeProvider,
    Received,
    Reply,
    anthropic_message_body,
    anthropic_stream,
    openai_chat_body,
    openai_chat_stream,
    openai_responses_stream,
)

# Per million tokens: input 1 nano a token, cache reads 0.5, cache writes 1.25,
# output 2: every kind of token shows in the charge.
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=1_000_000,
    output_nanos_per_million_tokens=2_000_000,
    cached_input_nanos_per_million_tokens=500_000,
    cache_write_nanos_per_million_tokens=1_250_000,
)
MESSAGES = [{"role": "user", "content": "Say hello."}]
STALL_SECONDS = 5.0
SDK_TIMEOUT_SECONDS = 0.5


class Bookings:
    """The ledger's view of one lane's bookings, read with the admin grant."""

    def __init__(self, server: LedgerProcess, admin: Admin, lane: str) -> None:
        self._channel = grpc.insecure_channel(server.address)
        self._stub = pb_grpc.LedgerStub(self._channel)
        self._metadata = (("authorization", f"Bearer {server.admin_grant}"),)
        self._admin = admin
        self.lane = lane

    def close(self) -> None:
        self._channel.close()

    def get(self, reservation_id: str) -> pb.Booking:
        request = pb.GetBookingRequest(lane=self.lane, reservation_id=reservation_id)
        booking: pb.Booking = self._stub.GetBooking(request, metadata=self._metadata, timeout=10)
        return booking

    def ended(self, reservation_id: str) -> pb.Event:
        """The event that ended the booking (settled or refunded)."""
        events = [e for e in self._admin.events(self.lane) if e.reservation_id == reservation_id]
        assert events[0].kind == "reserved"
        assert len(events) == 2, [e.kind for e in events]
        return events[1]

    def admin_events(self) -> list[pb.Event]:
        return [e for e in self._admin.events(self.lane) if e.reservation_id]

    def count(self) -> int:
        return len({e.reservation_id for e in self._admin.events(self.lane) if e.reservation_id})


@pytest.fixture(scope="module")
def provider_server() -> Iterator[FakeProvider]:
    server = FakeProvider()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def provider(provider_server: FakeProvider) -> FakeProvider:
    provider_server.reset()
    return provider_server


@pytest.fixture
def priced_lane(admin: Admin) -> str:
    name = new_lane_name()
    admin.put_lane(name, 1_000_000, prices={MODEL: PRICE})
    return name


@pytest.fixture
def ledger(ledger_server: LedgerProcess, priced_lane: str, lane_grant: str) -> Iterator[LaneClient]:
    with LaneClient(
        ledger_server.address, priced_lane, grant=lane_grant, settings=TEST_SETTINGS
    ) as made:
        yield made


@pytest.fixture
def bookings(ledger_server: LedgerProcess, admin: Admin, priced_lane: str) -> Iterator[Bookings]:
    view = Bookings(ledger_server, admin, priced_lane)
    try:
        yield view
    finally:
        view.close()


SdkFactory = Callable[..., Any]


@pytest.fixture
def make_openai(ledger: LaneClient, provider: FakeProvider) -> Iterator[SdkFactory]:
    """Builds openai clients booked with `ledger` (or `lane_client=`); closes them after."""
    made: list[Any] = []

    def build(lane_client: LaneClient | None = None, **options: Any) -> Any:
        options.setdefault("max_retries", 0)
        options.setdefault("base_url", f"{provider.url}/v1")
        client = openai_client(lane_client or ledger, api_key="test-key", **options)
        made.append(client)
        return client

    yield build
    for client in made:
        client.close()


@pytest.fixture
def make_anthropic(ledger: LaneClient, provider: FakeProvider) -> Iterator[SdkFactory]:
    made: list[Any] = []

    def build(lane_client: LaneClient | None = None, **options: Any) -> Any:
        options.setdefault("max_retries", 0)
        options.setdefault("base_url", provider.url)
        client = anthropic_client(lane_client or ledger, api_key="test-key", **options)
        made.append(client)
        return client

    yield build
    for client in made:
        client.close()


def booked(
    provider: FakeProvider, bookings: Bookings, *, attempts: int = 1
) -> list[tuple[Received, pb.Booking]]:
    """Each booked request the provider got, with its booking: tagged in the
    header, and booked at exactly the bytes received."""
    received = provider.booked_requests()
    assert len(received) == attempts
    pairs = []
    for request in received:
        reservation_id = request.headers[RESERVATION_HEADER.lower()]
        booking = bookings.get(reservation_id)
        assert booking.request_bytes == len(request.body)
        pairs.append((request, booking))
    assert len({booking.reservation_id for _, booking in pairs}) == attempts
    return pairs


def only_booked(provider: FakeProvider, bookings: Bookings) -> tuple[Received, pb.Booking]:
    [pair] = booked(provider, bookings)
    return pair


def assert_openai_tag(request: Received, booking: pb.Booking) -> None:
    """The id in the body's metadata where OpenAI takes metadata: a Responses
    call, or a chat completion that is stored. A chat completion not stored
    carries it in the header only (`booked` checks the header)."""
    body = request.json()
    if request.path.endswith("/chat/completions") and body.get("store") is not True:
        assert OPENAI_METADATA_KEY not in (body.get("metadata") or {})
    else:
        assert body["metadata"][OPENAI_METADATA_KEY] == booking.reservation_id


def assert_anthropic_tag(request: Received, booking: pb.Booking) -> None:
    assert request.json()["metadata"]["user_id"] == booking.reservation_id


def assert_refunded(bookings: Bookings, booking: pb.Booking, status: int) -> None:
    now = bookings.get(booking.reservation_id)
    assert now.state == pb.REFUNDED and now.amount_nanos == 0
    assert bookings.ended(booking.reservation_id).http_status == status


def assert_unknown(bookings: Bookings, booking: pb.Booking) -> None:
    now = bookings.get(booking.reservation_id)
    assert now.state == pb.SETTLED_UNKNOWN
    assert 0 < now.amount_nanos <= now.hold_nanos <= now.cap_nanos
    assert bookings.ended(booking.reservation_id).outcome == pb.UNKNOWN


def assert_settled(bookings: Bookings, booking: pb.Booking, charge: int, **tokens: int) -> None:
    now = bookings.get(booking.reservation_id)
    assert now.state == pb.SETTLED and now.amount_nanos == charge
    event = bookings.ended(booking.reservation_id)
    assert event.outcome == pb.SUCCEEDED
    for name, value in tokens.items():
        assert getattr(event, name) == value, name


# OpenAI -------------------------------------------------------------------------------


def test_openai_chat_success_settles_with_cached_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    client = make_openai()
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, metadata={"team": "recall"}, store=True
    )
    assert completion.choices[0].message.content == "hello"
    request, booking = only_booked(provider, bookings)
    body = request.json()
    # The caller's metadata is kept, the tag merged in; no max given: the default,
    # written into the body, is what the ledger holds.
    assert body["metadata"] == {"team": "recall", OPENAI_METADATA_KEY: booking.reservation_id}
    assert body["max_completion_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS
    assert booking.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS and booking.model == MODEL
    # 200 uncached at 1 + 1000 cached at 0.5 + 30 output at 2.
    assert_settled(bookings, booking, 200 + 500 + 60, input_tokens=1200, cached_input_tokens=1000,
                   output_tokens=30, http_status=200)  # fmt: skip


def test_openai_chat_not_stored_is_tagged_in_the_header_only(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    # OpenAI refuses a chat completion's metadata unless it is stored (400,
    # "The 'metadata' parameter is only allowed when 'store' is enabled."):
    # tagged in its metadata, every such call of a lane was refused.
    client = make_openai()
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=64
    )
    assert completion.choices[0].message.content == "hello"
    request, booking = only_booked(provider, bookings)
    assert "metadata" not in request.json()
    assert request.headers[RESERVATION_HEADER.lower()] == booking.reservation_id
    assert_settled(bookings, booking, 200 + 500 + 60, input_tokens=1200, cached_input_tokens=1000)


def test_openai_responses_success(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    client = make_openai()
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=256)
    assert response.output_text == "hello"
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert booking.max_output_tokens == 256 and request.json()["max_output_tokens"] == 256
    # 200 uncached + 600 cached at 0.5 + 40 output at 2.
    assert_settled(bookings, booking, 200 + 300 + 80, input_tokens=800, cached_input_tokens=600)


def test_openai_chat_with_several_choices_reserves_and_settles_every_choice(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    # `n` choices each get up to the bound: 3 x 64 output tokens is what the
    # call can bill, so that is the bound the ledger holds. Reserved for one
    # choice, the real usage was refused (more output than the max) and the
    # call settled UNKNOWN at a hold a third of what it could cost.
    provider.script(Reply(body=openai_chat_body(prompt=100, cached=0, completion=3 * 64)))
    client = make_openai()
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64, n=3)
    request, booking = only_booked(provider, bookings)
    assert request.json()["n"] == 3 and request.json()["max_completion_tokens"] == 64
    assert booking.max_output_tokens == 3 * 64
    # 100 input at 1 + 192 output at 2.
    assert_settled(bookings, booking, 100 + 384, input_tokens=100, output_tokens=192)


def test_openai_caller_metadata_key_is_left_alone(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    client = make_openai()
    client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        metadata={OPENAI_METADATA_KEY: "mine"},
        store=True,
    )
    request, booking = only_booked(provider, bookings)
    assert request.json()["metadata"] == {OPENAI_METADATA_KEY: "mine"}
    assert booking.max_output_tokens == 64 and "max_completion_tokens" not in request.json()


def test_openai_context_overflow_is_refunded_and_recognised(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(status=400, body=OPENAI_OVERFLOW))
    client = make_openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    assert is_context_overflow(raised.value.status_code, raised.value.response.content)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_refunded(bookings, booking, 400)


def test_openai_forbidden_is_refunded(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(status=403, body=OPENAI_FORBIDDEN))
    client = make_openai()
    with pytest.raises(openai.PermissionDeniedError) as raised:
        client.responses.create(model=MODEL, input="Say hello.")
    assert not is_context_overflow(403, raised.value.response.content)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_refunded(bookings, booking, 403)


def test_openai_rate_limited_attempts_are_each_booked_and_refunded(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    limited = Reply(status=429, body=OPENAI_RATE_LIMITED, headers={"retry-after-ms": "10"})
    provider.script(limited, limited)
    client = make_openai(max_retries=1)  # the SDK retries once
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    for request, booking in booked(provider, bookings, attempts=2):
        assert_openai_tag(request, booking)
        assert_refunded(bookings, booking, 429)


def test_openai_server_error_without_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(status=500, body=OPENAI_SERVER_ERROR))
    client = make_openai()
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_unknown(bookings, booking)
    assert bookings.ended(booking.reservation_id).http_status == 500


def test_openai_server_error_with_usage_is_settled(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    body = {**OPENAI_SERVER_ERROR, "usage": openai_chat_body(100, 0, 5)["usage"]}
    provider.script(Reply(status=503, body=body))
    client = make_openai()
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    _, booking = only_booked(provider, bookings)
    assert_settled(bookings, booking, 100 + 10, input_tokens=100, http_status=503)


def test_openai_stall_past_the_timeout_is_unknown_at_most_the_hold(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(delay=STALL_SECONDS, body=openai_chat_body()))
    client = make_openai(timeout=SDK_TIMEOUT_SECONDS)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_unknown(bookings, booking)


def test_openai_chat_stream_is_settled_from_its_final_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(events=openai_chat_stream()))
    client = make_openai()
    with client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=64, stream=True
    ) as stream:
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "hello"
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert request.json()["stream_options"] == {"include_usage": True}
    assert request.headers["accept-encoding"] == "identity"
    assert_settled(bookings, booking, 200 + 500 + 60, input_tokens=1200, cached_input_tokens=1000)


def test_openai_responses_stream_is_settled_from_response_completed(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(events=openai_responses_stream()))
    client = make_openai()
    with client.responses.create(
        model=MODEL, input="Say hello.", max_output_tokens=64, stream=True
    ) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.completed"
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert "stream_options" not in request.json()
    assert_settled(bookings, booking, 200 + 300 + 80, input_tokens=800, output_tokens=40)


def test_openai_stream_cut_off_before_its_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    provider.script(Reply(events=openai_chat_stream(), cut_after=3))
    client = make_openai()
    with (
        pytest.raises(openai.APIConnectionError),
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=64, stream=True
        ) as stream,
    ):
        for _ in stream:
            pass
    _, booking = only_booked(provider, bookings)
    assert_unknown(bookings, booking)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_stream_dropped_unread_is_ended_when_python_collects_it(
    provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory,
    make_anthropic: SdkFactory, sdk: str,
) -> None:  # fmt: skip
    # The provider ran the call (a 200 event stream came back), but nothing
    # iterated or closed it: no generator was ever started, so nothing ended
    # its booking, collected or not, and it stayed open until its hold
    # expired (at zero on a lane whose expire_charge is ZERO).
    if sdk == "openai":
        provider.script(Reply(events=openai_chat_stream()))
        stream: Any = make_openai().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=64, stream=True
        )
    else:
        provider.script(Reply(events=anthropic_stream()))
        stream = make_anthropic().messages.create(
            model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
        )
    _, booking = only_booked(provider, bookings)
    del stream
    gc.collect()  # the SDKs' stream objects hold a reference cycle
    deadline = time.monotonic() + 5
    while bookings.get(booking.reservation_id).state == pb.OPEN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_unknown(bookings, booking)


def test_openai_redirect_is_refunded_and_the_call_booked_where_it_runs(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    # A 307 (a gateway moved, http to https) runs nothing: the SDK's client
    # follows it, and the request it sends again is booked anew. The redirect
    # was settled UNKNOWN at its hold, so every call paid one hold too many.
    provider.script(Reply(status=307, headers={"location": "/v1/responses"}))
    client = make_openai()
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=64)
    assert response.output_text == "hello"
    (_, redirected), (request, booking) = booked(provider, bookings, attempts=2)
    assert_refunded(bookings, redirected, 0)
    assert_openai_tag(request, booking)
    assert_settled(bookings, booking, 200 + 300 + 80, input_tokens=800, output_tokens=40)


def test_openai_denied_sends_nothing(
    ledger_server: LedgerProcess,
    admin: Admin,
    lane_grant: str,
    provider: FakeProvider,
    make_openai: SdkFactory,
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 100, prices={MODEL: PRICE})  # less than any hold
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as poor:
        client = make_openai(poor, max_retries=2)
        with pytest.raises(Denied) as raised:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert raised.value.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
    assert provider.received == []


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_transport_never_calls_the_provider_under_an_id_another_process_reserved(
    ledger_server: LedgerProcess,
    priced_lane: str,
    lane_grant: str,
    provider: FakeProvider,
    bookings: Bookings,
    make_openai: SdkFactory,
    make_anthropic: SdkFactory,
    monkeypatch: pytest.MonkeyPatch,
    sdk: str,
) -> None:
    """Two processes whose transports reserve under one id (a lane restarted
    with an id it chose): the second's Reserve gets the first answer,
    admitted, and its provider call would run again under the ended booking,
    its cost never booked. One id, one provider call."""
    rid = f"fixed-{sdk}"
    monkeypatch.setattr(providers, "new_reservation_id", lambda: rid)

    def create(lane_client: LaneClient) -> object:
        if sdk == "openai":
            return make_openai(lane_client).chat.completions.create(model=MODEL, messages=MESSAGES)
        client = make_anthropic(lane_client)
        return client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)

    address = ledger_server.address
    with LaneClient(address, priced_lane, grant=lane_grant, settings=TEST_SETTINGS) as first:
        create(first)
    with (
        LaneClient(address, priced_lane, grant=lane_grant, settings=TEST_SETTINGS) as second,
        pytest.raises(ReservationConflict) as refused,
    ):
        create(second)
    assert refused.value.reason == "RESERVATION_ID_REUSED" and rid in refused.value.message
    assert len(provider.booked_requests()) == 1
    assert [event.kind for event in bookings.admin_events()] == ["reserved", "settled"]


def test_openai_other_requests_pass_through_unbooked(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    client = make_openai()
    assert [model.id for model in client.models.list()] == [MODEL]
    [request] = provider.received
    assert request.path == "/v1/models" and RESERVATION_HEADER.lower() not in request.headers
    assert bookings.count() == 0


# Anthropic ------------------------------------------------------------------------------


def test_anthropic_success_settles_with_cache_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    client = make_anthropic()
    message = client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    assert message.content[0].text == "hello"
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert booking.max_output_tokens == 128
    # 25 uncached at 1 + 100 read at 0.5 + 10 written at 1.25 (12.5, up) + 15 output at 2.
    assert_settled(bookings, booking, 25 + 50 + 13 + 30, input_tokens=135, cached_input_tokens=100,
                   cache_write_tokens=10, output_tokens=15)  # fmt: skip


def test_anthropic_caller_user_id_is_left_alone(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    client = make_anthropic()
    client.messages.create(
        model=MODEL, max_tokens=128, messages=MESSAGES, metadata={"user_id": "user-7"}
    )
    request, booking = only_booked(provider, bookings)
    assert request.json()["metadata"] == {"user_id": "user-7"}
    assert_settled(bookings, booking, 118)


def test_anthropic_context_overflow_is_refunded_and_recognised(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(status=400, body=ANTHROPIC_OVERFLOW))
    client = make_anthropic()
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    assert is_context_overflow(raised.value.status_code, raised.value.response.content)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_refunded(bookings, booking, 400)


def test_anthropic_forbidden_is_refunded(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(status=403, body=ANTHROPIC_FORBIDDEN))
    client = make_anthropic()
    with pytest.raises(anthropic.PermissionDeniedError):
        client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_refunded(bookings, booking, 403)


def test_anthropic_rate_limited_attempts_are_each_booked_and_refunded(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    limited = Reply(status=429, body=ANTHROPIC_RATE_LIMITED, headers={"retry-after-ms": "10"})
    provider.script(limited, limited)
    client = make_anthropic(max_retries=1)
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    for request, booking in booked(provider, bookings, attempts=2):
        assert_anthropic_tag(request, booking)
        assert_refunded(bookings, booking, 429)


def test_anthropic_server_error_without_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(status=500, body=ANTHROPIC_SERVER_ERROR))
    client = make_anthropic()
    with pytest.raises(anthropic.InternalServerError):
        client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_unknown(bookings, booking)


def test_anthropic_stall_past_the_timeout_is_unknown_at_most_the_hold(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(delay=STALL_SECONDS, body=anthropic_message_body()))
    client = make_anthropic(timeout=SDK_TIMEOUT_SECONDS)
    with pytest.raises(anthropic.APITimeoutError):
        client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_unknown(bookings, booking)


def test_anthropic_stream_is_settled_from_message_start_and_delta(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(events=anthropic_stream(output=42)))
    client = make_anthropic()
    with client.messages.create(
        model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
    ) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "message_stop"
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_settled(bookings, booking, 25 + 50 + 13 + 84, input_tokens=135, output_tokens=42,
                   cached_input_tokens=100, cache_write_tokens=10)  # fmt: skip


def test_anthropic_stream_closed_before_its_delta_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(events=anthropic_stream()))
    client = make_anthropic()
    with client.messages.create(
        model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
    ) as stream:
        first = next(iter(stream))
    assert first.type == "message_start"  # input usage only: the output is unknown
    _, booking = only_booked(provider, bookings)
    assert_unknown(bookings, booking)


def test_anthropic_stream_cut_off_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    provider.script(Reply(events=anthropic_stream(), cut_after=4))
    client = make_anthropic()
    # A broken stream's httpx2 error: through as it is (anthropic < 2.17), or
    # wrapped in the SDK's connection error (2.17 and later).
    with (
        pytest.raises((httpx2.RemoteProtocolError, anthropic.APIConnectionError)),
        client.messages.create(
            model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
        ) as stream,
    ):
        for _ in stream:
            pass
    _, booking = only_booked(provider, bookings)
    assert_unknown(bookings, booking)


def test_anthropic_denied_is_raised_as_denied_and_not_retried(
    ledger_server: LedgerProcess,
    admin: Admin,
    lane_grant: str,
    provider: FakeProvider,
    make_anthropic: SdkFactory,
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 100, prices={MODEL: PRICE})
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as poor:
        client = make_anthropic(poor, max_retries=2)
        with pytest.raises(Denied) as raised:
            client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        assert raised.value.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
        # One Reserve, not three: the SDK did not take the denial for a connection error.
        assert len([e for e in admin.events(lane) if e.kind == "denied"]) == 1
    assert provider.received == []


def test_anthropic_count_tokens_passes_through_unbooked(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, make_anthropic: SdkFactory
) -> None:
    client = make_anthropic()
    assert client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens == 12
    [request] = provider.received
    assert request.path == "/v1/messages/count_tokens"
    assert RESERVATION_HEADER.lower() not in request.headers and "metadata" not in request.json()
    assert bookings.count() == 0


def test_openai_refused_connection_is_refunded_as_never_sent(
    ledger: LaneClient, bookings: Bookings, make_openai: SdkFactory
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_openai(base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
    [reserved, refunded] = bookings.admin_events()
    assert reserved.kind == "reserved" and refunded.kind == "refunded"
    assert refunded.http_status == 0 and refunded.reason.startswith("could not connect")


def test_openai_request_not_written_whole_is_refunded_as_never_sent(
    ledger: LaneClient, bookings: Bookings, make_openai: SdkFactory
) -> None:
    # A provider that takes the connection but never reads: the body's write
    # times out before its last byte, so no whole request arrived and nothing
    # ran. It was settled UNKNOWN at its hold. Both socket buffers are small
    # (no autotuning), so 1 MB cannot fit in them.
    small_buffers = [(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        port = silent.getsockname()[1]
        client = make_openai(
            base_url=f"http://127.0.0.1:{port}/v1",
            timeout=httpx2.Timeout(30.0, write=0.5),
            inner=httpx2.HTTPTransport(socket_options=small_buffers),
        )
        large = [{"role": "user", "content": "x" * 1_000_000}]
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=large, max_completion_tokens=64)
    [reserved, refunded] = bookings.admin_events()
    assert reserved.kind == "reserved" and refunded.kind == "refunded"
    assert refunded.http_status == 0 and refunded.reason.startswith("not sent whole")


def test_booking_options_change_the_bound_and_the_tag(
    provider: FakeProvider, bookings: Bookings, make_openai: SdkFactory
) -> None:
    options = BookingOptions(default_max_output_tokens=77, tag_body=False)
    client = make_openai(options=options)
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    request, booking = only_booked(provider, bookings)
    body = request.json()
    assert "metadata" not in body  # the header only
    assert request.headers[RESERVATION_HEADER.lower()] == booking.reservation_id
    assert body["max_completion_tokens"] == 77 and booking.max_output_tokens == 77
    with pytest.raises(ValueError, match="default_max_output_tokens"):
        BookingOptions(default_max_output_tokens=-1)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"ledger_model": {"gpt-4o-2024-08-06": "gpt-4o"}}, "ledger_model"),
        ({"ttl": 30}, "ttl"),
        ({"tag_body": "no"}, "tag_body"),
    ],
)
def test_booking_options_of_the_wrong_type_are_refused_where_they_are_made(
    options: dict[str, object], named: str
) -> None:
    # Taken, a mapping for ledger_model or seconds for ttl failed each request
    # inside the SDK's call ("'dict' object is not callable"), and a "no"
    # tagged the body all the same.
    with pytest.raises(TypeError, match=named):
        BookingOptions(**options)  # type: ignore[arg-type]


def test_an_integral_float_bound_is_a_count_and_the_body_goes_as_written() -> None:
    # JSON has one number type: `"max_tokens": 100.0` is the bound 100, as the
    # Node client reads it (JSON.parse gives 100) and as usage_of reads an
    # integral count. Read as "not a count", the default was reserved instead.
    from ledger_client.providers import CallStyle, prepare_request

    raw = b'{"model": "m", "max_tokens": 100.0, "metadata": {"ledger_reservation_id": "mine"}}'
    request = httpx2.Request("POST", "http://provider/v1/chat/completions", content=raw)
    prepared = prepare_request(request, CallStyle.OPENAI_CHAT, "r-1")
    assert prepared.max_output_tokens == 100
    assert isinstance(prepared.max_output_tokens, int)
    assert prepared.body == raw
    # A fraction or a float past 2^53 is still no count: the default is reserved.
    for bound in (b"100.5", b"1e300", b"true"):
        odd = raw.replace(b"100.0", bound)
        request = httpx2.Request("POST", "http://provider/v1/chat/completions", content=odd)
        prepared = prepare_request(request, CallStyle.OPENAI_CHAT, "r-1")
        assert prepared.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS
        assert prepared.body == odd
