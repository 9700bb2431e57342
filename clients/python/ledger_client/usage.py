"""A provider's usage block, read into the client's `Usage`.

`Usage.input_tokens` counts EVERY input token (the cached and cache-write ones
are parts of it) and `Usage.output_tokens` every output token, reasoning
tokens included. Providers count differently, so each style is read by its
own rule:

- OpenAI chat completions: `prompt_tokens` already counts every input token,
  `prompt_tokens_details.cached_tokens` is the cached part of it, and
  `prompt_tokens_details.cache_write_tokens` the part written to the cache,
  and `completion_tokens` already counts the reasoning tokens
  (`completion_tokens_details.reasoning_tokens`), so they are not added again.
  Its Responses API counts the same way under the names `input_tokens`,
  `input_tokens_details.cached_tokens` / `.cache_write_tokens` and
  `output_tokens`.
- Anthropic messages: `input_tokens` EXCLUDES the cache, so the input is
  `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`; the
  cached part is `cache_read_input_tokens`, the written part
  `cache_creation_input_tokens`; `output_tokens` is taken as it is.

A missing or null count is 0. A block with no input token at all is no
evidence of a billed call (the ledger refuses such a SUCCEEDED settle), so it
reads as no usage: the call is then charged at its hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ledger_client.outcomes import Usage


class SdkModel(Protocol):
    """An SDK's typed response or usage object (openai's and anthropic's are
    pydantic models: ChatCompletion, Response, Message, their `.usage`)."""

    def model_dump(self) -> dict[str, Any]: ...


def usage_of(body: Mapping[str, Any] | SdkModel | None) -> Usage | None:
    """The usage of a provider's response body (its `usage` object; the usage
    object itself is taken too; an SDK's reply or usage object as its
    `model_dump()`), or None when it reports none. Raises
    ValueError for a count that is not a non-negative integer."""
    body = _as_mapping(body)
    if body is None:
        return None
    block = body.get("usage", body)
    if not isinstance(block, Mapping):
        return None
    usage = _read_block(block)
    if usage is None or usage.input_tokens == 0:
        return None
    return usage


def _as_mapping(body: object) -> Mapping[str, Any] | None:
    """A parsed body as it is, an SDK object as its dump: read as None, the
    SDK's own reply settled UNKNOWN at the hold instead of its real cost."""
    if isinstance(body, Mapping):
        return body
    dump = getattr(body, "model_dump", None)
    value = dump() if callable(dump) else None
    return value if isinstance(value, Mapping) else None


def _read_block(block: Mapping[str, Any]) -> Usage | None:
    if "prompt_tokens" in block:  # OpenAI chat completions
        return _openai_style(block, "prompt_tokens", "prompt_tokens_details", "completion_tokens")
    if "input_tokens_details" in block:  # OpenAI Responses: input_tokens counts the cache
        return _openai_style(block, "input_tokens", "input_tokens_details", "output_tokens")
    if "input_tokens" in block:  # Anthropic: input_tokens excludes the cache
        return _anthropic_style(block)
    return None


def _openai_style(
    block: Mapping[str, Any], input_key: str, details_key: str, output_key: str
) -> Usage:
    details = block.get(details_key)
    if details is None:
        details = {}
    if not isinstance(details, Mapping):
        raise ValueError(f"usage {details_key} is not an object")
    return Usage(
        input_tokens=_count(block, input_key),
        output_tokens=_count(block, output_key),
        cached_input_tokens=_count(details, "cached_tokens"),
        cache_write_tokens=_count(details, "cache_write_tokens"),
    )


def _anthropic_style(block: Mapping[str, Any]) -> Usage:
    uncached_tokens = _count(block, "input_tokens")
    cached_input_tokens = _count(block, "cache_read_input_tokens")
    cache_write_tokens = _count(block, "cache_creation_input_tokens")
    return Usage(
        input_tokens=uncached_tokens + cached_input_tokens + cache_write_tokens,
        output_tokens=_count(block, "output_tokens"),
        cached_input_tokens=cached_input_tokens,
        cache_write_tokens=cache_write_tokens,
    )


# JSON has one number type: 900.0 is the count 900, as JavaScript reads it
# (the Node client's usageOf), up to the integers a double holds exactly.
_MAX_SAFE_INTEGER = 2**53 - 1


def _count(block: Mapping[str, Any], key: str) -> int:
    """A token count: a non-negative integer (an integral JSON number);
    missing or null is 0."""
    value = block.get(key)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_SAFE_INTEGER:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"usage {key} is not a non-negative integer")
    return value
