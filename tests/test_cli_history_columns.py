"""`ledger history --follow` prints rows that arrive after its header: its
columns were sized for the README's short ids (`r-1`), so every row a lane
client booked (a 32-hex-digit reservation id) and every `succeeded http 200`
pushed the columns after it out of line with the header."""

from __future__ import annotations

import argparse
import re

import pytest
from google.protobuf import timestamp_pb2

from ledger_service.cli import exits, reading
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.test_cli_history_newest import _FollowedLedger, _FollowSession

_AT = timestamp_pb2.Timestamp(seconds=1_790_000_000)
_CLIENT_ID = "31aa559837cb4869aa6f501326da55a1"


def _followed_rows() -> list[pb.Event]:
    common = {"lane": "incoming-filter", "occurred_at": _AT, "trace_id": "f" * 32}
    return [
        pb.Event(seq=1, kind="lane_configured", limit_nanos=500_000_000, **common),
        pb.Event(seq=2, kind="reserved", reservation_id=_CLIENT_ID, amount_nanos=41_250, **common),
        pb.Event(
            seq=3,
            kind="settled",
            reservation_id=_CLIENT_ID,
            amount_nanos=2_000,
            outcome=pb.SUCCEEDED,
            http_status=200,
            **common,
        ),
        pb.Event(
            seq=4,
            kind="denied",
            reservation_id=_CLIENT_ID[::-1],
            denial_reason=pb.HOLD_EXCEEDS_LIMIT,
            **common,
        ),
    ]


def _cell_starts(line: str) -> list[int]:
    # A cell is text with single spaces inside; columns are two or more apart.
    return [match.start() for match in re.finditer(r"\S+(?: \S+)*", line)]


@pytest.mark.parametrize("lane", ["", "incoming-filter"])
def test_followed_rows_stay_under_their_header(
    lane: str, capsys: pytest.CaptureFixture[str]
) -> None:
    session = _FollowSession(_FollowedLedger(_followed_rows(), max_page=5))
    arguments = argparse.Namespace(
        lane=lane, reservation_id="", limit="50", after_seq="0", follow=True, json=False
    )
    with pytest.raises(exits.CliError, match="ended the stream"):
        reading.history(arguments, session)  # type: ignore[arg-type]
    header, *rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 4
    for row in rows:
        assert _cell_starts(row) == _cell_starts(header), f"\n{header}\n{row}"
