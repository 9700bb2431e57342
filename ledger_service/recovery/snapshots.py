"""Snapshots of the projections: what they hold and how their digest is made.

    digest = sha256 over lines: "ledger-snapshot <FORMAT_VERSION> <position_seq>",
             "heads <json>", "lane <json>" per lane, "booking <json>" per booking

(docs/recovery.md, Snapshots.)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from ledger_service.domain.chain import canonical_json
from ledger_service.domain.policies import LanePolicy

# Bump when Booking, LanePolicy or the folds change what a projection holds.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ChainPoint:
    """A verified point: every link of the log through `position_seq` checked
    out, and each lane's chain head right after it."""

    position_seq: int
    chain_heads: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: int
    position_seq: int
    taken_at_us: int
    format_version: int
    lanes_count: int
    bookings_count: int
    digest: str
    chain_heads: Mapping[str, str]
    # Whether every link of the log up to position_seq checked out when it was taken.
    chain_verified: bool

    @property
    def rows(self) -> int:
        return self.lanes_count + self.bookings_count


class ProjectionDigest:
    """An incremental digest: memory stays bounded however large the projection."""

    def __init__(self, position_seq: int, chain_heads: Mapping[str, str]) -> None:
        self._hash = hashlib.sha256()
        self._line(f"ledger-snapshot {FORMAT_VERSION} {position_seq}")
        self._line("heads " + canonical_json(dict(sorted(chain_heads.items()))))
        self.lanes = 0
        self.bookings = 0

    def _line(self, text: str) -> None:
        self._hash.update(text.encode("utf-8"))
        self._hash.update(b"\n")

    def add_lane(self, policy: LanePolicy) -> None:
        self.lanes += 1
        self._line("lane " + canonical_json(policy))

    def add_booking_text(self, text: str) -> None:
        """Adds the booking whose chain.canonical_json is `text`."""
        self.bookings += 1
        self._line("booking " + text)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
