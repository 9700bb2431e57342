"""Context budgeting, before a lane reserves.

- Tokens are estimated pessimistically from bytes: 3.5 bytes per token by
  default (JSON tokenizes worse than prose), rounded up. Over-estimating trims a
  little more than needed; under-estimating is the bug this prevents.
- Output headroom is withheld from the window, and tool schemas are counted:
  they are sent on every call.
- Tool results are fitted largest-first: the largest is cut to the size of the
  next largest (or only as far as needed), then everything is measured again.
  One enormous payload is cut; the small useful ones stay byte-identical.
- A trimmed result says so inside its own content, so the model knows the data
  is incomplete instead of answering confidently from half of it.
- Below a floor a result is not cut further. When nothing more can be cut the
  answer is `fits=False`, after a bounded number of rounds, never a loop.

And when a provider still refuses a request for its size, `is_context_overflow`
recognises it, and CONTEXT_OVERFLOW_REPLY is the sentence to show instead of
the provider's text, which may carry secrets or prompt fragments.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence

from ledger_client import canonical_json
from ledger_client.settings import require_int

DEFAULT_BYTES_PER_TOKEN_MILLI = 3500  # 3.5 bytes per token, in thousandths
BYTES_PER_TOKEN_SCALE = 1000
DEFAULT_MAX_CONTEXT_TOKENS = 16_384
DEFAULT_RESERVE_OUTPUT_TOKENS = 2_048
DEFAULT_MIN_TOOL_RESULT_BYTES = 1_024
DEFAULT_MAX_ITERATIONS = 64
MAX_TOOL_RESULTS = 1_000
# Results within this many bytes of the largest are cut as one. A cut lands on
# whole characters (up to 4 bytes of UTF-8) and its marker's count may gain a
# digit, so results cut to one size can differ by a few bytes; cutting each
# down to the next by those few bytes would spend every round on them.
TIE_BYTES = 8
MAX_ERROR_BODY_BYTES = 64 * 1024
# Real error bodies nest two or three levels; a deeper one is not read.
MAX_ERROR_BODY_DEPTH = 64

CONTEXT_OVERFLOW_REPLY = (
    "That question needs more context than the model can take in one request. "
    "The model is up and healthy; please ask something narrower, about one part at a time."
)


def tokens_of_bytes(
    byte_count: int, bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI
) -> int:
    """ceil(byte_count / bytes_per_token), in integers."""
    if byte_count < 0 or bytes_per_token_milli <= 0:
        raise ValueError("byte_count must be >= 0 and bytes_per_token_milli > 0")
    return -(-(byte_count * BYTES_PER_TOKEN_SCALE) // bytes_per_token_milli)


def estimate_tokens(
    payload: object, bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI
) -> int:
    """A pessimistic token count for a payload, from its UTF-8 bytes: a str as
    UTF-8, bytes as they are, anything else (a message dict, a list of
    messages, a tool schema) as its compact JSON (`payload_bytes`)."""
    return tokens_of_bytes(len(payload_bytes(payload)), bytes_per_token_milli)


def payload_bytes(payload: object) -> bytes:
    """The bytes a payload is measured by: a str's UTF-8, bytes (or a bytearray,
    a memoryview) as they are, and any other value (a dict, a list, a number)
    as its compact JSON in UTF-8, the way it is sent: never its len(), which
    for a dict counts its keys. The JSON is canonical_json's: the text the
    Node client's JSON.stringify writes, floats included (1.0 is 1, 1e-07 is
    1e-7), so both clients count the same bytes for the same value.
    A value JSON cannot carry raises TypeError; text with a lone surrogate
    (no UTF-8 at all) raises UnicodeEncodeError, as a str payload does."""
    if isinstance(payload, str):
        return payload.encode("utf-8")
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    return canonical_json.dump_bytes(payload)


@dataclasses.dataclass(frozen=True)
class ContextBudget:
    # Must match the served model's window (vLLM's --max-model-len): two
    # statements of one number, and the bug is when they disagree.
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    # Withheld from the input for the reply (the window bounds input + output).
    reserve_output_tokens: int = DEFAULT_RESERVE_OUTPUT_TOKENS
    bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI
    # Below this a result stops being evidence; it is never cut shorter.
    min_tool_result_bytes: int = DEFAULT_MIN_TOOL_RESULT_BYTES
    max_iterations: int = DEFAULT_MAX_ITERATIONS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            require_int(getattr(self, field.name), field.name)
        if not 0 <= self.reserve_output_tokens < self.max_context_tokens <= 10**9:
            raise ValueError("need 0 <= reserve_output_tokens < max_context_tokens <= 10**9")
        if not 100 <= self.bytes_per_token_milli <= 64_000:
            raise ValueError("bytes_per_token_milli must be between 100 and 64000")
        if not 256 <= self.min_tool_result_bytes <= 10**8:
            raise ValueError("min_tool_result_bytes must be between 256 and 10**8")
        if not 1 <= self.max_iterations <= 10_000:
            raise ValueError("max_iterations must be between 1 and 10000")

    @property
    def input_budget_tokens(self) -> int:
        return self.max_context_tokens - self.reserve_output_tokens

    def tokens(self, payload: object) -> int:
        return estimate_tokens(payload, self.bytes_per_token_milli)


@dataclasses.dataclass(frozen=True)
class ContextFit:
    fits: bool
    # The tool results to send, in their original order.
    tool_results: tuple[str, ...]
    # Indexes of the results that were trimmed (and carry a marker).
    trimmed: tuple[int, ...]
    # Estimated input tokens (messages + tool schemas + results) and the budget.
    input_tokens: int
    budget_tokens: int
    iterations: int


def truncation_marker(removed_bytes: int, original_bytes: int) -> str:
    return (
        f"\n[... truncated {removed_bytes} bytes of {original_bytes}: this result is "
        "incomplete; say what is missing rather than guess it ...]"
    )


class _Result:
    """One tool result and how much of it is kept."""

    def __init__(self, text: str) -> None:
        self.original = text.encode("utf-8")
        self.rendered = text
        self.size_bytes = len(self.original)
        self.trimmed = False

    def cut_to(self, size_bytes: int) -> None:
        """Keeps a head and a marker, together at most size_bytes long."""
        total = len(self.original)
        keep = max(0, size_bytes - len(truncation_marker(total, total)))
        # The marker's length depends on how much it says was removed.
        keep = max(0, size_bytes - len(truncation_marker(total - keep, total)))
        while True:
            # errors="ignore" drops a character split by the cut, never more.
            head = self.original[:keep].decode("utf-8", errors="ignore")
            kept = len(head.encode("utf-8"))
            marker = truncation_marker(total - kept, total)
            # Dropping that character can lengthen the marker's count by a digit:
            # then one byte less, or a cut that lands above its size stalls the fit.
            if kept + len(marker) <= size_bytes or kept == 0:
                break
            keep = kept - 1
        self.rendered = head + marker
        self.size_bytes = kept + len(marker)
        self.trimmed = True


def fit_tool_results(
    tool_results: Sequence[str],
    budget: ContextBudget | None = None,
    *,
    messages: Sequence[object] = (),
    tool_schemas: Sequence[object] = (),
) -> ContextFit:
    """Fits tool results into what the window leaves after the messages, the
    tool schemas and the output reserve. Each message and schema is measured
    by `payload_bytes`: a str or bytes as they are, a dict (or any other
    value) as its compact JSON."""
    budget = budget or ContextBudget()
    if isinstance(tool_results, str | bytes | bytearray):
        # A str is a sequence of one-character results: refused, as Node does.
        kind = type(tool_results).__name__
        raise TypeError(f"tool_results must be a list of str, not a {kind}")
    if len(tool_results) > MAX_TOOL_RESULTS:
        raise ValueError(f"at most {MAX_TOOL_RESULTS} tool results")
    for index, text in enumerate(tool_results):
        if not isinstance(text, str):
            raise TypeError(f"tool result {index} must be a str, not a {type(text).__name__}")
    for name, items in (("messages", messages), ("tool_schemas", tool_schemas)):
        # One message dict would be iterated as its keys (a few tokens for any
        # length), one str as its characters (a token each): refused, as Node does.
        if isinstance(items, str | bytes | bytearray | memoryview | Mapping):
            kind = type(items).__name__
            raise TypeError(f"{name} must be a list of items, not a {kind}")
    fixed_tokens = _tokens_of("messages", messages, budget) + _tokens_of(
        "tool_schemas", tool_schemas, budget
    )
    results = [_result_of(index, text) for index, text in enumerate(tool_results)]
    iterations = 0
    while True:
        total = fixed_tokens + sum(
            tokens_of_bytes(r.size_bytes, budget.bytes_per_token_milli) for r in results
        )
        if total <= budget.input_budget_tokens:
            return _fit(True, results, total, budget, iterations)
        if iterations >= budget.max_iterations or not _cut_largest(results, total, budget):
            return _fit(False, results, total, budget, iterations)
        iterations += 1


def _result_of(index: int, text: str) -> _Result:
    try:
        return _Result(text)
    except UnicodeEncodeError:  # "position 5" alone does not say which result
        raise ValueError(
            f"tool result {index} is not well-formed text (a lone surrogate)"
        ) from None


def _tokens_of(name: str, items: Sequence[object], budget: ContextBudget) -> int:
    """The estimated tokens of messages or tool schemas; one that cannot be
    measured is refused naming its index."""
    total = 0
    for index, item in enumerate(items):
        try:
            total += budget.tokens(item)
        except UnicodeEncodeError:
            raise ValueError(
                f"{name}[{index}] is not well-formed text (a lone surrogate)"
            ) from None
    return total


def _cut_largest(results: list[_Result], total_tokens: int, budget: ContextBudget) -> bool:
    """Cuts the largest results (all of them if tied, within TIE_BYTES) down to
    the next largest size, or only as far as the excess needs. False when
    nothing can be cut."""
    floor = budget.min_tool_result_bytes
    cuttable = [result for result in results if result.size_bytes > floor]
    if not cuttable:
        return False
    top = max(result.size_bytes for result in cuttable)
    tied = top - TIE_BYTES
    group = [result for result in cuttable if result.size_bytes >= tied]
    next_size = max((r.size_bytes for r in results if r.size_bytes < tied), default=0)
    excess_tokens = total_tokens - budget.input_budget_tokens
    excess_bytes = -(-(excess_tokens * budget.bytes_per_token_milli) // BYTES_PER_TOKEN_SCALE)
    share = -(-excess_bytes // len(group))
    new_size = max(next_size, top - share, floor)
    for result in group:
        if result.size_bytes > new_size:  # a cut never gives back what an earlier one took
            result.cut_to(new_size)
    return True


def _fit(
    fits: bool, results: list[_Result], total: int, budget: ContextBudget, iterations: int
) -> ContextFit:
    return ContextFit(
        fits=fits,
        tool_results=tuple(result.rendered for result in results),
        trimmed=tuple(index for index, result in enumerate(results) if result.trimmed),
        input_tokens=total,
        budget_tokens=budget.input_budget_tokens,
        iterations=iterations,
    )


# Overflow recognition ---------------------------------------------------------

OVERFLOW_HTTP_STATUSES = frozenset({400, 413})
# Error codes that name the overflow outright (OpenAI and compatible servers).
OVERFLOW_CODES = frozenset({"context_length_exceeded", "context_window_exceeded"})
# Error types for "your request is wrong", which need the message to say why.
REQUEST_ERROR_TYPES = frozenset(
    {"invalid_request_error", "badrequesterror", "invalid_argument", "request_too_large"}
)
_OVERFLOW_MESSAGE = re.compile(
    r"context[ _-]?length|context[ _-]?window|maximum context|too many tokens|"
    r"prompt is too long|input is too long|maximum number of tokens|exceeds? the token limit|"
    # vLLM's V1 engine: "The decoder prompt (length N) is longer than the maximum
    # model length of M."
    r"maximum model length",
    # ASCII case-folding only, which is what JavaScript's /i does here: a dotless i
    # (U+0131) or a long s (U+017F) is not an "i" or an "s".
    re.IGNORECASE | re.ASCII,
)


def _error_fields(body: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The body and its nested `error` object: providers put the fields in either."""
    fields = [body]
    nested = body.get("error")
    if isinstance(nested, Mapping):
        fields.append(nested)
    return fields


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _nests_too_deep(text: str) -> bool:
    """Whether arrays and objects nest deeper than MAX_ERROR_BODY_DEPTH (string
    contents skipped): the parser recurses, and a hostile body must not crash it."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_ERROR_BODY_DEPTH:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _parsed(body: object) -> Mapping[str, object] | None:
    """A body as strict JSON (RFC 8259): UTF-8 only (a leading byte order mark
    is skipped), no NaN or Infinity, at most MAX_ERROR_BODY_BYTES and
    MAX_ERROR_BODY_DEPTH. Anything else is no body."""
    if body is None or isinstance(body, Mapping):
        return body
    if not isinstance(body, str | bytes | bytearray | memoryview):
        return None  # an SDK's error body is typed `object`: no error object here
    try:
        # Text that cannot be UTF-8 (a lone surrogate) is not a body either.
        raw = payload_bytes(body)
        if len(raw) > MAX_ERROR_BODY_BYTES:
            return None
        text = raw.decode("utf-8-sig")
        if _nests_too_deep(text):
            return None
        # Numbers are never read: float takes any number of digits, as a
        # JavaScript number does, where int refuses more than 4300.
        value = json.loads(text, parse_int=float, parse_constant=_refuse_constant)
    except ValueError:
        return None
    return value if isinstance(value, Mapping) else None


def is_context_overflow(http_status: int, body: object) -> bool:
    """Whether a provider refused a request for not fitting its context window.

    Reads the status and the error's code and type fields; the message is read
    only to tell an overflow from other bad requests of the same type, and is
    never shown to anyone (answer with CONTEXT_OVERFLOW_REPLY)."""
    if http_status not in OVERFLOW_HTTP_STATUSES:
        return False
    parsed = _parsed(body)
    if parsed is None:
        return False
    for fields in _error_fields(parsed):
        code = fields.get("code")
        if isinstance(code, str) and code.lower() in OVERFLOW_CODES:
            return True
    for fields in _error_fields(parsed):
        kinds = {str(fields.get(key, "")).lower() for key in ("type", "status")}
        message = fields.get("message")
        if (
            kinds & REQUEST_ERROR_TYPES
            and isinstance(message, str)
            and _OVERFLOW_MESSAGE.search(message[:MAX_ERROR_BODY_BYTES])
        ):
            return True
    return False
