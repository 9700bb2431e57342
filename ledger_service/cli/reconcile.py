"""`ledger reconcile`: a provider's usage export sent to the ledger, which
applies it in full or not at all, and the table of what each row did."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import grpc

from ledger_service.api.errors import REASON_KEY
from ledger_service.cli.connection import Session, command, common_options, explain
from ledger_service.cli.exits import EXIT_BAD_VALUE, EXIT_FAILED, EXIT_UNREACHABLE, CliError
from ledger_service.cli.render import emit, pairs, table, usd
from ledger_service.domain.counts import counted
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

MAX_EXPORT_BYTES = 4 * 1024 * 1024
# A 10,000-row export takes seconds to check; the default --timeout of a reconcile.
RECONCILE_TIMEOUT_SECONDS = 120
MAX_LINES_NAMED = 10
EXPORT_FORMAT_OF_SUFFIX = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
RECONCILE_HEADER = ("LINE", "LANE", "RESERVATION", "STATUS", "BEFORE -> AFTER", "MESSAGE")
# Rows whose before and after are charges of a booking the ledger found.
STATUSES_WITH_AMOUNTS = frozenset(
    {"corrected", "matched", "disagrees", "replaced", "open", "refunded"}
)


def read_export(
    path_text: str, chosen_format: str | None
) -> tuple[bytes, pb.ReconcileRequest.Format.ValueType]:
    """The export's bytes (at most MAX_EXPORT_BYTES) and its wire format."""
    path = pathlib.Path(path_text)
    export_format = chosen_format or EXPORT_FORMAT_OF_SUFFIX.get(path.suffix.lower())
    if export_format is None:
        raise CliError(
            f"FILE: cannot tell the format of {path} from its extension: "
            "pass --format csv or --format jsonl",
            EXIT_BAD_VALUE,
        )
    try:
        with path.open("rb") as export:
            content = export.read(MAX_EXPORT_BYTES + 1)
    except FileNotFoundError:
        raise CliError(f"FILE: there is no file {path}", EXIT_BAD_VALUE) from None
    except OSError as error:
        reason = error.strerror or error.__class__.__name__
        raise CliError(f"FILE: cannot read {path} ({reason})", EXIT_BAD_VALUE) from None
    if len(content) > MAX_EXPORT_BYTES:
        raise CliError(
            f"FILE: {path} is larger than {MAX_EXPORT_BYTES // (1024 * 1024)} MiB: "
            "split the export into smaller files",
            EXIT_BAD_VALUE,
        )
    wire = pb.ReconcileRequest.CSV if export_format == "csv" else pb.ReconcileRequest.JSONL
    return content, wire


def reconcile_row(row: pb.ReconcileRow) -> tuple[str, ...]:
    amounts = (
        f"{usd(row.before_nanos)} -> {usd(row.after_nanos)}"
        if row.status in STATUSES_WITH_AMOUNTS
        else "-"
    )
    # The server's message may already start with its field.
    message = row.message.removeprefix(f"{row.field}: ")
    message = f"{row.field}: {message}" if row.field else message
    return (
        str(row.line),
        row.lane or "-",
        row.reservation_id or "-",
        row.status,
        amounts,
        " ".join(message.split()),
    )


def reconcile_lines(
    response: pb.ReconcileResponse, dry_run: bool, bill_wins: bool = False
) -> list[str]:
    if response.bad_count:
        verdict = "not applied: the file has bad rows, so nothing changed"
    elif response.applied:
        verdict = "applied"
    elif dry_run:
        verdict = "dry run: nothing changed; without --dry-run this file would apply"
    else:
        verdict = "not applied"
    rows = [reconcile_row(row) for row in response.rows]
    shown = table(RECONCILE_HEADER, rows) if rows else ["the file holds no rows"]
    if response.rows_omitted:
        # The answer holds at most 4,000 rows (the routine ones up to 1,000).
        shown.append(
            f"{counted(response.rows_omitted, 'more row')} "
            "not listed (the ledger lists those that need a look and routine ones up to 1,000: "
            "at most 4,000)"
        )
    in_file = len(rows) + response.rows_omitted
    counts = (
        # The good rows of a refused file are listed as not_applied: they were never checked.
        f"{response.bad_count} bad, {in_file - response.bad_count} not checked"
        if response.bad_count
        else f"{response.corrected_count} corrected, {response.matched_count} matched, "
        f"{response.unmatched_count} unmatched, {response.disagreement_count} disagreeing"
        # Only a --bill-wins run replaces charges, so only it counts them.
        + (f", {response.replaced_count} replaced" if bill_wins or response.replaced_count else "")
    )
    totals = pairs(
        [
            ("estimated before", usd(response.estimated_before_nanos)),
            ("real after", usd(response.real_after_nanos)),
            ("difference", usd(response.difference_nanos)),
        ]
    )
    return [*shown, "", f"{verdict}: {counts}", *totals]


def _reconcile_failure(
    error: grpc.RpcError, arguments: argparse.Namespace, session: Session
) -> CliError:
    """A failed Reconcile, saying whether the file may have applied all the same."""
    if not isinstance(error, grpc.Call):
        return explain(error, session)
    code, details = error.code(), " ".join((error.details() or "").split())
    reason = dict(error.trailing_metadata() or ()).get(REASON_KEY, "")
    if reason:
        # The ledger's own refusal, by its error table: TOO_MANY_RECONCILES (no
        # turn in time) and TOO_MANY_CALLS (the grant's share taken) read and
        # wrote nothing; gRPC's RESOURCE_EXHAUSTED, below, carries no reason.
        return explain(error, session)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "Received message" in details:
        return CliError(
            f"the ledger at {session.server} takes no message as large as {arguments.file} "
            f"({details}): split the export into smaller files"
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        failure = f"could not send its answer, larger than its message limit ({details})"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        failure = f"did not answer within {session.timeout_seconds:g} s (see --timeout)"
    else:
        return explain(error, session)
    outcome = (
        "nothing changed (a dry run)"
        if arguments.dry_run
        else "the file may have applied: send it again with --dry-run to see "
        "(rows already corrected show as matched)"
    )
    return CliError(
        f"the ledger at {session.server} {failure}; {outcome}; split the export into smaller files",
        EXIT_UNREACHABLE if code is grpc.StatusCode.DEADLINE_EXCEEDED else EXIT_FAILED,
    )


def reconcile(arguments: argparse.Namespace, session: Session) -> int:
    content, wire_format = read_export(arguments.file, arguments.format)
    request = pb.ReconcileRequest(
        format=wire_format,
        content=content,
        default_lane=arguments.lane or "",
        dry_run=arguments.dry_run,
        bill_wins=arguments.bill_wins,
    )
    try:
        response = session.ledger.Reconcile(request, **session.options())
    except grpc.RpcError as error:
        raise _reconcile_failure(error, arguments, session) from None
    lines = reconcile_lines(response, arguments.dry_run, arguments.bill_wins)
    emit(arguments, response, lines)
    if response.bad_count:
        bad = [str(row.line) for row in response.rows if row.status == "bad"]
        shown = ", ".join(bad[:MAX_LINES_NAMED]) + (", ..." if len(bad) > MAX_LINES_NAMED else "")
        # A row with no lane of its own takes --lane's: without it, say so.
        unnamed = not arguments.lane and any(
            row.status == "bad" and row.field == "lane" and row.message.endswith("is required")
            for row in response.rows
        )
        print(
            f"ledger: not applied: {response.bad_count} bad "
            f"{'row (line' if len(bad) == 1 else 'rows (lines'} {shown}); nothing changed"
            + ("; rows that name no lane need --lane LANE" if unnamed else ""),
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0 if response.applied or arguments.dry_run else EXIT_FAILED


def register(commands: Any) -> None:
    fix = commands.add_parser(
        "reconcile",
        parents=[common_options(RECONCILE_TIMEOUT_SECONDS)],
        help="correct UNKNOWN and expired charges from the provider's usage export",
        description="Sends a provider's usage export (CSV with a header row, or JSON lines; "
        "keys reservation_id, lane, billed_nanos or billed_usd, input_tokens, output_tokens, "
        "model) to the ledger. The file applies in full or not at all. A real charge that "
        "disagrees with the bill is flagged, not changed, unless --bill-wins: then the bill "
        "replaces it (status replaced, a `corrected` event). Exits 0 when it "
        "applied (or a --dry-run found no bad row), 1 when bad rows kept it from applying.",
    )
    fix.add_argument(
        "file", metavar="FILE", help=f"the export, at most {MAX_EXPORT_BYTES // 2**20} MiB"
    )
    fix.add_argument(
        "--format",
        choices=("csv", "jsonl"),
        help="default from the extension: .csv, or .jsonl / .ndjson",
    )
    fix.add_argument(
        "--lane",
        metavar="LANE",
        help="the lane of rows that name none (not a filter: a row that names its "
        "lane is reconciled in that lane)",
    )
    fix.add_argument(
        "--dry-run", action="store_true", help="show what would change; change nothing"
    )
    fix.add_argument(
        "--bill-wins",
        action="store_true",
        help="replace real charges that disagree with the bill (default: flag them, "
        "change nothing)",
    )
    fix.set_defaults(run=command(reconcile))
