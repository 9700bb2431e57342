"""The shared context-budgeting cases (clients/cases/context.json), which the
Node client's tests/context.test.js runs too: the same inputs, the same answers."""

from __future__ import annotations

import base64
import json
import pathlib
from typing import Any

import pytest
from ledger_client import context
from ledger_client.context import ContextBudget, ContextFit

CASES_PATH = pathlib.Path(__file__).resolve().parents[2] / "cases" / "context.json"
CASES: dict[str, Any] = json.loads(CASES_PATH.read_text(encoding="utf-8"))


def cases_of(kind: str) -> Any:
    return pytest.mark.parametrize(
        "case",
        CASES[kind],
        ids=[f"{index}: {case['why'][:60]}" for index, case in enumerate(CASES[kind])],
    )


def text_of(spec: str | dict[str, Any]) -> str:
    """A text of the cases: a string, head + repeat x count + tail, or head +
    repeat repeated and cut to exactly `bytes` bytes with the tail (ASCII)."""
    if isinstance(spec, str):
        return spec
    head, unit, tail = spec.get("head", ""), spec["repeat"], spec.get("tail", "")
    if "count" in spec:
        return str(head + unit * spec["count"] + tail)
    assert (head + unit + tail).isascii()
    fill = spec["bytes"] - len(head) - len(tail)
    return str(head + (unit * (fill // len(unit) + 1))[:fill] + tail)


def texts_of(specs: list[Any] | dict[str, Any]) -> list[str]:
    if isinstance(specs, dict):
        return [text_of(specs["each"])] * specs["count"]
    return [text_of(spec) for spec in specs]


def test_the_defaults_and_the_reply_are_the_shared_ones() -> None:
    assert ContextBudget() == ContextBudget(**CASES["defaults"])
    assert CASES["reply"] == context.CONTEXT_OVERFLOW_REPLY


@cases_of("estimates")
def test_estimate(case: dict[str, Any]) -> None:
    milli = case.get("bytes_per_token_milli", context.DEFAULT_BYTES_PER_TOKEN_MILLI)

    def estimate() -> int:
        if "text" in case:
            return context.estimate_tokens(text_of(case["text"]), milli)
        return context.tokens_of_bytes(case["byte_count"], milli)

    if case.get("refused"):
        with pytest.raises(ValueError):
            estimate()
    else:
        assert estimate() == case["tokens"]


@cases_of("budgets")
def test_budget(case: dict[str, Any]) -> None:
    if case.get("refused"):
        with pytest.raises(TypeError if case["refused"] == "type" else ValueError):
            ContextBudget(**case["budget"])
    else:
        assert ContextBudget(**case["budget"]).input_budget_tokens == case["input_budget_tokens"]


def fit_of(case: dict[str, Any]) -> ContextFit:
    return context.fit_tool_results(
        texts_of(case["tool_results"]),
        ContextBudget(**case.get("budget", {})),
        messages=case.get("messages_given", texts_of(case.get("messages", []))),
        tool_schemas=case.get("tool_schemas_given", texts_of(case.get("tool_schemas", []))),
    )


@cases_of("fits")
def test_fit(case: dict[str, Any]) -> None:
    if case.get("refused"):
        with pytest.raises(TypeError if case["refused"] == "type" else ValueError):
            fit_of(case)
        return
    expected = case["expected"]
    fit = fit_of(case)
    assert (fit.fits, fit.iterations, fit.input_tokens, fit.budget_tokens) == (
        expected["fits"],
        expected["iterations"],
        expected["input_tokens"],
        expected["budget_tokens"],
    )
    assert list(fit.trimmed) == expected["trimmed"]
    originals = texts_of(case["tool_results"])
    assert len(fit.tool_results) == len(expected["tool_results"]) == len(originals)
    for original, rendered, want in zip(
        originals, fit.tool_results, expected["tool_results"], strict=True
    ):
        if want == "unchanged":
            assert rendered == original
            continue
        raw = original.encode("utf-8")
        head = raw[: want["kept_bytes"]].decode("utf-8")  # strict: whole characters only
        assert rendered == head + want["marker"]
        assert len(rendered.encode("utf-8")) == want["bytes"]
        assert want["marker"] == context.truncation_marker(len(raw) - want["kept_bytes"], len(raw))
    # The same count, made again from what is sent.
    sent = [*texts_of(case.get("messages", [])), *texts_of(case.get("tool_schemas", []))]
    budget = ContextBudget(**case.get("budget", {}))
    assert fit.input_tokens == sum(map(budget.tokens, [*sent, *fit.tool_results]))
    assert fit.fits == (fit.input_tokens <= fit.budget_tokens)


def bodies_of(case: dict[str, Any]) -> list[tuple[str, object]]:
    """The body in each of its forms: the parsed object, its JSON text, its UTF-8."""
    if "base64" in case:
        return [("bytes", base64.b64decode(case["base64"]))]
    if "text" in case:
        text = text_of(case["text"])
    else:
        body = json.loads(json.dumps(case["body"]))
        if "set" in case:
            *path, last = case["set"]["path"]
            target = body
            for key in path:
                target = target[key]
            target[last] = text_of(case["set"]["text"])
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    forms: dict[str, object] = {"text": text}
    if "text" not in case:
        forms["object"] = body
    if "bytes" in case["as"]:
        forms["bytes"] = text.encode("utf-8")
    return [(form, forms[form]) for form in case["as"]]


@cases_of("overflows")
def test_overflow(case: dict[str, Any]) -> None:
    for form, body in bodies_of(case):
        answer = context.is_context_overflow(case["status"], body)  # type: ignore[arg-type]
        assert answer is case["overflow"], form
