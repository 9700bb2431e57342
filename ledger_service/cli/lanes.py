"""`ledger lane put`, `lane show` and `lane list`: a lane's policy."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ledger_service.cli.connection import MAX_PAGES, PAGE_SIZE, Session, command
from ledger_service.cli.exits import EXIT_BAD_VALUE, CliError
from ledger_service.cli.render import (
    duration_text,
    emit,
    enum_name,
    message_json,
    pairs,
    table,
    time_text,
    usd,
)
from ledger_service.cli.values import (
    parse_amount_nanos,
    parse_bytes_per_token,
    parse_count,
    parse_duration,
    parse_price,
)
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb


def lane_lines(lane: pb.Lane) -> list[str]:
    rows = [("lane", lane.lane)]
    if lane.parent:
        rows.append(("parent", f"{lane.parent} (a reserve must fit its budget too)"))
    rows += [
        ("limit", f"{usd(lane.limit_nanos)} per {duration_text(lane.window)} (rolling)"),
        ("hold ttl", duration_text(lane.hold_ttl)),
        ("bytes per token", f"{lane.bytes_per_token:g}"),
        ("overhead tokens", str(lane.overhead_tokens)),
        ("expire charge", enum_name(pb.ExpireCharge, lane.expire_charge)),
        ("max charge", max_charge_text(lane)),
        ("version", str(lane.version)),
        ("updated at", time_text(lane.updated_at)),
    ]
    rows += [(f"price {model}", price_text(lane.prices[model])) for model in sorted(lane.prices)]
    return pairs(rows)


def max_charge_text(lane: pb.Lane) -> str:
    """The bound on a SUCCEEDED charge, as the server states it."""
    if not lane.HasField("max_charge_multiple"):
        return "the server's default"
    multiple = lane.max_charge_multiple
    return f"{multiple}x the cap" if multiple else "no bound"


def price_text(price: pb.ModelPrice) -> str:
    """'in $X / out $Y per million tokens', and the cache prices when the lane sets them."""
    parts = [
        f"in {usd(price.input_nanos_per_million_tokens)}",
        f"out {usd(price.output_nanos_per_million_tokens)}",
    ]
    if price.HasField("cached_input_nanos_per_million_tokens"):
        parts.append(f"cached in {usd(price.cached_input_nanos_per_million_tokens)}")
    if price.HasField("cache_write_nanos_per_million_tokens"):
        parts.append(f"cache write {usd(price.cache_write_nanos_per_million_tokens)}")
    return " / ".join(parts) + " per million tokens"


def lane_put(arguments: argparse.Namespace, session: Session) -> int:
    prices: dict[str, pb.ModelPrice] = {}
    for text in arguments.price:
        model, price = parse_price(text)
        if model in prices:
            raise CliError(f"--price: model {model!r} is priced twice", EXIT_BAD_VALUE)
        prices[model] = price
    lane = pb.Lane(
        lane=arguments.lane,
        limit_nanos=parse_amount_nanos("--limit", arguments.limit),
        prices=prices,
        expire_charge=pb.ZERO if arguments.expire_charge == "zero" else pb.HOLD,
    )
    if arguments.window is not None:
        lane.window.CopyFrom(parse_duration("--window", arguments.window))
    if arguments.hold_ttl is not None:
        lane.hold_ttl.CopyFrom(parse_duration("--hold-ttl", arguments.hold_ttl))
    if arguments.bytes_per_token is not None:
        lane.bytes_per_token = parse_bytes_per_token(arguments.bytes_per_token)
    if arguments.overhead_tokens is not None:
        lane.overhead_tokens = parse_count("--overhead-tokens", arguments.overhead_tokens)
    if arguments.parent is not None:
        lane.parent = arguments.parent
    if arguments.max_charge_multiple is not None:
        lane.max_charge_multiple = parse_count(
            "--max-charge-multiple", arguments.max_charge_multiple
        )
    saved = session.admin.PutLane(pb.PutLaneRequest(lane=lane), **session.options())
    emit(arguments, saved, lane_lines(saved))
    return 0


def lane_show(arguments: argparse.Namespace, session: Session) -> int:
    lane = session.admin.GetLane(pb.GetLaneRequest(lane=arguments.lane), **session.options())
    emit(arguments, lane, lane_lines(lane))
    return 0


def lane_list(arguments: argparse.Namespace, session: Session) -> int:
    lanes: list[pb.Lane] = []
    token = ""
    for _ in range(MAX_PAGES):
        request = pb.ListLanesRequest(page_size=PAGE_SIZE, page_token=token)
        page = session.admin.ListLanes(request, **session.options())
        lanes.extend(page.lanes)
        token = page.next_page_token
        if not token:
            break
    else:
        print(f"ledger: showing the first {len(lanes)} lanes only", file=sys.stderr)
    if arguments.json:
        print(json.dumps({"lanes": [message_json(lane) for lane in lanes]}, sort_keys=True))
        return 0
    header = ("LANE", "PARENT", "LIMIT", "WINDOW", "HOLD TTL", "MODELS", "VERSION", "UPDATED (UTC)")
    rows = [
        (
            lane.lane,
            lane.parent or "-",
            usd(lane.limit_nanos),
            duration_text(lane.window),
            duration_text(lane.hold_ttl),
            ",".join(sorted(lane.prices)),
            str(lane.version),
            time_text(lane.updated_at),
        )
        for lane in lanes
    ]
    print(
        "\n".join(table(header, rows))
        if rows
        else "no lanes yet: create one with `ledger lane put`"
    )
    return 0


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    lane = commands.add_parser("lane", help="create, show and list lanes")
    actions = lane.add_subparsers(dest="lane_command", required=True, metavar="ACTION")
    put = actions.add_parser("put", parents=[common], help="create or replace a lane's policy")
    put.add_argument("lane", metavar="LANE")
    put.add_argument(
        "--limit",
        required=True,
        metavar="AMOUNT",
        help="most booked inside one window: $0.50, 0.50 USD or 500000000n",
    )
    put.add_argument(
        "--price",
        action="append",
        required=True,
        metavar="MODEL=IN/OUT[/CACHED_IN[/CACHE_WRITE]]",
        help="USD per million tokens, e.g. jev=0.10/0.40 (or nanos: "
        "jev=100000000n/400000000n); CACHED_IN and CACHE_WRITE price the input tokens "
        "read from and written to the prompt cache (default: IN); repeat for each model",
    )
    put.add_argument("--window", metavar="DURATION", help="rolling window (default 24h)")
    put.add_argument(
        "--hold-ttl",
        metavar="DURATION",
        help="how long a reserve's hold lasts unsettled (default 120s)",
    )
    put.add_argument(
        "--bytes-per-token",
        metavar="NUMBER",
        help="request bytes per input token when a reserve prices its request, "
        "at most three decimals (default 3.5)",
    )
    put.add_argument(
        "--overhead-tokens",
        metavar="N",
        help="input tokens added to every reserve's request for templates and tool schemas "
        "(default 0)",
    )
    put.add_argument(
        "--expire-charge",
        choices=("hold", "zero"),
        default="hold",
        help="what an expired booking costs (default hold)",
    )
    put.add_argument(
        "--parent",
        metavar="LANE",
        help="a parent budget (another lane) that every reserve must fit too; "
        "a put replaces the whole policy, so leave it out to have none",
    )
    put.add_argument(
        "--max-charge-multiple",
        metavar="N",
        help="refuse a succeeded settle's charge above N times the booking's cap "
        "(default 100; 0: no bound)",
    )
    put.set_defaults(run=command(lane_put))
    show = actions.add_parser("show", parents=[common], help="show a lane's policy")
    show.add_argument("lane", metavar="LANE")
    show.set_defaults(run=command(lane_show))
    listing = actions.add_parser("list", parents=[common], help="list every lane")
    listing.set_defaults(run=command(lane_list))
