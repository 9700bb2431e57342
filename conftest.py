"""The test tiers. `make test-fast` runs the tests not marked `slow`: the domain
and unit tests, which start no server, open no database and spawn no process.
`make test` (and CI) runs every test.

A test is slow when it asks for a fixture that starts a server or opens a
database, lives in a module that starts servers or processes itself, or is
marked `slow` itself. A test left fast that spawns a process or starts a gRPC
server fails (`_fast_tests_stay_fast`), so the rules cannot fall behind.
"""

from __future__ import annotations

import pytest

# Fixtures (tests/**/conftest.py, clients/python/tests/conftest.py) that start a
# server, open a database or spawn a process, directly or through another.
SLOW_FIXTURES = frozenset(
    {
        "server",
        "server_with",
        "server_without_test_clock",
        "fresh_server",
        "traced_server",
        "ledger_server",
        "shared_ledger",
        "start_ledger_server",
        "start_secure_ledger",
        "open_ledger_channel",
        "harness_for",
        "channel",
        "ledger_stub",
        "admin_stub",
        "clock_stub",
        "make_lane",
        "ledger_harness",
        "database_url",
        "postgres_schema_url",
        "postgres_url",
        "history",
        "sqlite_history",
        "sqlite_template",
        "store",
        "ledger",
        "connect",
        "held",
        "replicas",
    }
)
# Modules that start servers, databases or processes without those fixtures.
SLOW_MODULES = (
    "tests/test_cli",
    "tests/test_docs_links.py",
    "tests/test_postgresql_misconfigured.py",
    "tests/test_readme.py",
    "tests/test_postgresql_doc.py",
    "tests/test_bench_",
    "tests/test_e2e_",
    "tests/test_state_machine.py",
    "tests/test_seed_incident.py",
    "tests/test_serve_operator_mistakes.py",
    "tests/test_append_only.py",
    "tests/test_node_package.py",
    "tests/test_api_overhead_",
    "tests/test_rebuild_speed_records.py",
    "tests/recovery/",
    "tests/storage/",
    "tests/security/",
    "tests/observability/",
    "clients/python/tests/test_client_e2e.py",
    "clients/python/tests/test_client_misconfigured.py",
    "clients/python/tests/test_client_readme.py",
    "clients/python/tests/test_client_replay.py",
    "clients/python/tests/test_client_allowance.py",
    "clients/python/tests/test_client_frozen_replica.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or path.startswith(SLOW_MODULES):
            item.add_marker(pytest.mark.slow)


class _NotInTheFastTier(Exception):
    """A test the tiers call fast started a process or a server."""


def _refuse(what: str) -> object:
    def refused(*args: object, **kwargs: object) -> object:
        raise _NotInTheFastTier(f"a fast test {what}: add it to conftest.py's slow rules")

    return refused


@pytest.fixture(autouse=True)
def _fast_tests_stay_fast(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holds the fast tier to its definition: a test not marked slow that
    spawns a process or starts a gRPC server fails, naming the rule to add."""
    if request.node.get_closest_marker("slow") is not None:
        return
    import subprocess

    import grpc

    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("spawned a process"))
    monkeypatch.setattr(grpc, "server", _refuse("started a gRPC server"))
