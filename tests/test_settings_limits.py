"""A number no server could run with is refused at start, naming the setting:
`ledger serve --max-workers=-1` once started and served (docs: a refused
configuration exits 2)."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import subprocess
import sys

import pytest

from ledger_service.settings import Settings, grpc_server_options
from tests import serving

URL = "sqlite:///unused.db"


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("max_workers", 0, "above 0"),
        ("max_workers", -1, "above 0"),
        ("sweep_interval_seconds", 0.0, "above 0"),
        ("sweep_interval_seconds", -1.0, "above 0"),
        ("snapshot_every_events", -5, "not be negative"),
        ("grace_period_seconds", -0.5, "not be negative"),
        ("request_deadline_seconds", math.nan, "finite"),
        ("pool_size", math.inf, "finite"),
        ("recovery_max_risk", 2.0, "at most 1"),
        ("client_ping_min_interval_seconds", 0.5, "at least 1"),
        # The lane clients ping every 5 s: above it each idle one was sent GOAWAY.
        ("client_ping_min_interval_seconds", 10.0, "at most 5"),
        ("max_page_size", True, "a number"),
    ],
)
def test_a_number_no_server_could_run_with_is_refused_by_name(
    setting: str, value: object, said: str
) -> None:
    with pytest.raises(ValueError, match=setting) as refused:
        Settings(database_url=URL, **{setting: value})  # type: ignore[arg-type]
    assert said in str(refused.value)


def test_the_header_limit_leaves_room_for_a_grant() -> None:
    assert Settings(database_url=URL, max_metadata_bytes=8192).max_metadata_bytes == 8192
    with pytest.raises(ValueError, match=r"max_metadata_bytes .* at least 8192"):
        Settings(database_url=URL, max_metadata_bytes=8191)


def test_zero_where_zero_means_none_or_never_is_taken() -> None:
    settings = Settings(
        database_url=URL,
        snapshot_every_events=0,
        consistency_check_interval_seconds=0.0,
        recovery_budget_seconds=0.0,
        recovery_check_processes=0,
        grace_period_seconds=0.0,
        max_transaction_retries=0,
    )
    assert settings.snapshot_every_events == 0


@pytest.mark.slow  # starts a server or spawns a process
def test_serve_refuses_a_negative_worker_count_in_one_line(tmp_path: pathlib.Path) -> None:
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path),
         "--max-workers=-1"],
        cwd=tmp_path, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "max_workers" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1", "127.0.0.1:x"])
def test_a_listen_address_without_a_port_gRPC_can_bind_is_refused(listen: str) -> None:
    """grpcio took '127.0.0.1:99999' and listened on a random port, unsaid."""
    with pytest.raises(ValueError, match=r"^listen \(--listen\): ") as refused:
        Settings(database_url=URL, listen=listen)
    assert "0 to 65535" in str(refused.value)


@pytest.mark.slow  # starts a server or spawns a process
def test_serve_refuses_a_port_past_65535_in_one_line(tmp_path: pathlib.Path) -> None:
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), "serve", "--listen", "127.0.0.1:99999", "--data-dir", str(tmp_path)],
        cwd=tmp_path, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "99999" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        # gRPC's channel options are C ints: 2 GiB was an OverflowError traceback.
        ("max_message_bytes", 2**31),
        # PostgreSQL's statement_timeout is an int of milliseconds.
        ("statement_timeout_ms", 2**31),
        ("sweep_batch_size", 10**20),
        # Waits past what a thread can wait killed the health and feed threads.
        ("health_check_interval_seconds", 1e300),
        ("watch_poll_interval_seconds", 1e300),
        ("grace_period_seconds", 316_224_000.5),
        # A grant lives at most 3,660 days (docs/security.md), the admin grant too.
        ("admin_grant_lifetime_seconds", 316_224_001),
    ],
)
def test_a_number_too_large_for_any_server_is_refused_by_name(setting: str, value: object) -> None:
    with pytest.raises(ValueError, match=setting) as refused:
        Settings(database_url=URL, **{setting: value})  # type: ignore[arg-type]
    assert "at most" in str(refused.value)


def test_every_number_at_its_largest_is_taken() -> None:
    """Every count at 2^31 - 1 and every number of seconds at 3,660 days."""
    largest: dict[str, object] = {}
    for field in dataclasses.fields(Settings):
        if field.name.endswith("_seconds"):
            largest[field.name] = 316_224_000 if type(field.default) is int else 316_224_000.0
        elif type(field.default) is int:
            largest[field.name] = 2**31 - 1
    largest["recovery_max_risk"] = 1.0
    largest["max_watchers"] = 2**31 - 2  # below max_calls_per_connection, as it must be
    largest["client_ping_min_interval_seconds"] = 5.0  # the lane clients' interval
    settings = Settings(database_url=URL, **largest)  # type: ignore[arg-type]
    assert settings.max_message_bytes == 2**31 - 1


@pytest.mark.slow  # starts a server or spawns a process
def test_serve_refuses_a_message_limit_gRPC_cannot_take_in_one_line(
    tmp_path: pathlib.Path,
) -> None:
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)],
        cwd=tmp_path, env=serving.clean_env(LEDGER_MAX_MESSAGE_BYTES=str(2**31)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "LEDGER_MAX_MESSAGE_BYTES" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("variable", "raw", "said"),
    [
        ("LEDGER_MAX_WORKERS", "4.5", "LEDGER_MAX_WORKERS must be a whole number, not '4.5'"),
        ("LEDGER_GRACE_PERIOD_SECONDS", "soon", "LEDGER_GRACE_PERIOD_SECONDS must be a number, "
         "not 'soon'"),
    ],
)  # fmt: skip
def test_a_variable_that_is_no_number_is_named_with_its_value(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, said: str
) -> None:
    """It said "must be a int", and not what it had been given."""
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError) as refused:
        Settings.from_environment()
    assert str(refused.value) == said


def test_the_server_takes_the_lane_clients_pings_and_bounds_faster_ones() -> None:
    """Both lane clients ping every 5 s to find a frozen replica; the server's
    default floor must lie below that (with margin), or an idle lane's
    connection is ended with GOAWAY too_many_pings (measured at 20 s: after
    15 s idle), and its pings slowed. A faster peer is cut off at its third
    early ping."""
    from ledger_client.channels import KEEPALIVE_INTERVAL_MS

    node = (pathlib.Path(__file__).parents[1] / "clients/node/lib/client.js").read_text()
    assert f"'grpc.keepalive_time_ms': {KEEPALIVE_INTERVAL_MS}," in node
    options = dict(grpc_server_options(Settings(database_url=URL)))
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 0.8 * KEEPALIVE_INTERVAL_MS
    assert options["grpc.http2.min_ping_interval_without_data_ms"] >= 1000
    assert options["grpc.http2.max_ping_strikes"] == 2
    assert options["grpc.keepalive_permit_without_calls"] == 1


@pytest.mark.slow  # starts a server or spawns a process
def test_every_number_at_its_largest_makes_a_grpc_server() -> None:
    """keepalive_seconds may be 3,660 days, but gRPC takes milliseconds as a C
    int: LEDGER_KEEPALIVE_SECONDS=3000000 made `ledger serve` die with an
    OverflowError traceback. Past 2^31 - 1 ms (24.8 days) is taken as that."""
    from concurrent import futures

    import grpc

    largest = {
        "keepalive_seconds": 316_224_000.0,
    }
    options = grpc_server_options(Settings(database_url=URL, **largest))  # type: ignore[arg-type]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=options)
    server.stop(None)
    assert dict(options)["grpc.keepalive_time_ms"] == 2**31 - 1


@pytest.mark.parametrize("listen", ["[::1:50051", "::1]:50051", "::1:50051", "127.0.0.1 :50051"])
def test_a_malformed_listen_host_is_a_bad_value_not_a_taken_port(listen: str) -> None:
    """It reached grpcio, and `ledger serve` said 'cannot listen ... the port is
    taken', exit 1."""
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        Settings(database_url=URL, listen=listen)


@pytest.mark.parametrize("listen", ["[::1]:0", "127.0.0.1:0", "localhost:50051", "0.0.0.0:1"])
def test_a_well_formed_listen_address_is_taken(listen: str) -> None:
    assert Settings(database_url=URL, listen=listen).listen == listen


@pytest.mark.parametrize("larger", ["max_calls_per_connection", "max_concurrent_rpcs"])
@pytest.mark.parametrize(("value", "watchers"), [(64, 64), (16, 64), (2, 64)])
def test_a_limit_that_hides_the_stream_limit_is_refused_naming_both(
    larger: str, value: int, watchers: int
) -> None:
    """A stream past max_calls_per_connection is refused by gRPC (REFUSED_STREAM), and one
    past max_concurrent_rpcs gets gRPC's own RESOURCE_EXHAUSTED: at or below
    max_watchers, a stream past the documented limit never got TOO_MANY_WATCHERS."""
    with pytest.raises(ValueError) as refused:
        Settings(database_url=URL, max_watchers=watchers, **{larger: value})
    said = str(refused.value)
    assert larger in said and "max_watchers" in said, said
    assert "TOO_MANY_WATCHERS" in said, said
    taken = Settings(database_url=URL, max_watchers=watchers, **{larger: watchers + 1})
    assert getattr(taken, larger) == watchers + 1


@pytest.mark.parametrize(("share", "pool_size", "overflow"), [(20, 16, 4), (16, 8, 4), (3, 2, 0)])
def test_a_grants_share_of_the_whole_pool_is_refused_on_postgresql(
    share: int, pool_size: int, overflow: int
) -> None:
    """A share at or above the pool's connections leaves the other lanes none
    while one grant's calls wait on a slow lane; SQLite has no such share."""
    limits = {
        "max_connections_per_grant": share,
        "pool_size": pool_size,
        "pool_max_overflow": overflow,
    }
    with pytest.raises(ValueError) as refused:
        Settings(database_url="postgresql+psycopg://ledger@db/ledger", **limits)
    said = str(refused.value)
    assert all(name in said for name in limits), said
    assert Settings(database_url=URL, **limits).max_connections_per_grant == share
    taken = Settings(
        database_url="postgresql+psycopg://ledger@db/ledger", **{**limits, "pool_size": share + 1}
    )
    assert taken.max_connections_per_grant == share


def test_more_workers_than_the_pool_has_connections_is_served_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/postgresql.md: workers past the pool wait for a connection; the
    server says so at start and serves on (a warning, not a refusal)."""
    from ledger_service.server import build_store

    url = "postgresql+psycopg://ledger@127.0.0.1:9/ledger"
    for workers, warned in ((20, False), (21, True)):
        caplog.clear()
        store = build_store(Settings(database_url=url, max_workers=workers))
        store.close(timeout_seconds=1)
        said = [r.getMessage() for r in caplog.records if "max_workers" in r.getMessage()]
        assert bool(said) is warned, said
        assert not said or ("(21)" in said[0] and "(20)" in said[0]), said
