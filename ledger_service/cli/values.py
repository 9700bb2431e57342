"""Command-line values parsed into what the wire carries: amounts, prices,
durations, counts, --timeout. A bad value gets one line naming its option.

Money is integer nanos throughout: "$0.50" and "0.50 USD" are parsed with
Decimal, and anything finer than a nano is refused rather than rounded. An
amount must name its unit ($, USD or n); only a --price may leave it out. One
past the ledger's own bound (the domain's: 2^62 nanos, a price 10^15 nanos per
million tokens) is refused here, in the unit typed, and never sent.
A duration must name its unit too (us, ms, s, m, h or d).
"""

from __future__ import annotations

import decimal
import re

from google.protobuf import duration_pb2

from ledger_service.cli.exits import EXIT_BAD_VALUE, CliError
from ledger_service.domain.policies import BYTES_PER_TOKEN_RANGE, MAX_PRICE_NANOS_PER_MILLION
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS, usd_text, usd_to_nanos
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

MAX_INT64 = 2**63 - 1
MICROS_PER_UNIT = {"us": 1, "ms": 1000, "s": 10**6, "m": 60 * 10**6, "h": 3600 * 10**6}
MICROS_PER_UNIT["d"] = 24 * MICROS_PER_UNIT["h"]
MAX_DURATION_MICROS = 10 * 366 * MICROS_PER_UNIT["d"]
MAX_VALUE_LENGTH = 64
DEFAULT_TIMEOUT_SECONDS = decimal.Decimal(5)
MAX_TIMEOUT_SECONDS = decimal.Decimal(3600)
# A sign before or after the dollar sign ('-$1', '$-1'): both are read, to be
# refused alike, since no amount the CLI sends may be negative.
_AMOUNT = re.compile(
    r"^(?P<sign>-?)\s*(?P<dollar>\$?)\s*(?P<inner_sign>-?)\s*"
    r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)$",
    re.ASCII,
)
# What argparse must take as an option's value, not as an option: '-$1', '-1n'.
NEGATIVE_AMOUNT = re.compile(r"^-\s*\$?\s*(?:\d|\.\d)", re.ASCII)

_DURATION = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>us|ms|s|m|h|d|)$", re.ASCII)
_COUNT = re.compile(r"^-?\d{1,19}$", re.ASCII)
# A whole number of any length: one past int64 is too large, not "not a number".
_DIGITS = re.compile(r"^\d+$", re.ASCII)
_DECIMAL = re.compile(r"^\d{1,6}(?:\.\d{1,6})?$", re.ASCII)
# --timeout: ASCII digits only (Decimal() also takes other scripts' digits, NaN and Infinity).
_SECONDS = re.compile(r"^\s*(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*$", re.ASCII)


def parse_amount_nanos(
    option: str, text: str, *, bare_is_usd: bool = False, largest_nanos: int = MAX_AMOUNT_NANOS
) -> int:
    """'$0.50', '0.50 USD' or '500000000n' / '500000000 nanos' -> nanos, at
    most `largest_nanos`.

    A bare number ('100') is refused: dollars and nanos differ by 10^9, so a
    missing unit is a guess we will not make. Only prices, whose documented
    form is USD per million tokens ('jev=0.10/0.40'), pass bare_is_usd.
    """
    match = _AMOUNT.match(text.strip()) if len(text) <= MAX_VALUE_LENGTH else None
    if match is None:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not an amount "
            "(write $0.50, 0.50 USD or 500000000n)",
            EXIT_BAD_VALUE,
        )
    if match["sign"] or match["inner_sign"]:
        # Every amount on the wire (limit, estimate, bill, charge, price) is 0 or
        # more; refused here, so '-$1' is a usage error as '$-1' is, not a call.
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is negative: an amount is 0 or more",
            EXIT_BAD_VALUE,
        )
    unit = match["unit"].lower()
    if not unit and not match["dollar"] and not bare_is_usd:
        raise CliError(f"{option}: {_no_unit_message(text, match)}", EXIT_BAD_VALUE)
    number = decimal.Decimal(match["number"])
    if unit in {"n", "nanos"} and not match["dollar"]:
        if number != number.to_integral_value():
            raise CliError(f"{option}: nanos are whole numbers, not {text!r}", EXIT_BAD_VALUE)
        nanos = int(number)
    elif unit in {"", "usd"}:
        exact = usd_to_nanos(number)
        if exact is None:
            raise CliError(
                f"{option}: {text!r} is finer than one nano ($0.000000001)", EXIT_BAD_VALUE
            )
        nanos = exact
    else:
        raise CliError(f"{option}: unknown unit {match['unit']!r} (use USD or n)", EXIT_BAD_VALUE)
    if nanos > largest_nanos:
        largest = _largest_amount(largest_nanos, match["dollar"], match["unit"])
        raise CliError(f"{option}: {text!r} is too large (at most {largest})", EXIT_BAD_VALUE)
    return nanos


def _largest_amount(nanos: int, dollar: str, unit: str) -> str:
    """The bound as the user wrote the amount refused: '$4611686018.427387904',
    '... USD', '4611686018427387904n', or bare for a price."""
    if unit.lower() in {"n", "nanos"}:
        return f"{nanos}{'n' if unit.lower() == 'n' else ' nanos'}"
    dollars = usd_text(nanos)
    if dollar:
        return f"${dollars}"
    return f"{dollars} {unit}" if unit else dollars


def _no_unit_message(text: str, match: re.Match[str]) -> str:
    """Says the unit is missing and shows the number in each form it could take:
    nanos only when it is whole, since '0.50n' would be refused in turn."""
    number = match["number"]
    if not number.isdigit():
        return f"{text.strip()!r} has no unit (write ${number} or {number} USD)"
    return f"{text.strip()!r} has no unit (write ${number}, {number} USD or {number}n)"


# The parts of a --price after MODEL=, in order; the last two may be left out.
PRICE_PARTS = ("input", "output", "cached input", "cache write")


def parse_price(text: str) -> tuple[str, pb.ModelPrice]:
    """'jev=0.10/0.40' (USD per million tokens, input / output), 'jev=100000000n/400000000n',
    or with the prompt cache's prices too: 'jev=0.10/0.40/0.01[/0.125]' (cached input,
    then cache write). A cache price left out is the input price, on the server.
    A bare number is USD per million tokens, as documented; a unit may be written too."""
    model, equals, prices = text.partition("=")
    parts = prices.split("/")
    if not model or not equals or not 2 <= len(parts) <= len(PRICE_PARTS):
        raise CliError(
            f"--price: {text[:MAX_VALUE_LENGTH]!r} is not MODEL=IN/OUT[/CACHED_IN[/CACHE_WRITE]] "
            "(USD per million tokens, e.g. jev=0.10/0.40)",
            EXIT_BAD_VALUE,
        )
    nanos = [
        parse_amount_nanos(
            f"--price {model} {name}",
            part,
            bare_is_usd=True,
            largest_nanos=MAX_PRICE_NANOS_PER_MILLION,
        )
        for name, part in zip(PRICE_PARTS, parts, strict=False)
    ]
    price = pb.ModelPrice(
        input_nanos_per_million_tokens=nanos[0], output_nanos_per_million_tokens=nanos[1]
    )
    if len(nanos) > 2:
        price.cached_input_nanos_per_million_tokens = nanos[2]
    if len(nanos) > 3:
        price.cache_write_nanos_per_million_tokens = nanos[3]
    return model, price


def parse_duration(option: str, text: str) -> duration_pb2.Duration:
    """'90s', '2m', '24h', '1d', '250ms'. A bare number is refused, as a bare
    amount is: '--window 24' meant as hours made a 24-second window."""
    match = _DURATION.match(text.strip()) if len(text) <= MAX_VALUE_LENGTH else None
    if match is None:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not a duration (write 90s, 2m, 24h or 1d)",
            EXIT_BAD_VALUE,
        )
    if not match["unit"]:
        number = match["number"]
        forms = f"{number}s, {number}m, {number}h or {number}d"
        raise CliError(f"{option}: {number!r} has no unit (write {forms})", EXIT_BAD_VALUE)
    # Exact: the default 28 digits would round '1.0000000000000000000000000001s' to 1 s.
    # A value of at most 64 characters times a day's microseconds fits 100 digits.
    exact = decimal.Context(prec=100)
    micros = exact.multiply(decimal.Decimal(match["number"]), MICROS_PER_UNIT[match["unit"]])
    if micros != micros.to_integral_value() or micros > MAX_DURATION_MICROS:
        raise CliError(
            f"{option}: {text!r} is finer than a microsecond or longer than 3,660 days",
            EXIT_BAD_VALUE,
        )
    seconds, remainder_micros = divmod(int(micros), 10**6)
    return duration_pb2.Duration(seconds=seconds, nanos=remainder_micros * 1000)


def parse_count(option: str, text: str) -> int:
    """A whole number, 0 or more. Every count the CLI sends (bytes, tokens, an HTTP
    status, a seq, a multiple) is: a negative one is refused here, exit 2, as a
    negative amount is, not sent for the server to refuse with exit 1."""
    significant = text.strip().lstrip("0")
    # Its length first: int() of thousands of digits is slow, then refused.
    if _DIGITS.match(text.strip()) and (len(significant) > 19 or int(significant or 0) > MAX_INT64):
        raise CliError(
            f"{option}: {text.strip()[:MAX_VALUE_LENGTH]!r} is too large (at most {MAX_INT64})",
            EXIT_BAD_VALUE,
        )
    if not _COUNT.match(text.strip()) or not -MAX_INT64 <= int(text) <= MAX_INT64:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not a whole number", EXIT_BAD_VALUE
        )
    if int(text) < 0:
        raise CliError(
            f"{option}: {text.strip()!r} is negative: a count is 0 or more", EXIT_BAD_VALUE
        )
    return int(text)


def parse_bytes_per_token(text: str) -> float:
    """The wire carries a double; the server keeps thousandths, so more decimals are refused."""
    if not _DECIMAL.match(text.strip()):
        raise CliError(
            f"--bytes-per-token: {text[:MAX_VALUE_LENGTH]!r} is not a number like 3.5: it "
            f"{BYTES_PER_TOKEN_RANGE}",
            EXIT_BAD_VALUE,
        )
    value = decimal.Decimal(text.strip())
    if value * 1000 != (value * 1000).to_integral_value():
        raise CliError("--bytes-per-token: at most three decimals", EXIT_BAD_VALUE)
    return float(value)


def parse_timeout_seconds(text: str | None) -> float:
    if text is None:
        return float(DEFAULT_TIMEOUT_SECONDS)
    # Matched first: Decimal("nan") compares by raising, Decimal("\u0661") is 1.
    value = decimal.Decimal(text) if _SECONDS.match(text) else decimal.Decimal(-1)
    # float() too: '1e-400' is above 0 as a Decimal and 0.0 as the deadline sent.
    if not decimal.Decimal(0) < value <= MAX_TIMEOUT_SECONDS or float(value) <= 0:
        raise CliError(
            f"--timeout: {text[:MAX_VALUE_LENGTH]!r} is not a number of seconds "
            f"above 0 and at most {MAX_TIMEOUT_SECONDS}",
            EXIT_BAD_VALUE,
        )
    return float(value)
