"""The one JSON text both clients count a request's bytes by (and send).

It is what JavaScript's JSON.stringify writes, so the Node client needs nothing
but JSON.stringify and the two clients book the same request_bytes for the same
request: no whitespace; object keys in their order; strings as json.dumps(...,
ensure_ascii=False) writes them (only the quote, the backslash and the control
characters escaped, everything else as UTF-8), which is JSON.stringify's text
for well-formed strings; and every float as ECMAScript's Number::toString writes
it, not as Python's repr: the shortest digits that read back, an integral value
without a fraction (1.0 is 1, -0.0 is 0), plain decimals from 1e-6 up to below
1e21 and an exponent outside them (1e-7, 1e+21); NaN and the infinities are
null, as JSON.stringify has them. The cases are clients/cases/bytes.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

_strings = json.JSONEncoder(ensure_ascii=False)


def number_text(value: float) -> str:
    """A float as ECMAScript's Number::toString (radix 10) writes it."""
    if math.isnan(value) or math.isinf(value):
        return "null"  # JSON.stringify's text for them
    if value == 0:
        return "0"  # -0 as well
    # repr is the shortest round-trip digit string, as Number::toString's.
    mantissa, _, exponent_text = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    # value = 0.digits * 10**point, with digits stripped of zeros at both ends.
    point = len(whole) + int(exponent_text or 0) - (len(whole + fraction) - len(digits))
    digits = digits.rstrip("0")
    count = len(digits)
    sign = "-" if value < 0 else ""
    if count <= point <= 21:
        return sign + digits + "0" * (point - count)
    if 0 < point <= 21:
        return sign + digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return sign + "0." + "0" * -point + digits
    exponent = point - 1
    exponent_sign = "+" if exponent >= 0 else "-"
    rest = "." + digits[1:] if count > 1 else ""
    return f"{sign}{digits[0]}{rest}e{exponent_sign}{abs(exponent)}"


def _key(key: object) -> str:
    """An object key as json.dumps takes it (JavaScript's keys are strings)."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return number_text(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def dumps(value: Any) -> str:
    """The canonical JSON text of a value (see the module's docstring). A
    value JSON cannot carry raises TypeError; a cycle raises ValueError."""
    parts: list[str] = []
    active: set[int] = set()

    def write(item: Any) -> None:
        if item is None or item is True or item is False:
            parts.append(json.dumps(item))
        elif isinstance(item, str):
            parts.append(_strings.encode(item))
        elif isinstance(item, int):
            parts.append(int.__repr__(item))
        elif isinstance(item, float):
            parts.append(number_text(item))
        elif isinstance(item, Mapping | list | tuple):
            if id(item) in active:
                raise ValueError("Circular reference detected")
            active.add(id(item))
            if isinstance(item, Mapping):
                parts.append("{")
                for index, (key, member) in enumerate(item.items()):
                    if index:
                        parts.append(",")
                    parts.append(_strings.encode(_key(key)))
                    parts.append(":")
                    write(member)
                parts.append("}")
            else:
                parts.append("[")
                for index, member in enumerate(item):
                    if index:
                        parts.append(",")
                    write(member)
                parts.append("]")
            active.discard(id(item))
        else:
            raise TypeError(f"Object of type {type(item).__name__} is not JSON serializable")

    write(value)
    return "".join(parts)


def dump_bytes(value: Any) -> bytes:
    """The canonical JSON text in UTF-8: the bytes a request is counted by."""
    return dumps(value).encode("utf-8")
