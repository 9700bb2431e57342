"""Context budgeting: estimates, the output reserve, tool schemas, largest-first
trimming with in-band markers, the floor, and the overflow classifier."""

from __future__ import annotations

import json

import pytest
from ledger_client.context import (
    CONTEXT_OVERFLOW_REPLY,
    ContextBudget,
    estimate_tokens,
    fit_tool_results,
    is_context_overflow,
    payload_bytes,
    tokens_of_bytes,
)

# A lane's fan-out of tool results: /api/issues, agents, events/recent,
# stuck-issues, streams/status, health.
SEED_SIZES = (316_876, 7_738, 789, 702, 406, 57)


def json_payload(size_bytes: int, seed: int) -> str:
    """A JSON-ish payload of exactly size_bytes bytes."""
    head = json.dumps({"result": seed, "items": []})[:-2]
    chunk = '{"id":7,"t":"2026-09-11T14:06:54Z","body":"# Issue\\n"},'
    body = chunk * (size_bytes // len(chunk) + 1)
    text = head + body
    return text[: size_bytes - 2] + "]}"


def seed_results() -> list[str]:
    return [json_payload(size, index) for index, size in enumerate(SEED_SIZES)]


def test_estimates_are_pessimistic_and_round_up() -> None:
    assert tokens_of_bytes(0) == 0
    assert tokens_of_bytes(1) == 1
    assert tokens_of_bytes(7) == 2
    assert tokens_of_bytes(8) == 3
    assert estimate_tokens("x" * 316_876) == 90_536  # exactly 316876 / 3.5
    assert estimate_tokens("x" * 316_877) == 90_537  # rounded up
    assert estimate_tokens("é") == 1  # two UTF-8 bytes
    assert tokens_of_bytes(400, bytes_per_token_milli=4000) == 100


def test_the_seed_shape_fits_keeps_the_small_ones_and_marks_the_large_one() -> None:
    results = seed_results()
    assert [len(result.encode()) for result in results] == list(SEED_SIZES)
    budget = ContextBudget(max_context_tokens=16_384, reserve_output_tokens=2_048)

    fit = fit_tool_results(results, budget)

    assert fit.fits
    assert fit.budget_tokens == 14_336
    assert fit.input_tokens <= 14_336
    assert fit.trimmed == (0,)
    assert fit.tool_results[1:] == tuple(results[1:])  # byte-identical
    large = fit.tool_results[0]
    assert "[... truncated " in large and "bytes of 316876" in large
    assert large.startswith(results[0][:1000])
    # Cut only as far as needed: most of the window goes to the large result.
    assert estimate_tokens(large) > 11_000
    assert fit.iterations <= 3


def test_the_output_reserve_is_withheld() -> None:
    results = ["a" * 7_000]  # 2,000 tokens
    assert fit_tool_results(results, ContextBudget(4_000, 1_000)).trimmed == ()
    assert fit_tool_results(results, ContextBudget(4_000, 2_500)).trimmed == (0,)


def test_messages_and_tool_schemas_are_counted() -> None:
    budget = ContextBudget(max_context_tokens=3_000, reserve_output_tokens=0)
    results = ["r" * 7_000]  # 2,000 tokens
    assert fit_tool_results(results, budget).trimmed == ()
    schemas = [
        json.dumps({"name": f"tool_{index}", "description": "d" * 600}) for index in range(6)
    ]
    fit = fit_tool_results(results, budget, messages=["hello"], tool_schemas=schemas)
    assert fit.fits and fit.trimmed == (0,)
    fixed = estimate_tokens("hello") + sum(estimate_tokens(schema) for schema in schemas)
    assert fit.input_tokens == fixed + estimate_tokens(fit.tool_results[0])


def compact_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_payload_that_is_not_text_is_measured_as_its_compact_json() -> None:
    message = {"role": "user", "content": "x" * 100_000}
    assert payload_bytes(message) == compact_json(message)
    assert estimate_tokens(message) == tokens_of_bytes(len(compact_json(message))) == 28_580
    messages = [message, {"role": "assistant", "content": "é日本語😀"}]
    assert estimate_tokens(messages) == tokens_of_bytes(len(compact_json(messages)))
    schema = {"name": "search", "parameters": {"type": "object", "properties": {}}}
    assert (
        payload_bytes(schema) == b'{"name":"search","parameters":{"type":"object","properties":{}}}'
    )
    # Text and bytes as they are; not JSON-quoted.
    assert payload_bytes("é") == "é".encode() and payload_bytes(b"\xff") == b"\xff"
    assert payload_bytes(bytearray(b"ab")) == b"ab" and payload_bytes(memoryview(b"ab")) == b"ab"
    assert payload_bytes(12) == b"12" and payload_bytes(None) == b"null"
    with pytest.raises(TypeError):
        payload_bytes({"not json": object()})


def test_message_dicts_and_schema_dicts_count_at_their_size() -> None:
    budget = ContextBudget(max_context_tokens=16_384, reserve_output_tokens=2_048)
    huge = [{"role": "user", "content": "x" * 100_000}]
    fit = fit_tool_results(["[]"], budget, messages=huge)
    assert not fit.fits and fit.input_tokens == estimate_tokens(huge[0]) + 1
    schemas = [{"name": "tool", "description": "d" * 45_000}]  # about 12,866 tokens
    fit = fit_tool_results(["r" * 7_000], budget, tool_schemas=schemas)
    assert fit.trimmed == (0,)
    assert fit.input_tokens == estimate_tokens(schemas[0]) + budget.tokens(fit.tool_results[0])
    assert budget.tokens(schemas[0]) == estimate_tokens(compact_json(schemas[0]))


def test_largest_first_cuts_to_the_next_largest_then_both() -> None:
    budget = ContextBudget(max_context_tokens=10_000, reserve_output_tokens=0)
    results = ["a" * 60_000, "b" * 20_000, "c" * 2_000]
    fit = fit_tool_results(results, budget)
    assert fit.fits
    assert fit.trimmed == (0, 1)
    assert fit.tool_results[2] == results[2]
    sizes = [len(text.encode()) for text in fit.tool_results[:2]]
    assert abs(sizes[0] - sizes[1]) <= 8, "tied results are cut alike"


def test_the_floor_stops_cutting_and_the_answer_is_fits_false() -> None:
    budget = ContextBudget(
        max_context_tokens=500, reserve_output_tokens=100, min_tool_result_bytes=1_000
    )
    results = ["x" * 5_000, "y" * 5_000, "z" * 900]
    fit = fit_tool_results(results, budget)
    assert not fit.fits
    assert fit.tool_results[2] == results[2], "a result under the floor is never cut"
    for text in fit.tool_results[:2]:
        assert 990 <= len(text.encode()) <= 1_000
        assert "truncated" in text
    assert fit.iterations < budget.max_iterations


def test_iterations_are_bounded() -> None:
    budget = ContextBudget(max_context_tokens=1_000, reserve_output_tokens=0, max_iterations=2)
    results = [c * (10_000 + index * 1_000) for index, c in enumerate("abcdefgh")]
    fit = fit_tool_results(results, budget)
    assert not fit.fits and fit.iterations == 2


def test_a_cut_never_splits_a_character() -> None:
    budget = ContextBudget(max_context_tokens=1_000, reserve_output_tokens=0)
    fit = fit_tool_results(["ü" * 5_000], budget)
    assert fit.fits
    fit.tool_results[0].encode("utf-8")  # valid text
    assert fit.tool_results[0].startswith("ü" * 100)


def test_nothing_to_trim_is_returned_untouched() -> None:
    fit = fit_tool_results(["small", "tiny"])
    assert fit.fits and fit.trimmed == () and fit.tool_results == ("small", "tiny")
    assert fit.iterations == 0


@pytest.mark.parametrize(
    ("tool_results", "message"),
    [
        ("one result as a str", "tool_results must be a list of str, not a str"),
        (b"bytes", "tool_results must be a list of str, not a bytes"),
        ([{"a": 1}], "tool result 0 must be a str, not a dict"),
        (["ok", None], "tool result 1 must be a str, not a NoneType"),
    ],
)
def test_tool_results_that_are_not_strings_are_refused(tool_results: object, message: str) -> None:
    # A str is a sequence of one-character results: it must not fit as eight of them.
    with pytest.raises(TypeError, match=f"^{message}$"):
        fit_tool_results(tool_results)  # type: ignore[arg-type]


def test_budget_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ContextBudget(max_context_tokens=1_000, reserve_output_tokens=1_000)
    with pytest.raises(ValueError):
        ContextBudget(min_tool_result_bytes=10)


# Recognising an overflow ------------------------------------------------------

OPENAI = {
    "error": {
        "message": "This model's maximum context length is 16384 tokens. However, your "
        "messages resulted in 16385 tokens.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
VLLM = {
    "object": "error",
    "message": "This model's maximum context length is 16384 tokens. However, you "
    "requested 16385 tokens (14337 in the messages, 2048 in the completion).",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
ANTHROPIC = {
    "type": "error",
    "error": {"type": "invalid_request_error", "message": "prompt is too long: 208 > 200"},
}
GEMINI = {
    "error": {
        "code": 400,
        "message": "The input token count (1200000) exceeds the maximum number of tokens "
        "allowed (1048576).",
        "status": "INVALID_ARGUMENT",
    }
}


@pytest.mark.parametrize("body", [OPENAI, VLLM, ANTHROPIC, GEMINI])
def test_provider_overflows_are_recognised(body: dict[str, object]) -> None:
    assert is_context_overflow(400, body)
    assert is_context_overflow(400, json.dumps(body))
    assert is_context_overflow(400, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (429, OPENAI),  # rate limited, whatever the body says
        (500, VLLM),
        (200, OPENAI),
        (400, {"error": {"type": "invalid_request_error", "message": "temperature too high"}}),
        (400, {"error": {"type": "authentication_error", "message": "context length"}}),
        (400, "not json"),
        (400, None),
        (400, json.dumps({"error": {"code": "context_length_exceeded", "pad": "x" * 70_000}})),
    ],
)
def test_other_errors_are_not_overflows(status: int, body: object) -> None:
    assert not is_context_overflow(status, body)


class OddBody:
    """Not JSON at all: the SDKs type an error's `.body` as `object | None`."""


@pytest.mark.parametrize("body", [OddBody(), [OPENAI], 400, (OPENAI,)])
def test_an_sdk_error_body_of_any_type_is_read_or_not_an_overflow(body: object) -> None:
    # openai's and anthropic's APIStatusError.body is `object | None`: a lane
    # passes it as it comes. Anything but a mapping, text or bytes was a
    # TypeError ("not JSON serializable") and a mypy --strict error.
    assert not is_context_overflow(400, body)


def test_the_overflow_reply_is_a_constant_sentence_without_provider_text() -> None:
    assert CONTEXT_OVERFLOW_REPLY.endswith(".")
    for body in (OPENAI, VLLM, ANTHROPIC, GEMINI):
        assert "16384" not in CONTEXT_OVERFLOW_REPLY and "token count" not in CONTEXT_OVERFLOW_REPLY
        assert json.dumps(body) not in CONTEXT_OVERFLOW_REPLY


def test_text_that_cannot_be_utf8_is_refused_naming_which() -> None:
    # A lone surrogate is what json.loads makes of "\ud800" in a tool's JSON:
    # the error said only "position 1", not which result or message.
    with pytest.raises(ValueError, match=r"^tool result 1 is not well-formed text"):
        fit_tool_results(["ok", "a\ud800b"])
    with pytest.raises(ValueError, match=r"^messages\[1\] is not well-formed text"):
        fit_tool_results(["ok"], messages=["hi", {"role": "user", "content": "\udc80"}])
    with pytest.raises(ValueError, match=r"^tool_schemas\[0\] is not well-formed text"):
        fit_tool_results(["ok"], tool_schemas=["\ud83d"])
