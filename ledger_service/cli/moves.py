"""The moves: `ledger reserve`, `settle`, `refund`, and an operator's `correct`
of an ended booking's charge."""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

from ledger_service.cli.connection import Session, command
from ledger_service.cli.exits import EXIT_DENIED
from ledger_service.cli.render import (
    emit,
    enum_name,
    money_in_text,
    not_before_text,
    time_text,
    usd,
)
from ledger_service.cli.values import parse_amount_nanos, parse_count, parse_duration
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

# A derived --correction-id: this prefix and this many hex digits of a SHA-256.
CORRECTION_ID_PREFIX = "c-"
CORRECTION_ID_HEX_DIGITS = 24


def balance_summary(balance: pb.Balance) -> str:
    return (
        f"lane {balance.lane}: spent {usd(balance.spent_nanos)} of {usd(balance.limit_nanos)} "
        f"(held {usd(balance.held_nanos)}, charged {usd(balance.charged_nanos)}), "
        f"available {usd(balance.available_nanos)}"
    )


def reserve_lines(reservation_id: str, response: pb.ReserveResponse) -> list[str]:
    if response.decision == pb.ADMITTED:
        first = (
            f"admitted {reservation_id}: hold {usd(response.hold_nanos)} "
            f"(cap {usd(response.cap_nanos)}), expires {time_text(response.expires_at)}"
        )
    else:
        retry = (
            f"; retry after {not_before_text(response.retry_after)} with a new reservation id"
            if response.HasField("retry_after")
            else ""
        )
        by = (
            f" by the budget of {response.denied_by}"
            if response.denied_by and response.denied_by != response.balance.lane
            else ""
        )
        # The server's sentence counts nanos; people read dollars here (--json keeps nanos).
        first = (
            f"denied {reservation_id}{by}: "
            f"{enum_name(pb.DenialReason, response.denial_reason)}: "
            f"{money_in_text(response.reason)}{retry}"
        )
    lines = [first, balance_summary(response.balance)]
    if response.already_reserved:
        lines.append(
            f"(a repeat: an earlier Reserve under {reservation_id} made this answer; "
            "this one booked nothing)"
        )
    return lines


def reserve(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.ReserveRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        model=arguments.model,
        request_bytes=parse_count("--request-bytes", arguments.request_bytes),
        max_output_tokens=parse_count("--max-output-tokens", arguments.max_output_tokens),
    )
    if arguments.estimate is not None:
        request.estimate_nanos = parse_amount_nanos("--estimate", arguments.estimate)
    if arguments.ttl is not None:
        request.ttl.CopyFrom(parse_duration("--ttl", arguments.ttl))
    response = session.ledger.Reserve(request, **session.options())
    emit(arguments, response, reserve_lines(arguments.reservation_id, response))
    return 0 if response.decision == pb.ADMITTED else EXIT_DENIED


def settle(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.SettleRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        outcome=pb.SUCCEEDED if arguments.outcome == "succeeded" else pb.UNKNOWN,
        input_tokens=parse_count("--input-tokens", arguments.input_tokens),
        output_tokens=parse_count("--output-tokens", arguments.output_tokens),
        http_status=parse_count("--http-status", arguments.http_status),
        cached_input_tokens=parse_count("--cached-input-tokens", arguments.cached_input_tokens),
        cache_write_tokens=parse_count("--cache-write-tokens", arguments.cache_write_tokens),
    )
    if arguments.billed is not None:
        request.billed_nanos = parse_amount_nanos("--billed", arguments.billed)
    response = session.ledger.Settle(request, **session.options())
    state = enum_name(pb.BookingState, response.state)
    lines = [
        f"{state} {arguments.reservation_id}: charged {usd(response.charged_nanos)}",
        balance_summary(response.balance),
    ]
    emit(arguments, response, lines)
    return 0


def refund(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.RefundRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        http_status=parse_count("--http-status", arguments.http_status),
        reason=arguments.reason,
    )
    response = session.ledger.Refund(request, **session.options())
    lines = [
        f"refunded {arguments.reservation_id}: charged {usd(0)}",
        balance_summary(response.balance),
    ]
    emit(arguments, response, lines)
    return 0


def correction_id(lane: str, reservation_id: str, charge_nanos: int, reason: str) -> str:
    """The id of a correction given no --correction-id: derived from what it says, so
    that running the same command again is the same correction (answered, not redone)."""
    content = json.dumps([lane, reservation_id, charge_nanos, reason], ensure_ascii=False)
    digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
    return CORRECTION_ID_PREFIX + digest[:CORRECTION_ID_HEX_DIGITS]


def correct(arguments: argparse.Namespace, session: Session) -> int:
    charge_nanos = parse_amount_nanos("--charge", arguments.charge)
    chosen_id = arguments.correction_id or correction_id(
        arguments.lane, arguments.reservation_id, charge_nanos, arguments.reason
    )
    request = pb.CorrectRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        charge_nanos=charge_nanos,
        reason=arguments.reason,
        correction_id=chosen_id,
    )
    response = session.ledger.Correct(request, **session.options())
    lines = [
        f"corrected {arguments.reservation_id}: charge {usd(response.previous_charge_nanos)} "
        f"-> {usd(response.charged_nanos)}",
        balance_summary(response.balance),
    ]
    emit(arguments, response, lines)
    return 0


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    _register_reserve(commands, common)
    _register_settle(commands, common)
    _register_refund(commands, common)
    _register_correct(commands, common)


def _register_reserve(commands: Any, common: argparse.ArgumentParser) -> None:
    book = commands.add_parser(
        "reserve",
        parents=[common],
        help="book a hold for one planned model call (exits 4 if denied)",
    )
    book.add_argument("lane", metavar="LANE")
    book.add_argument("reservation_id", metavar="RESERVATION_ID")
    book.add_argument(
        "--model", required=True, help="the model the call goes to, one the lane has a price for"
    )
    book.add_argument(
        "--request-bytes",
        required=True,
        metavar="N",
        help="the size of the request in bytes; the lane's --bytes-per-token turns it "
        "into input tokens for the cap",
    )
    book.add_argument(
        "--max-output-tokens",
        required=True,
        metavar="N",
        help="the most output tokens the call asks the provider for; settle refuses more",
    )
    book.add_argument(
        "--estimate",
        metavar="AMOUNT",
        help="hold min(estimate, cap): $0.50, 0.50 USD or 500000000n",
    )
    book.add_argument(
        "--ttl",
        metavar="DURATION",
        help="how long the hold lasts unsettled (default and at most the lane's --hold-ttl)",
    )
    book.set_defaults(run=command(reserve))


def _register_settle(commands: Any, common: argparse.ArgumentParser) -> None:
    end = commands.add_parser("settle", parents=[common], help="end a booking with its outcome")
    end.add_argument("lane", metavar="LANE")
    end.add_argument("reservation_id", metavar="RESERVATION_ID")
    end.add_argument(
        "--outcome",
        required=True,
        choices=("succeeded", "unknown"),
        help="succeeded: the provider answered, with usage (--input-tokens) or --billed; "
        "unknown: no usage known, the hold (or less) is charged",
    )
    end.add_argument(
        "--input-tokens",
        default="0",
        metavar="N",
        help="every input token the provider counted, cached ones included (default 0)",
    )
    end.add_argument(
        "--output-tokens",
        default="0",
        metavar="N",
        help="every output token, reasoning ones included; at most the booking's "
        "--max-output-tokens (default 0)",
    )
    end.add_argument(
        "--billed",
        metavar="AMOUNT",
        help="the provider's billed amount: $0.50, 0.50 USD or 500000000n",
    )
    end.add_argument(
        "--http-status",
        default="0",
        metavar="N",
        help="the provider's HTTP status, kept for the audit (default 0: none); "
        "a 4xx is a refused call: `ledger refund` it",
    )
    end.add_argument(
        "--cached-input-tokens",
        default="0",
        metavar="N",
        help="the part of --input-tokens read from the prompt cache",
    )
    end.add_argument(
        "--cache-write-tokens",
        default="0",
        metavar="N",
        help="the part of --input-tokens written to the prompt cache",
    )
    end.set_defaults(run=command(settle))


def _register_refund(commands: Any, common: argparse.ArgumentParser) -> None:
    back = commands.add_parser(
        "refund", parents=[common], help="end a refused (4xx) or never-sent call: charge zero"
    )
    back.add_argument("lane", metavar="LANE")
    back.add_argument("reservation_id", metavar="RESERVATION_ID")
    back.add_argument(
        "--http-status",
        default="0",
        metavar="N",
        help="the provider's 4xx; leave out for a call never sent",
    )
    back.add_argument(
        "--reason", default="", metavar="TEXT", help="required when there is no --http-status"
    )
    back.set_defaults(run=command(refund))


def _register_correct(commands: Any, common: argparse.ArgumentParser) -> None:
    fix = commands.add_parser(
        "correct",
        parents=[common],
        help="replace the charge of an ended booking (admin grant only)",
        description="Replaces the charge of an ended booking, recorded as a `corrected` "
        "event with the reason. Without --correction-id the id is derived from the lane, "
        "reservation id, charge and reason, so running the same command again changes "
        "nothing; pass --correction-id to make the same correction anew.",
    )
    fix.add_argument("lane", metavar="LANE")
    fix.add_argument("reservation_id", metavar="RESERVATION_ID")
    fix.add_argument(
        "--charge",
        required=True,
        metavar="AMOUNT",
        help="the new charge: $0.50, 0.50 USD or 500000000n",
    )
    fix.add_argument("--reason", required=True, metavar="TEXT", help="why, kept in the event")
    fix.add_argument(
        "--correction-id",
        metavar="ID",
        help="unique within the lane; a retry reuses it (default: derived from the content)",
    )
    fix.set_defaults(run=command(correct))
