"""Every bad credential against every method of Ledger, LaneAdmin and TestClock.

The methods come from the proto, so a method added later is in the matrix at
once: unless it is listed below as a charge or read method, it must need admin.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from ledger_service.api.auth import RefusalLog
from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.security.conftest import (
    HOME_LANE,
    OTHER_LANE,
    Forge,
    Method,
    SecureLedger,
    all_methods,
    bearer,
    request_for,
)

CHARGE_METHODS = {"Reserve", "Settle", "Refund"}
READ_METHODS = {"GetBalance", "GetBooking", "ListEvents", "WatchEvents", "GetAudit"}
# Read methods a charge grant may call on its own lanes (a lane reads its balance
# and bookings to choose its fallback).
CHARGE_READS = {"GetBalance", "GetBooking"}
NOT_LETTING_IN = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def needed_scope(method: Method) -> Scope:
    if method.service == "Ledger" and method.name in CHARGE_METHODS:
        return Scope.CHARGE
    if method.service == "Ledger" and method.name in READ_METHODS:
        return Scope.READ
    return Scope.ADMIN


def wrong_scope_grant(forge: Forge, method: Method) -> str:
    """A grant with every scope but the one the method needs (never admin)."""
    if needed_scope(method) is Scope.CHARGE:
        return forge.grant([HOME_LANE], [Scope.READ])
    if needed_scope(method) is Scope.READ:
        return forge.grant([HOME_LANE], [Scope.CHARGE])
    return forge.grant(["*"], [Scope.CHARGE, Scope.READ])


def right_grant(forge: Forge, method: Method) -> str:
    scope = needed_scope(method)
    if scope is Scope.ADMIN:
        return forge.grant(["*"], [Scope.ADMIN])
    return forge.grant([HOME_LANE], [scope])


Credentials = Callable[[Forge, str], tuple[tuple[str, str], ...]]


def _charge_read(forge: Forge) -> str:
    return forge.grant([HOME_LANE], [Scope.CHARGE, Scope.READ])


def _flipped_signature(token: str) -> str:
    """The token with the first character of its signature changed."""
    signed, signature = token.rsplit(".", 1)
    return f"{signed}.{'B' if signature[0] == 'A' else 'A'}{signature[1:]}"


UNAUTHENTICATED_CASES: dict[str, Callable[[Forge], tuple[tuple[str, str | bytes], ...]]] = {
    "missing": lambda forge: (),
    "empty bearer": lambda forge: (("authorization", "Bearer "),),
    "no scheme": lambda forge: (("authorization", _charge_read(forge)),),
    "basic scheme": lambda forge: (("authorization", "Basic YWRtaW46YWRtaW4="),),
    "garbage": lambda forge: bearer("not-a-grant"),
    "jwt alg none": lambda forge: bearer("eyJhbGciOiJub25lIn0.eyJzdWIiOiJhZG1pbiJ9."),
    "empty signature": lambda forge: bearer(_charge_read(forge).rsplit(".", 1)[0] + "."),
    "truncated signature": lambda forge: bearer(_charge_read(forge)[:-2]),
    "flipped signature": lambda forge: bearer(_flipped_signature(_charge_read(forge))),
    "two grants": lambda forge: (*bearer(_charge_read(forge)), *bearer(_charge_read(forge))),
    "binary header": lambda forge: (("authorization-bin", b"\xff\xfe\x00"),),
    "expired": lambda forge: bearer(forge.expired([HOME_LANE], [Scope.CHARGE, Scope.READ])),
    "expired admin": lambda forge: bearer(forge.expired(["*"], [Scope.ADMIN])),
    "tampered to admin": lambda forge: bearer(
        forge.tampered(_charge_read(forge), lanes=["*"], scopes=["admin"])
    ),
    "tampered expiry": lambda forge: bearer(
        forge.tampered(forge.expired(["*"], [Scope.ADMIN]), exp=2**53)
    ),
    "tampered lane": lambda forge: bearer(forge.tampered(_charge_read(forge), lanes=[OTHER_LANE])),
    "another server's key": lambda forge: bearer(forge.other_server(["*"], [Scope.ADMIN])),
    "another server's key, same key id": lambda forge: bearer(
        forge.other_server_same_key_id(["*"], [Scope.ADMIN])
    ),
    "unknown key id": lambda forge: bearer(forge.with_key_id(_charge_read(forge), "kdeadbeef")),
    "oversized": lambda forge: bearer("lg1.k1." + "A" * 6000 + ".AAAA"),
}


@pytest.mark.parametrize("method", all_methods(), ids=lambda method: method.path)
@pytest.mark.parametrize("case", sorted(UNAUTHENTICATED_CASES))
def test_bad_credentials_are_unauthenticated(
    shared_ledger: SecureLedger, method: Method, case: str
) -> None:
    before = shared_ledger.event_count()
    metadata = UNAUTHENTICATED_CASES[case](shared_ledger.forge)
    outcome = shared_ledger.caller.call(method, request_for(method), metadata)
    assert outcome.code is grpc.StatusCode.UNAUTHENTICATED, (case, outcome)
    assert outcome.trailing.get("ledger-reason") == "UNAUTHENTICATED"
    assert outcome.details == (
        "a valid grant is required (metadata 'authorization: Bearer <grant>')"
    ), "the message is constant: it says nothing about why"
    assert shared_ledger.event_count() == before


@pytest.mark.parametrize("method", all_methods(), ids=lambda method: method.path)
def test_a_grant_for_another_lane_is_denied(shared_ledger: SecureLedger, method: Method) -> None:
    before = shared_ledger.event_count()
    grant = shared_ledger.forge.grant([OTHER_LANE], [Scope.CHARGE, Scope.READ])
    outcome = shared_ledger.caller.call(method, request_for(method, HOME_LANE), bearer(grant))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
    assert outcome.trailing.get("ledger-reason") == "PERMISSION_DENIED"
    # It says what the method needs and what the caller's own grant holds.
    # An admin-only method needs its scope on every lane, and names the lane
    # its request asked for when it names one (it said "on every lane" alone).
    if needed_scope(method) is not Scope.ADMIN:
        said = f"{method.name} on lane '{HOME_LANE}' needs the "
    elif method.name in ADMIN_NAMING_A_LANE:
        said = f"{method.name} on lane '{HOME_LANE}' needs the admin scope on every lane; "
    else:
        said = f"{method.name} needs the admin scope on every lane; "
    assert outcome.details.startswith(said), outcome.details
    assert outcome.details.endswith(f"; this grant has charge, read on {OTHER_LANE}")
    assert needed_scope(method).value in outcome.details
    assert shared_ledger.event_count() == before


# The admin-only methods whose request names one lane (a reconcile's rows name theirs).
ADMIN_NAMING_A_LANE = frozenset({"Correct", "PutLane", "GetLane"})


@pytest.mark.parametrize("length", [201, 5_000, 200_000])
def test_a_long_lane_for_another_grant_is_denied_with_a_bounded_message(
    shared_ledger: SecureLedger, length: int
) -> None:
    """The refusal names the lane asked for, before any check of it: its echo
    is cut at a lane name's 200 characters, or gRPC's trailer limit turned the
    refusal into its own RESOURCE_EXHAUSTED."""
    [method] = [method for method in all_methods() if method.name == "GetBalance"]
    grant = shared_ledger.forge.grant([OTHER_LANE], [Scope.CHARGE, Scope.READ])
    outcome = shared_ledger.caller.call(method, request_for(method, "x" * length), bearer(grant))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
    assert outcome.trailing.get("ledger-reason") == "PERMISSION_DENIED"
    assert len(outcome.details) < 500, len(outcome.details)


@pytest.mark.parametrize(
    "method",
    [method for method in all_methods() if method.name not in CHARGE_READS],
    ids=lambda method: method.path,
)
def test_a_grant_without_the_scope_is_denied(shared_ledger: SecureLedger, method: Method) -> None:
    before = shared_ledger.event_count()
    grant = wrong_scope_grant(shared_ledger.forge, method)
    outcome = shared_ledger.caller.call(method, request_for(method), bearer(grant))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
    assert outcome.trailing.get("ledger-reason") == "PERMISSION_DENIED"
    assert f"needs the {needed_scope(method).value} scope" in outcome.details, outcome.details
    assert shared_ledger.event_count() == before


@pytest.mark.parametrize("method", all_methods(), ids=lambda method: method.path)
def test_the_right_grant_lets_the_call_in(shared_ledger: SecureLedger, method: Method) -> None:
    for grant in (right_grant(shared_ledger.forge, method), shared_ledger.server.admin_grant):
        outcome = shared_ledger.caller.call(method, request_for(method), bearer(grant))
        assert outcome.code not in NOT_LETTING_IN, outcome


@pytest.mark.parametrize(
    "method",
    [method for method in all_methods() if needed_scope(method) is not Scope.ADMIN],
    ids=lambda method: method.path,
)
def test_an_empty_lane_is_not_a_wildcard(shared_ledger: SecureLedger, method: Method) -> None:
    grant = shared_ledger.forge.grant([HOME_LANE], [Scope.CHARGE, Scope.READ])
    outcome = shared_ledger.caller.call(method, request_for(method, ""), bearer(grant))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome


@pytest.mark.parametrize("name", ["ListEvents", "WatchEvents"])
def test_every_lane_reads_need_a_grant_for_every_lane(
    shared_ledger: SecureLedger, name: str
) -> None:
    method = next(m for m in all_methods() if m.name == name)
    forge = shared_ledger.forge
    every_lane = method.request_class()  # an empty lane filter: the whole log
    for lanes in ([HOME_LANE], [HOME_LANE, OTHER_LANE]):
        outcome = shared_ledger.caller.call(
            method, every_lane, bearer(forge.grant(lanes, [Scope.READ]))
        )
        assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
    for grant in (forge.grant(["*"], [Scope.READ]), forge.grant(["*"], [Scope.ADMIN])):
        outcome = shared_ledger.caller.call(method, every_lane, bearer(grant))
        assert outcome.code is grpc.StatusCode.OK, outcome


def test_a_lane_grant_charges_its_lane_end_to_end(shared_ledger: SecureLedger) -> None:
    methods = {method.name: method for method in all_methods()}
    charge = bearer(shared_ledger.forge.grant([OTHER_LANE], [Scope.CHARGE]))
    reserve = pb.ReserveRequest(
        lane=OTHER_LANE, reservation_id="e2e-1", model="jev", request_bytes=350,
        max_output_tokens=10,
    )  # fmt: skip
    before = shared_ledger.event_count()
    assert shared_ledger.caller.call(methods["Reserve"], reserve, charge).code is grpc.StatusCode.OK
    refund = pb.RefundRequest(lane=OTHER_LANE, reservation_id="e2e-1", http_status=429)
    assert shared_ledger.caller.call(methods["Refund"], refund, charge).code is grpc.StatusCode.OK
    assert shared_ledger.event_count() == before + 2
    # The same grant reads the balance it just changed, and the booking: a
    # lane needs them to choose its fallback.
    balance = pb.GetBalanceRequest(lane=OTHER_LANE)
    assert (
        shared_ledger.caller.call(methods["GetBalance"], balance, charge).code is grpc.StatusCode.OK
    )
    booking = pb.GetBookingRequest(lane=OTHER_LANE, reservation_id="e2e-1")
    assert (
        shared_ledger.caller.call(methods["GetBooking"], booking, charge).code is grpc.StatusCode.OK
    )
    # But only on its own lanes, and nothing else a reader may see.
    home = pb.GetBalanceRequest(lane=HOME_LANE)
    outcome = shared_ledger.caller.call(methods["GetBalance"], home, charge)
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED
    assert outcome.details == (
        f"GetBalance on lane '{HOME_LANE}' needs the charge or read scope there; "
        f"this grant has charge on {OTHER_LANE}"
    )
    for name, request in (
        ("GetAudit", pb.GetAuditRequest(lane=OTHER_LANE)),
        ("ListEvents", pb.ListEventsRequest(lane=OTHER_LANE)),
    ):
        outcome = shared_ledger.caller.call(methods[name], request, charge)
        assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, name
        assert "needs the read scope" in outcome.details


def test_unauthenticated_requests_are_not_even_decoded(shared_ledger: SecureLedger) -> None:
    reserve = next(m for m in all_methods() if m.name == "Reserve")
    garbage = b"\xff\xff\xff\xff\x0f"
    assert shared_ledger.caller.call(reserve, garbage).code is grpc.StatusCode.UNAUTHENTICATED
    outcome = shared_ledger.caller.call(reserve, garbage, shared_ledger.admin)
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.details == "the request is not a valid message for this method"
    assert outcome.trailing.get("ledger-reason") == "UNDECODABLE_REQUEST"


def test_health_and_reflection_need_no_grant(shared_ledger: SecureLedger) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = shared_ledger.caller.channel
    health = health_pb2_grpc.HealthStub(channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(reflection.ServerReflectionInfo(iter([request]), timeout=10))
    names = {service.name for service in response.list_services_response.service}
    assert "ledger.v1.Ledger" in names


def test_the_log_names_every_scope_that_would_have_let_a_refused_call_in(
    shared_ledger: SecureLedger, caplog: pytest.LogCaptureFixture
) -> None:
    """GetBalance takes charge or read: the operator's log said "lacks read"
    alone, and sent them to issue a scope the lane did not need."""
    [balance] = [method for method in all_methods() if method.name == "GetBalance"]
    grant = shared_ledger.forge.grant([OTHER_LANE], [Scope.CHARGE])
    # A fresh count: the matrix's refusals before this one may have used up this second's.
    shared_ledger.server._auth._refusals = RefusalLog()
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        outcome = shared_ledger.caller.call(balance, request_for(balance), bearer(grant))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
    assert any("lacks charge or read" in record.getMessage() for record in caplog.records), [
        record.getMessage() for record in caplog.records
    ]


def test_a_grant_of_a_key_this_server_lacks_is_logged_naming_the_key_and_the_fix(
    shared_ledger: SecureLedger, caplog: pytest.LogCaptureFixture
) -> None:
    """A key rotated on one replica and not yet copied to another: the other
    logged only "unknown key id grant", naming neither the key nor what to do."""
    [reserve] = [method for method in all_methods() if method.name == "Reserve"]
    grant = shared_ledger.forge.with_key_id(_charge_read(shared_ledger.forge), "k0badc0de")
    shared_ledger.server._auth._refusals = RefusalLog()
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        outcome = shared_ledger.caller.call(reserve, request_for(reserve), bearer(grant))
    assert outcome.code is grpc.StatusCode.UNAUTHENTICATED, outcome
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert "key k0badc0de" in line, line
    assert "copy that replica's grant-keys.json" in line, line


def test_refusals_through_the_server_are_logged_within_the_bound(
    shared_ledger: SecureLedger, caplog: pytest.LogCaptureFixture
) -> None:
    [balance] = [method for method in all_methods() if method.name == "GetBalance"]
    grant = shared_ledger.forge.grant([OTHER_LANE], [Scope.CHARGE])
    shared_ledger.server._auth._refusals = RefusalLog(per_second=2, monotonic=lambda: 0.0)
    try:
        with caplog.at_level("INFO", logger="ledger_service.api.auth"):
            for _ in range(5):
                outcome = shared_ledger.caller.call(balance, request_for(balance), bearer(grant))
                assert outcome.code is grpc.StatusCode.PERMISSION_DENIED, outcome
        refused = [r for r in caplog.records if r.getMessage().startswith("refused ")]
        assert len(refused) == 2, [record.getMessage() for record in caplog.records]
    finally:
        shared_ledger.server._auth._refusals = RefusalLog()
