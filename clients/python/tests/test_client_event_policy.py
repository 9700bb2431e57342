"""A lane_configured event's new policy, converted from the wire as the Node
client converts it (clients/node/tests/client.test.js, "an event's policy")."""

from __future__ import annotations

import datetime

from google.protobuf import duration_pb2, timestamp_pb2
from ledger_client import LanePolicy, ModelPrice, convert
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb

UTC = datetime.UTC


def _configured() -> pb.Event:
    return pb.Event(
        seq=7,
        lane="recall",
        kind="lane_configured",
        occurred_at=timestamp_pb2.Timestamp(seconds=1_790_000_000),
        policy=pb.Lane(
            lane="recall",
            limit_nanos=2**62,
            window=duration_pb2.Duration(seconds=3600, nanos=500_000_000),
            hold_ttl=duration_pb2.Duration(seconds=120),
            bytes_per_token=3.7,
            overhead_tokens=40,
            prices={
                "m": pb.ModelPrice(
                    input_nanos_per_million_tokens=1_000_000,
                    output_nanos_per_million_tokens=2_000_000,
                    cache_write_nanos_per_million_tokens=1_250_000,
                )
            },
            expire_charge=pb.ZERO,
            version=7,
            updated_at=timestamp_pb2.Timestamp(seconds=1_790_000_000, nanos=1_500_000),
            parent="team",
            max_charge_multiple=0,
        ),
    )


def test_a_lane_configured_event_carries_its_new_policy_typed() -> None:
    policy = convert.event(_configured()).policy
    assert policy == LanePolicy(
        lane="recall",
        limit_nanos=2**62,
        window=datetime.timedelta(seconds=3600, microseconds=500_000),
        hold_ttl=datetime.timedelta(seconds=120),
        # 3.7 travels as a double: thousandths, as the ledger keeps it.
        bytes_per_token_milli=3700,
        overhead_tokens=40,
        prices={"m": ModelPrice(1_000_000, 2_000_000, None, 1_250_000)},
        expire_charge="ZERO",
        version=7,
        updated_at=datetime.datetime(2026, 9, 21, 14, 13, 20, 1500, tzinfo=UTC),
        parent="team",
        max_charge_multiple=0,
    )


def test_the_optional_settings_the_wire_leaves_out_are_none() -> None:
    # The ledger always sends them resolved; unset on the wire, the client says so.
    message = pb.Event(seq=1, lane="recall", kind="lane_configured", policy=pb.Lane(lane="recall"))
    policy = convert.event(message).policy
    assert policy is not None
    assert (policy.bytes_per_token_milli, policy.overhead_tokens, policy.max_charge_multiple) == (
        None,
        None,
        None,
    )
    assert (policy.parent, policy.expire_charge, dict(policy.prices)) == ("", "", {})


def test_other_events_have_no_policy() -> None:
    message = pb.Event(seq=2, lane="recall", kind="reserved", reservation_id="r-1")
    assert convert.event(message).policy is None
