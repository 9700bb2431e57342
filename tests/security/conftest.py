"""Fixtures for the break-in tests: real servers in process, real grants, forged ones.

Every server here runs with auth ON (the default), the test clock, SQLite in its
own temporary directory, and listens on 127.0.0.1:0. `forge` makes every kind of
bad credential the tests try; `Caller` sends any method of the ledger's services
by its full name, so the matrix can cover methods added to the proto later.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, duration_pb2, message_factory, timestamp_pb2
from google.protobuf.message import Message

from ledger_service.domain.clock import MICROS_PER_SECOND, SystemClock
from ledger_service.domain.grants import Keyring, Scope, new_key, new_key_id
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.security.certificates import Pki, issue, make_ca

RPC_TIMEOUT_SECONDS = 10.0
HOUR_US = 3600 * MICROS_PER_SECOND
# Lanes every security server has; the fuzzer never generates these names.
HOME_LANE = "recall"
OTHER_LANE = "filter"
JEV_PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)
SERVICES = ("Ledger", "LaneAdmin", "TestClock")


def security_settings(data_dir: pathlib.Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{data_dir}/ledger.db",
        "data_dir": data_dir,
        "listen": "127.0.0.1:0",
        "test_clock": True,
    }
    values.update(overrides)
    return Settings(**values)


@dataclasses.dataclass(frozen=True)
class Method:
    service: str
    name: str
    path: str
    streaming: bool
    request_class: type[Message]
    response_class: type[Message]


def all_methods() -> list[Method]:
    """Every method of Ledger, LaneAdmin and TestClock, read from the proto."""
    found = []
    for service_name in SERVICES:
        service: descriptor.ServiceDescriptor = pb.DESCRIPTOR.services_by_name[service_name]
        for method in service.methods:
            found.append(
                Method(
                    service=service_name,
                    name=method.name,
                    path=f"/{service.full_name}/{method.name}",
                    streaming=method.server_streaming,
                    request_class=message_factory.GetMessageClass(method.input_type),
                    response_class=message_factory.GetMessageClass(method.output_type),
                )
            )
    return found


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    trailing: dict[str, str | bytes]


class Caller:
    """Calls any method by path, with any request (a message or raw bytes) and metadata."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel

    def call(
        self,
        method: Method,
        request: Message | bytes,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        *,
        timeout: float = RPC_TIMEOUT_SECONDS,
    ) -> Outcome:
        serialize: Callable[[Any], bytes] = (
            (lambda raw: raw) if isinstance(request, bytes) else type(request).SerializeToString
        )
        deserialize = method.response_class.FromString
        try:
            if method.streaming:
                stream = self.channel.unary_stream(
                    method.path, request_serializer=serialize, response_deserializer=deserialize
                )(request, metadata=tuple(metadata), timeout=timeout)
                # One message is enough to know the call was accepted.
                next(iter(stream), None)
                stream.cancel()  # type: ignore[no-untyped-call]
                return Outcome(grpc.StatusCode.OK, "", {})
            self.channel.unary_unary(
                method.path, request_serializer=serialize, response_deserializer=deserialize
            )(request, metadata=tuple(metadata), timeout=timeout)
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            return Outcome(
                error.code(),
                error.details() or "",
                {item.key: item.value for item in error.trailing_metadata() or ()},
            )
        return Outcome(grpc.StatusCode.OK, "", {})


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@dataclasses.dataclass
class Forge:
    """Issues real grants with a server's keyring, and every kind of bad one."""

    keyring: Keyring

    def grant(
        self,
        lanes: Sequence[str],
        scopes: Sequence[Scope],
        *,
        lifetime_us: int = HOUR_US,
        issued_ago_us: int = 0,
        keyring: Keyring | None = None,
    ) -> str:
        now_us = SystemClock().now_us()
        return (keyring or self.keyring).issue(
            lanes,
            scopes,
            issued_at_us=now_us - issued_ago_us,
            expires_at_us=now_us - issued_ago_us + lifetime_us,
        )

    def expired(self, lanes: Sequence[str], scopes: Sequence[Scope]) -> str:
        return self.grant(lanes, scopes, lifetime_us=HOUR_US, issued_ago_us=2 * HOUR_US)

    def other_server_same_key_id(self, lanes: Sequence[str], scopes: Sequence[Scope]) -> str:
        """Signed by another server whose key happens to have this server's key id."""
        key_id = self.keyring.signing_key_id
        return self.grant(lanes, scopes, keyring=Keyring({key_id: new_key()}, key_id))

    def other_server(self, lanes: Sequence[str], scopes: Sequence[Scope]) -> str:
        key_id = new_key_id()
        return self.grant(lanes, scopes, keyring=Keyring({key_id: new_key()}, key_id))

    @staticmethod
    def tampered(token: str, **claims: Any) -> str:
        """The token with its claims changed and its signature kept."""
        prefix, key_id, payload, signature = token.split(".")
        decoded = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        decoded.update(claims)
        text = json.dumps(decoded, sort_keys=True, separators=(",", ":")).encode()
        changed = base64.urlsafe_b64encode(text).rstrip(b"=").decode()
        return ".".join((prefix, key_id, changed, signature))

    @staticmethod
    def with_key_id(token: str, key_id: str) -> str:
        prefix, _key_id, payload, signature = token.split(".")
        return ".".join((prefix, key_id, payload, signature))


def request_for(method: Method, lane: str = HOME_LANE) -> Message:
    """A plausible request naming `lane` (what the grant is checked against)."""
    if method.name == "Reserve":
        return pb.ReserveRequest(
            lane=lane, reservation_id="matrix-1", model="jev", request_bytes=1000,
            max_output_tokens=10,
        )  # fmt: skip
    if method.name == "Settle":
        return pb.SettleRequest(lane=lane, reservation_id="matrix-1", outcome=pb.UNKNOWN)
    if method.name == "Refund":
        return pb.RefundRequest(lane=lane, reservation_id="matrix-1", http_status=403)
    if method.name == "PutLane":
        return pb.PutLaneRequest(
            lane=pb.Lane(lane=lane, limit_nanos=500_000_000, prices={"jev": pb.ModelPrice()})
        )
    if method.name == "Reconcile":
        # A dry run of a one-row usage export: even when let in, it changes nothing.
        return method.request_class(
            format=1, content=b"reservation_id,billed_nanos\nmatrix-1,5\n", default_lane=lane,
            dry_run=True,
        )  # fmt: skip
    if method.name == "Correct":
        return pb.CorrectRequest(
            lane=lane, reservation_id="matrix-1", charge_nanos=0, reason="a test",
            correction_id="matrix-c1",
        )  # fmt: skip
    if method.name == "SetTime":
        return timestamp_pb2.Timestamp(seconds=1_900_000_000)
    if method.name == "Advance":
        return duration_pb2.Duration(seconds=0)
    request = method.request_class()
    fields = request.DESCRIPTOR.fields_by_name
    for name, value in (("lane", lane), ("reservation_id", "matrix-1"), ("default_lane", lane)):
        if name in fields and fields[name].type == fields[name].TYPE_STRING:
            setattr(request, name, value)
    return request


def put_lane(caller: Caller, admin_grant: str, lane: str) -> None:
    put = next(m for m in all_methods() if m.name == "PutLane")
    request = pb.PutLaneRequest(
        lane=pb.Lane(lane=lane, limit_nanos=500_000_000, prices={"jev": JEV_PRICE})
    )
    outcome = caller.call(put, request, bearer(admin_grant))
    assert outcome.code is grpc.StatusCode.OK, outcome


@dataclasses.dataclass
class SecureLedger:
    server: LedgerServer
    caller: Caller
    forge: Forge
    data_dir: pathlib.Path

    @property
    def admin(self) -> tuple[tuple[str, str], ...]:
        return bearer(self.server.admin_grant)

    def event_count(self) -> int:
        return self.server.ledger.last_seq()


@pytest.fixture
def start_secure_ledger(
    tmp_path: pathlib.Path,
) -> Iterator[Callable[..., SecureLedger]]:
    """A factory of started servers (auth on), each in its own directory; stopped at teardown."""
    started: list[tuple[LedgerServer, grpc.Channel]] = []

    def start(data_dir: pathlib.Path | None = None, **overrides: Any) -> SecureLedger:
        directory = data_dir or tmp_path / f"server-{len(started)}"
        server = LedgerServer(security_settings(directory, **overrides))
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        started.append((server, channel))
        ledger = SecureLedger(server, Caller(channel), Forge(server.keyring), directory)
        put_lane(ledger.caller, server.admin_grant, HOME_LANE)
        put_lane(ledger.caller, server.admin_grant, OTHER_LANE)
        return ledger

    yield start
    for server, channel in reversed(started):
        channel.close()
        server.stop(0)


@pytest.fixture(scope="module")
def shared_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureLedger]:
    """One server for a whole module of read-mostly tests."""
    directory = tmp_path_factory.mktemp("shared-ledger")
    server = LedgerServer(security_settings(directory))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    ledger = SecureLedger(server, Caller(channel), Forge(server.keyring), directory)
    put_lane(ledger.caller, server.admin_grant, HOME_LANE)
    put_lane(ledger.caller, server.admin_grant, OTHER_LANE)
    try:
        yield ledger
    finally:
        channel.close()
        server.stop(0)


# TLS: servers on the certificates of tests/security/certificates.py.
CONNECT_TIMEOUT_SECONDS = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = make_ca("ledger test CA")
    rogue_ca = make_ca("rogue CA")
    return Pki(
        directory=tmp_path_factory.mktemp("pki"),
        ca=ca,
        server=issue(ca, "localhost", server=True),
        client=issue(ca, "lane recall", server=False),
        rogue_client=issue(rogue_ca, "lane recall", server=False),
    )


@pytest.fixture
def start_tls_server(tmp_path: pathlib.Path) -> Iterator[Callable[..., LedgerServer]]:
    started: list[LedgerServer] = []

    def start(**overrides: object) -> LedgerServer:
        server = LedgerServer(security_settings(tmp_path / f"s{len(started)}", **overrides))
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop(0)


def balance(channel: grpc.Channel, server: LedgerServer) -> grpc.StatusCode:
    """Puts the home lane and reads its balance; the status of the first failing call."""
    try:
        admin = pb_grpc.LaneAdminStub(channel)
        lane = pb.Lane(lane=HOME_LANE, limit_nanos=1000, prices={"jev": pb.ModelPrice()})
        admin.PutLane(
            pb.PutLaneRequest(lane=lane),
            metadata=bearer(server.admin_grant),
            timeout=CONNECT_TIMEOUT_SECONDS,
        )
        pb_grpc.LedgerStub(channel).GetBalance(
            pb.GetBalanceRequest(lane=HOME_LANE),
            metadata=bearer(server.admin_grant),
            timeout=CONNECT_TIMEOUT_SECONDS,
        )
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return error.code()
    finally:
        channel.close()
    return grpc.StatusCode.OK
