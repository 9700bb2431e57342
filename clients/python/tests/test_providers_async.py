"""The real async SDKs (`openai.AsyncOpenAI`, `anthropic.AsyncAnthropic`) over
real HTTP to the local fake provider, booked through AsyncLedgerTransport with
a real ledger: the cases of test_providers.py, with its fixtures and checks.

pytest has no asyncio plugin here: each test drives its SDK with asyncio.run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

# The extras are installed by `make install`: a missing SDK fails here, never skips.
import anthropic
import openai
import pytest
import test_providers as sync_cases
from client_ledger import TEST_SETTINGS, Admin, LedgerProcess, new_lane_name
from ledger_client import DenialReason, Denied, LaneClient, is_context_overflow
from ledger_client.providers import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    OPENAI_METADATA_KEY,
    RESERVATION_HEADER,
    AsyncLedgerTransport,
    async_anthropic_client,
    async_openai_client,
)
from provider_fakes import (
    ANTHROPIC_OVERFLOW,
    ANTHROPIC_SERVER_ERROR,
    MODEL,
    OPENAI_OVERFLOW,
    OPENAI_SERVER_ERROR,
    FakeProvider,
    Reply,
    anthropic_message_body,
    anthropic_stream,
    openai_chat_body,
    openai_chat_stream,
    openai_responses_stream,
)
from test_providers import (
    MESSAGES,
    PRICE,
    SDK_TIMEOUT_SECONDS,
    STALL_SECONDS,
    Bookings,
    assert_anthropic_tag,
    assert_openai_tag,
    assert_refunded,
    assert_settled,
    assert_unknown,
    booked,
    only_booked,
)

# The fixtures of test_providers.py, by the names the tests take.
provider_server = sync_cases.provider_server
provider = sync_cases.provider
priced_lane = sync_cases.priced_lane
ledger = sync_cases.ledger
bookings = sync_cases.bookings

AsyncTest = Callable[[], Coroutine[Any, Any, None]]


def run(test: AsyncTest) -> None:
    asyncio.run(test())


@contextlib.asynccontextmanager
async def async_openai(
    lane_client: LaneClient, provider: FakeProvider, **options: Any
) -> AsyncIterator[Any]:
    options.setdefault("max_retries", 0)
    options.setdefault("base_url", f"{provider.url}/v1")
    client = async_openai_client(lane_client, api_key="test-key", **options)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def async_anthropic(
    lane_client: LaneClient, provider: FakeProvider, **options: Any
) -> AsyncIterator[Any]:
    options.setdefault("max_retries", 0)
    options.setdefault("base_url", provider.url)
    client = async_anthropic_client(lane_client, api_key="test-key", **options)
    try:
        yield client
    finally:
        await client.close()


def test_the_clients_are_the_async_sdks_on_the_async_transport(
    ledger: LaneClient, provider: FakeProvider
) -> None:
    async def test() -> None:
        async with async_openai(ledger, provider) as gpt, async_anthropic(ledger, provider) as ant:
            assert isinstance(gpt, openai.AsyncOpenAI)
            assert isinstance(ant, anthropic.AsyncAnthropic)
            for client in (gpt, ant):
                assert isinstance(client._client._transport, AsyncLedgerTransport)

    run(test)


# OpenAI -------------------------------------------------------------------------------


def test_openai_chat_success_settles_with_cached_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, metadata={"team": "recall"}, store=True
            )
        assert completion.choices[0].message.content == "hello"

    run(test)
    request, booking = only_booked(provider, bookings)
    body = request.json()
    assert body["metadata"] == {"team": "recall", OPENAI_METADATA_KEY: booking.reservation_id}
    assert body["max_completion_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS
    assert booking.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS and booking.model == MODEL
    assert_settled(bookings, booking, 200 + 500 + 60, input_tokens=1200, cached_input_tokens=1000,
                   output_tokens=30, http_status=200)  # fmt: skip


def test_openai_context_overflow_is_refunded_and_recognised(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(status=400, body=OPENAI_OVERFLOW))

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_completion_tokens=64
                )
        assert is_context_overflow(raised.value.status_code, raised.value.response.content)

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_refunded(bookings, booking, 400)


def test_openai_server_error_without_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(status=500, body=OPENAI_SERVER_ERROR))

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_completion_tokens=64
                )

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_unknown(bookings, booking)
    assert bookings.ended(booking.reservation_id).http_status == 500


def test_openai_stall_past_the_timeout_is_unknown_at_most_the_hold(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(delay=STALL_SECONDS, body=openai_chat_body()))

    async def test() -> None:
        async with async_openai(ledger, provider, timeout=SDK_TIMEOUT_SECONDS) as client:
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_completion_tokens=64
                )

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_unknown(bookings, booking)


def test_openai_chat_stream_is_settled_from_its_final_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(events=openai_chat_stream()))

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_completion_tokens=64, stream=True
            )
            async with stream:
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
        assert text == "hello"

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert request.json()["stream_options"] == {"include_usage": True}
    assert request.headers["accept-encoding"] == "identity"
    assert_settled(bookings, booking, 200 + 500 + 60, input_tokens=1200, cached_input_tokens=1000)


def test_openai_responses_stream_is_settled_from_response_completed(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(events=openai_responses_stream()))

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            stream = await client.responses.create(
                model=MODEL, input="Say hello.", max_output_tokens=64, stream=True
            )
            async with stream:
                kinds = [event.type async for event in stream]
        assert kinds[-1] == "response.completed"

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_openai_tag(request, booking)
    assert_settled(bookings, booking, 200 + 300 + 80, input_tokens=800, output_tokens=40)


def test_openai_stream_cut_off_before_its_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(events=openai_chat_stream(), cut_after=3))

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_completion_tokens=64, stream=True
            )
            with pytest.raises(openai.APIConnectionError):
                async with stream:
                    async for _ in stream:
                        pass

    run(test)
    _, booking = only_booked(provider, bookings)
    assert_unknown(bookings, booking)


def test_openai_denied_sends_nothing(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str, provider: FakeProvider
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 100, prices={MODEL: PRICE})  # less than any hold

    async def test() -> None:
        with LaneClient(
            ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS
        ) as poor:
            async with async_openai(poor, provider, max_retries=2) as client:
                with pytest.raises(Denied) as raised:
                    await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert raised.value.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT

    run(test)
    assert len([e for e in admin.events(lane) if e.kind == "denied"]) == 1
    assert provider.received == []


def test_openai_other_requests_pass_through_unbooked(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            assert [model.id async for model in client.models.list()] == [MODEL]

    run(test)
    [request] = provider.received
    assert request.path == "/v1/models" and RESERVATION_HEADER.lower() not in request.headers
    assert bookings.count() == 0


# Anthropic ------------------------------------------------------------------------------


def test_anthropic_success_settles_with_cache_usage(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            message = await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        assert message.content[0].text == "hello"

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert booking.max_output_tokens == 128
    assert_settled(bookings, booking, 25 + 50 + 13 + 30, input_tokens=135, cached_input_tokens=100,
                   cache_write_tokens=10, output_tokens=15)  # fmt: skip


def test_anthropic_redirect_is_refunded_and_the_call_booked_where_it_runs(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    # A 308 runs nothing: refunded; the request the SDK's client sends again
    # is booked anew and tagged with that booking's id.
    provider.script(Reply(status=308, headers={"location": "/v1/messages"}))

    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            message = await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        assert message.content[0].text == "hello"

    run(test)
    (_, redirected), (request, booking) = booked(provider, bookings, attempts=2)
    assert_refunded(bookings, redirected, 0)
    assert_anthropic_tag(request, booking)
    assert_settled(bookings, booking, 25 + 50 + 13 + 30, input_tokens=135)


def test_anthropic_context_overflow_is_refunded_and_recognised(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(status=400, body=ANTHROPIC_OVERFLOW))

    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            with pytest.raises(anthropic.BadRequestError) as raised:
                await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        assert is_context_overflow(raised.value.status_code, raised.value.response.content)

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_refunded(bookings, booking, 400)


def test_anthropic_server_error_without_usage_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(status=500, body=ANTHROPIC_SERVER_ERROR))

    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            with pytest.raises(anthropic.InternalServerError):
                await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_unknown(bookings, booking)


def test_anthropic_stall_past_the_timeout_is_unknown_at_most_the_hold(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(delay=STALL_SECONDS, body=anthropic_message_body()))

    async def test() -> None:
        async with async_anthropic(ledger, provider, timeout=SDK_TIMEOUT_SECONDS) as client:
            with pytest.raises(anthropic.APITimeoutError):
                await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_unknown(bookings, booking)


def test_anthropic_stream_is_settled_from_message_start_and_delta(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(events=anthropic_stream(output=42)))

    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            stream = await client.messages.create(
                model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
            )
            async with stream:
                kinds = [event.type async for event in stream]
        assert kinds[-1] == "message_stop"

    run(test)
    request, booking = only_booked(provider, bookings)
    assert_anthropic_tag(request, booking)
    assert_settled(bookings, booking, 25 + 50 + 13 + 84, input_tokens=135, output_tokens=42,
                   cached_input_tokens=100, cache_write_tokens=10)  # fmt: skip


def test_anthropic_stream_closed_before_its_delta_is_unknown(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings
) -> None:
    provider.script(Reply(events=anthropic_stream()))

    async def test() -> None:
        async with async_anthropic(ledger, provider) as client:
            stream = await client.messages.create(
                model=MODEL, max_tokens=128, messages=MESSAGES, stream=True
            )
            async with stream:  # closed (aclose) after the first event
                first = await stream.__aiter__().__anext__()
        assert first.type == "message_start"  # input usage only: the output is unknown

    run(test)
    _, booking = only_booked(provider, bookings)
    assert_unknown(bookings, booking)


def test_anthropic_denied_is_raised_as_denied_and_not_retried(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str, provider: FakeProvider
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 100, prices={MODEL: PRICE})

    async def test() -> None:
        with LaneClient(
            ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS
        ) as poor:
            async with async_anthropic(poor, provider, max_retries=2) as client:
                with pytest.raises(Denied) as raised:
                    await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        assert raised.value.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT

    run(test)
    # One Reserve, not three: the SDK did not take the denial for a connection error.
    assert len([e for e in admin.events(lane) if e.kind == "denied"]) == 1
    assert provider.received == []


# Off the event loop --------------------------------------------------------------------

SLOW_LEDGER_SECONDS = 0.3


def slow_ledger(ledger: LaneClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Makes each Reserve and each end of `ledger` take SLOW_LEDGER_SECONDS;
    returns the names of the threads they ran in, as they run."""
    threads: list[str] = []
    for name in ("reserve_arguments", "end"):
        real = getattr(ledger, name)

        def slow(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            threads.append(f"{_name}:{threading.current_thread().name}")
            time.sleep(SLOW_LEDGER_SECONDS)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ledger, name, slow)
    return threads


def test_a_slow_ledger_does_not_block_the_event_loop(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = slow_ledger(ledger, monkeypatch)
    ticks: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def test() -> None:
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(stop))
        async with async_anthropic(ledger, provider) as client:
            await client.messages.create(model=MODEL, max_tokens=128, messages=MESSAGES)
        stop.set()
        await ticking

    run(test)
    main = threading.main_thread().name
    assert [t.split(":")[0] for t in threads] == ["reserve_arguments", "end"]
    assert all(not t.endswith(f":{main}") for t in threads), threads
    # The loop went on ticking while the ledger took 2 x 0.3 s: no gap near that long.
    assert len(ticks) > 20
    assert max(b - a for a, b in itertools.pairwise(ticks)) < SLOW_LEDGER_SECONDS
    _, booking = only_booked(provider, bookings)
    assert_settled(bookings, booking, 118)


def test_a_caller_cancelled_during_its_reserve_is_refunded_and_sends_nothing(
    ledger: LaneClient, provider: FakeProvider, bookings: Bookings, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_ledger(ledger, monkeypatch)

    async def test() -> None:
        async with async_openai(ledger, provider) as client:
            call = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_completion_tokens=64
            )
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(call, SLOW_LEDGER_SECONDS / 3)
            # The worker finishes the Reserve, then refunds it as not sent.
            await asyncio.sleep(3 * SLOW_LEDGER_SECONDS)

    run(test)
    assert provider.received == []
    [reserved, refunded] = bookings.admin_events()
    assert reserved.kind == "reserved" and refunded.kind == "refunded"
    assert refunded.reason == "cancelled before sending"
