"""A SQLite URL in URI form (`sqlite:///file:PATH?mode=ro&uri=true`) is
refused when the settings are read, with the setting that gave it and the
form the ledger takes, rather than opening `file:PATH` as a relative path."""

from __future__ import annotations

import pathlib

import pytest

from ledger_service.settings import Settings

URI_FORMS = [
    "sqlite:///file:/tmp/x.db?mode=ro&uri=true",
    "sqlite:///file:/tmp/x.db?uri=true",
    "sqlite:///file:x.db",
    "sqlite:////tmp/x.db?uri=true",
    "sqlite:////tmp/x.db?mode=ro",
    "sqlite:///file::memory:?cache=shared&uri=true",
]


@pytest.mark.parametrize("url", URI_FORMS)
def test_a_uri_form_sqlite_url_in_the_environment_is_refused_naming_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEDGER_DATABASE_URL", url)
    with pytest.raises(ValueError) as refused:
        Settings.from_environment()
    message = str(refused.value)
    assert message.startswith("LEDGER_DATABASE_URL "), message
    assert "sqlite:////absolute/path/ledger.db" in message, message


@pytest.mark.parametrize("url", URI_FORMS)
def test_a_uri_form_sqlite_url_given_as_a_flag_is_refused_naming_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEDGER_DATABASE_URL", raising=False)
    with pytest.raises(ValueError) as refused:
        Settings.from_environment(database_url=url)
    assert str(refused.value).startswith("--database-url "), refused.value


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///data/ledger.db",
        "sqlite:////tmp/ledger.db",
        "postgresql+psycopg://user:secret@db:5432/ledger?sslmode=require",
    ],
)
def test_a_path_form_sqlite_url_and_a_postgresql_url_are_taken(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEDGER_DATABASE_URL", url)
    assert Settings.from_environment().database_url == url


def test_a_sqlite_path_under_home_is_expanded_as_a_shell_would(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """It made a directory named `~` in the working directory instead."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LEDGER_DATABASE_URL", "sqlite:///~/ledgers/ledger.db")
    assert Settings.from_environment().database_url == f"sqlite:///{tmp_path}/ledgers/ledger.db"
    monkeypatch.delenv("LEDGER_DATABASE_URL")
    flag = Settings.from_environment(database_url="sqlite:///~/x.db").database_url
    assert flag == f"sqlite:///{tmp_path}/x.db"


def test_a_sqlite_file_whose_name_starts_with_a_tilde_is_left_as_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`~backup.db` names no user's home, so a shell leaves it as it is: the
    expansion raised RuntimeError, a traceback at start, where the file in the
    working directory was opened before."""
    monkeypatch.setenv("LEDGER_DATABASE_URL", "sqlite:///~no-such-user-backup.db")
    assert Settings.from_environment().database_url == "sqlite:///~no-such-user-backup.db"
