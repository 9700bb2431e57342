"""A grant the client cannot send is refused at construction, as the Node client does."""

from __future__ import annotations

import pytest
from ledger_client import LaneClient

# Shaped like a real grant; what matters is that it never shows up in an error.
GRANT = "lg1.k3f9a01c2.eyJleHAiOjE4fQ.q0JxSECRETSIGNATURE5Uk"


@pytest.mark.parametrize(
    "grant",
    [
        # Read from a file (admin.grant ends with one), a grant often ends with a
        # line break: grpcio refuses the header on every call with a bare
        # INTERNAL, which the client took for an outage (LedgerUnavailable).
        f"{GRANT}\n",
        f"{GRANT}\r\n",
        f" {GRANT}",
        f"{GRANT} x",
        f"{GRANT}\u00e9",
        "",
        # Longer than the ledger takes (4096): past 8 KiB of headers gRPC refused
        # some calls at random with RESOURCE_EXHAUSTED, which the client raised
        # as LedgerOverloaded (an outage), the others UNAUTHENTICATED.
        "x" * 4097,
        "x" * (16 * 1024 + 1),
    ],
)
def test_a_grant_no_header_can_carry_is_refused_at_construction(grant: str) -> None:
    with pytest.raises(ValueError, match="grant") as refused:
        LaneClient("127.0.0.1:1", "lane", grant=grant)
    assert "SECRETSIGNATURE" not in str(refused.value)


def test_a_visible_ascii_grant_is_taken() -> None:
    LaneClient("127.0.0.1:1", "lane", grant=GRANT).close()
