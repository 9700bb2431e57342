"""usage_of reads the openai and anthropic SDKs' own reply objects, which a
lane calling the SDK inside `model_call` passes as they come."""

from __future__ import annotations

from anthropic.types import Message
from ledger_client import Usage, usage_of
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from provider_fakes import anthropic_message_body, openai_chat_body, openai_responses_body


def test_an_openai_chat_completion_is_read_like_its_body() -> None:
    body = openai_chat_body(prompt=1_200, cached=1_000, completion=30)
    reply = ChatCompletion.model_validate(body)
    assert usage_of(reply) == usage_of(body) == Usage(1_200, 30, cached_input_tokens=1_000)
    assert usage_of(reply.usage) == usage_of(body)


def test_an_openai_response_is_read_like_its_body() -> None:
    body = openai_responses_body(input_tokens=800, cached=600, output=40)
    body["usage"]["input_tokens_details"]["cache_write_tokens"] = 100
    reply = Response.model_validate(body)
    expected = Usage(800, 40, cached_input_tokens=600, cache_write_tokens=100)
    assert usage_of(reply) == usage_of(reply.usage) == expected


def test_an_anthropic_message_is_read_like_its_body() -> None:
    body = anthropic_message_body(uncached=25, read=100, written=10, output=15)
    reply = Message.model_validate(body)
    expected = Usage(135, 15, cached_input_tokens=100, cache_write_tokens=10)
    assert usage_of(reply) == usage_of(reply.usage) == usage_of(body) == expected


def test_an_sdk_reply_without_usage_is_no_usage() -> None:
    body = openai_chat_body()
    body["usage"] = None
    assert usage_of(ChatCompletion.model_validate(body)) is None
