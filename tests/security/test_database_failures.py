"""A database that fails, with SQL, a URL with a password and a path in its error.

Whatever the failure, the caller gets UNAVAILABLE (the store knew it was the
database) or INTERNAL (anything else) with a constant message, and the server
log holds the details under the opaque id the caller was given.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from tests.security.conftest import SecureLedger, all_methods, request_for

SECRET_URL = "postgresql+psycopg://ledger:hunter2@db.internal:5432/ledger"
SECRET_PATH = "/srv/ledger/data/ledger.db"
SQL = "INSERT INTO events (seq, lane, kind) VALUES (?, ?, ?) RETURNING seq"
SECRETS = (
    "hunter2",
    "db.internal",
    "/srv/",
    "INSERT",
    "RETURNING",
    "sqlite3",
    "psycopg",
    "Traceback",
)
UNAVAILABLE_MESSAGE = "the ledger's database is unavailable; retry later"
INTERNAL_MESSAGE = re.compile(r"^internal error \(id [0-9a-f]{16}\)$")
STORE_METHODS = [method for method in all_methods() if method.service != "TestClock"]


def operational_error() -> OperationalError:
    original = sqlite3.OperationalError(
        f"unable to open database file {SECRET_PATH} ({SECRET_URL})"
    )
    return OperationalError(SQL, ("recall", "reserved", 1), original)


# Raised where the store turns database errors into StoreUnavailable.
INSIDE_THE_STORE: dict[str, Callable[[], Exception]] = {
    "operational error": operational_error,
    "pool timeout": lambda: PoolTimeoutError(f"QueuePool limit reached for {SECRET_URL}"),
}
# Raised past the store, as a bug in it would: only the error table stands between.
PAST_THE_STORE: dict[str, Callable[[], Exception]] = {
    "raw operational error": operational_error,
    "integrity error": lambda: IntegrityError(SQL, None, sqlite3.IntegrityError("UNIQUE failed")),
    "runtime error": lambda: RuntimeError(f"cannot reach {SECRET_URL} from {SECRET_PATH}"),
    "key error": lambda: KeyError(SECRET_URL),
}


def _raiser(make: Callable[[], Exception]) -> Callable[..., Any]:
    def fail(*_arguments: Any, **_keywords: Any) -> Any:
        raise make()

    return fail


def _assert_leaks_nothing(ledger: SecureLedger, details: str, trailing: dict[str, Any]) -> None:
    texts = [details, *(str(value) for value in trailing.values())]
    for secret in SECRETS:
        assert not any(secret.lower() in text.lower() for text in texts), (secret, texts)
    assert not any(str(ledger.data_dir) in text for text in texts)


@pytest.mark.parametrize("method", STORE_METHODS, ids=lambda method: method.path)
@pytest.mark.parametrize("failure", sorted(INSIDE_THE_STORE))
def test_a_failing_database_is_unavailable_with_a_constant_message(
    shared_ledger: SecureLedger, monkeypatch: pytest.MonkeyPatch, method: Any, failure: str
) -> None:
    monkeypatch.setattr(shared_ledger.server.store, "_run_once", _raiser(INSIDE_THE_STORE[failure]))
    outcome = shared_ledger.caller.call(method, request_for(method), shared_ledger.admin)
    if outcome.code is grpc.StatusCode.UNIMPLEMENTED:
        pytest.skip(f"{method.name} is not implemented yet")
    assert outcome.code is grpc.StatusCode.UNAVAILABLE, outcome
    assert outcome.details == UNAVAILABLE_MESSAGE
    assert outcome.trailing.get("ledger-reason") == "STORE_UNAVAILABLE"
    _assert_leaks_nothing(shared_ledger, outcome.details, outcome.trailing)


@pytest.mark.parametrize("method", STORE_METHODS, ids=lambda method: method.path)
@pytest.mark.parametrize("failure", sorted(PAST_THE_STORE))
def test_an_unexpected_error_is_internal_with_an_opaque_id(
    shared_ledger: SecureLedger,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    method: Any,
    failure: str,
) -> None:
    monkeypatch.setattr(shared_ledger.server.store, "run", _raiser(PAST_THE_STORE[failure]))
    outcome = shared_ledger.caller.call(method, request_for(method), shared_ledger.admin)
    if outcome.code is grpc.StatusCode.UNIMPLEMENTED:
        pytest.skip(f"{method.name} is not implemented yet")
    assert outcome.code is grpc.StatusCode.INTERNAL, outcome
    assert INTERNAL_MESSAGE.match(outcome.details), outcome
    assert outcome.trailing.get("ledger-reason") == "INTERNAL"
    _assert_leaks_nothing(shared_ledger, outcome.details, outcome.trailing)
    # The operator finds the details under the id the caller was given.
    error_id = str(outcome.trailing["ledger-error-id"])
    assert error_id in outcome.details
    logged = [record for record in caplog.records if error_id in record.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_an_interceptor_that_fails_is_internal_not_unknown(
    shared_ledger: SecureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpcio answers UNKNOWN when choosing a handler raises; the error interceptor catches it."""
    from ledger_service.api import auth

    monkeypatch.setattr(auth, "bearer_token", _raiser(lambda: RuntimeError(SECRET_URL)))
    for method in all_methods():
        outcome = shared_ledger.caller.call(method, request_for(method), shared_ledger.admin)
        assert outcome.code is grpc.StatusCode.INTERNAL, (method.path, outcome)
        assert INTERNAL_MESSAGE.match(outcome.details), outcome
        _assert_leaks_nothing(shared_ledger, outcome.details, outcome.trailing)
