"""`ledger grant`: issue and inspect grants, and rotate the keys that sign them.

These commands read the keyring in the server's data directory; they never talk
to the server (a grant is checked by its signature alone). A grant is printed on
stdout and nothing else is, so `GRANT=$(ledger grant issue ...)` works.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import sys
from collections.abc import Mapping
from typing import Any

from ledger_service.cli.exits import EXIT_BAD_VALUE
from ledger_service.domain.clock import MICROS_PER_SECOND, SystemClock
from ledger_service.domain.grants import (
    ALL_LANES,
    MAX_GRANT_LENGTH,
    MAX_GRANT_LIFETIME_SECONDS,
    Grant,
    GrantRejected,
    Rejection,
    Scope,
    decode_unverified,
)
from ledger_service.settings import Settings
from ledger_service.storage import keyring

EXIT_REFUSED = 1  # inspect: the grant is not valid (or cannot be checked)
SECONDS_PER_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_DURATION = re.compile(r"([0-9]{1,10})([smhd])")


def register(commands: Any) -> None:
    grant = commands.add_parser("grant", help="issue and inspect grants; rotate their keys")
    actions = grant.add_subparsers(dest="grant_command", required=True, metavar="ACTION")

    issue = actions.add_parser("issue", help="print a new grant, signed by the server's key")
    issue.add_argument(
        "--lane",
        action="append",
        required=True,
        dest="lanes",
        help="a lane the grant covers (repeat for more; '*' for every lane)",
    )
    issue.add_argument(
        "--scope",
        action="append",
        required=True,
        dest="scopes",
        choices=[scope.value for scope in Scope],
        help="charge: reserve, settle and refund (and the lane's balance and bookings); "
        "read: balance, bookings, events, audit; "
        "admin: everything (needs --lane '*'). Repeat for more",
    )
    issue.add_argument(
        "--expires",
        default="30d",
        metavar="DURATION",
        help="lifetime: a number and s, m, h or d (default 30d)",
    )
    _data_dir_option(issue)
    issue.set_defaults(run=_issue)

    inspect = actions.add_parser("inspect", help="show what a grant allows and whether it is valid")
    inspect.add_argument("token", metavar="GRANT", help="the grant, or - to read it from stdin")
    _data_dir_option(inspect)
    inspect.set_defaults(run=_inspect)

    rotate = actions.add_parser("rotate-key", help="add a new signing key (old keys still verify)")
    _data_dir_option(rotate)
    rotate.set_defaults(run=_rotate)

    retire = actions.add_parser("retire-key", help="remove a key: grants it signed stop working")
    retire.add_argument("key_id", metavar="KEY_ID")
    _data_dir_option(retire)
    retire.set_defaults(run=_retire)

    keys = actions.add_parser("keys", help="list the key ids and which one signs")
    _data_dir_option(keys)
    keys.set_defaults(run=_keys)


def _data_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=pathlib.Path,
        metavar="DIR",
        help="the server's data directory (default LEDGER_DATA_DIR or ./data)",
    )


def _data_dir(arguments: argparse.Namespace) -> pathlib.Path:
    try:
        return Settings.from_environment(data_dir=arguments.data_dir).data_dir
    except ValueError as error:  # a refused LEDGER_* setting: one line, no traceback
        print(f"ledger {arguments.command}: {error}", file=sys.stderr)
        raise SystemExit(2) from error


def lifetime_seconds(text: str) -> int:
    """Parses "30d", "12h", "90m" or "3600s". Raises ValueError."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--expires {text!r}: use a number and s, m, h or d, as in 30d")
    seconds = int(match.group(1)) * SECONDS_PER_UNIT[match.group(2)]
    if seconds == 0:
        raise ValueError(f"--expires {text!r}: a grant must live at least 1 s")
    if seconds > MAX_GRANT_LIFETIME_SECONDS:
        raise ValueError("--expires: a grant may live at most 3,660 days (ten years of 366 days)")
    return seconds


def _issue(arguments: argparse.Namespace) -> int:
    scopes = {Scope(scope) for scope in arguments.scopes}
    if Scope.ADMIN in scopes and set(arguments.lanes) != {ALL_LANES}:
        return _bad_value("--scope admin covers every lane: give --lane '*' (and no other lane)")
    try:
        seconds = lifetime_seconds(arguments.expires)
        grant_keys = keyring.load(_data_dir(arguments))
        now_us = SystemClock().now_us()
        token = grant_keys.issue(
            arguments.lanes,
            scopes,
            issued_at_us=now_us,
            expires_at_us=now_us + seconds * MICROS_PER_SECOND,
        )
    except keyring.KeyringError as error:
        return _bad_value(
            f"{error} (`ledger serve` creates one at its first start; if one was lost,"
            " restore it: a new one would refuse every grant issued before)"
        )
    except ValueError as error:
        return _bad_value(str(error))
    print(token)
    return 0


def _inspect(arguments: argparse.Namespace) -> int:
    token = arguments.token
    if token == "-":
        token = sys.stdin.read(MAX_GRANT_LENGTH + 1)
    token = token.strip().removeprefix("Bearer ").strip()
    try:
        grant = decode_unverified(token)
    except GrantRejected as rejection:
        # An error, not claims: on stderr, as every command's errors are.
        print(f"ledger grant inspect: not a grant ({rejection.why.value})", file=sys.stderr)
        return EXIT_REFUSED
    now_us = SystemClock().now_us()
    _show(grant, now_us)
    data_dir = _data_dir(arguments)
    try:
        grant_keys = keyring.load(data_dir)
    except keyring.KeyringError:
        print(f"signature:  not checked (no readable keyring in {data_dir})")
        return EXIT_REFUSED
    try:
        grant_keys.verify(token, now_us)
    except GrantRejected as rejection:
        print(f"signature:  {_verdict(rejection.why, grant, grant_keys.keys, data_dir)}")
        return EXIT_REFUSED
    print(
        f"signature:  valid (key {grant.key_id} of the keyring in {data_dir}; "
        f"a server accepts it only if its own keyring holds {grant.key_id})"
    )
    return 0


def _show(grant: Grant, now_us: int) -> None:
    lanes = "every lane" if ALL_LANES in grant.lanes else ", ".join(sorted(grant.lanes))
    scopes = sorted(scope.value for scope in grant.scopes)
    if Scope.ADMIN in grant.scopes:
        lanes = "every lane (admin)"
    left_seconds = (grant.expires_at_us - now_us) // MICROS_PER_SECOND
    left = f"in {_span(left_seconds)}" if left_seconds > 0 else "EXPIRED"
    print(f"lanes:      {lanes}")
    print(f"scopes:     {', '.join(scopes)}{_implied(grant)}")
    print(f"issued at:  {_instant(grant.issued_at_us)}")
    print(f"expires at: {_instant(grant.expires_at_us)} ({left})")
    print(f"key id:     {grant.key_id}")
    print(f"grant id:   {grant.grant_id}")


def _implied(grant: Grant) -> str:
    return " (implies charge and read)" if Scope.ADMIN in grant.scopes else ""


def _verdict(
    why: Rejection, grant: Grant, keys: Mapping[str, bytes], data_dir: pathlib.Path
) -> str:
    """What the keyring in `data_dir` says of the grant's signature. Only this
    keyring is asked: a key it lacks may be another server's (another data
    directory), so such a grant is unchecked here, not invalid."""
    if why is Rejection.UNKNOWN_KEY:
        return (
            f"not checked: key {grant.key_id} is not in the keyring in {data_dir} "
            f"(it holds {', '.join(sorted(keys))}); check it with --data-dir set to the "
            "data directory of a server that should accept it"
        )
    if why is Rejection.BAD_SIGNATURE:
        return (
            f"NOT VALID: key {grant.key_id} of the keyring in {data_dir} does not match "
            "its signature (tampered with)"
        )
    if why is Rejection.EXPIRED:
        return f"signed by key {grant.key_id} of the keyring in {data_dir}, but EXPIRED"
    return f"NOT VALID ({why.value})"


def _instant(instant_us: int) -> str:
    moment = datetime.datetime.fromtimestamp(instant_us / MICROS_PER_SECOND, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _span(seconds: int) -> str:
    days, rest = divmod(seconds, 86_400)
    if days:
        return f"{days} d {rest // 3600} h"
    return f"{rest // 3600} h {rest % 3600 // 60} min"


def _rotate(arguments: argparse.Namespace) -> int:
    try:
        rotated = keyring.rotate(_data_dir(arguments))
    except keyring.KeyringError as error:
        return _bad_value(str(error))
    print(
        f"key {rotated.signing_key_id} now signs new grants; running servers"
        " take the changed keyring within a health check (1 s by default)"
    )
    return 0


def _retire(arguments: argparse.Namespace) -> int:
    try:
        keyring.retire(_data_dir(arguments), arguments.key_id)
    except keyring.KeyringError as error:
        return _bad_value(str(error))
    print(
        f"key {arguments.key_id} retired; running servers refuse its grants"
        " within a health check (1 s by default)"
    )
    return 0


def _keys(arguments: argparse.Namespace) -> int:
    try:
        grant_keys = keyring.load(_data_dir(arguments))
    except keyring.KeyringError as error:
        return _bad_value(str(error))
    for key_id in sorted(grant_keys.keys):
        print(f"{key_id}{'  (signs)' if key_id == grant_keys.signing_key_id else ''}")
    return 0


def _bad_value(message: str) -> int:
    print(f"ledger grant: {message}", file=sys.stderr)
    return EXIT_BAD_VALUE
