"""A refused server setting names where its value came from: the flag when it
was given on the command line, the variable when it came from the environment.
`ledger serve` said `--tls-key /x: No such file` for a LEDGER_TLS_KEY, and
`max_workers (LEDGER_MAX_WORKERS)` for a `--max-workers`."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from ledger_service import cli, server
from ledger_service.cli import operate
from ledger_service.domain.clock import SystemClock
from ledger_service.settings import SERVE_FLAGS, Settings, setting_variable

# The numbers `ledger serve` takes as a flag too: -1 is refused for each.
FLAGGED_NUMBERS = [
    name for name in SERVE_FLAGS if type(getattr(Settings, name, None)) in (int, float)
]


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pytest.MonkeyPatch:
    for name in SERVE_FLAGS:
        monkeypatch.delenv(setting_variable(name), raising=False)
    monkeypatch.setenv("LEDGER_DATA_DIR", str(tmp_path))
    return monkeypatch


def test_every_serve_flag_of_a_setting_is_in_the_source_table() -> None:
    serve = cli.parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {
        action.dest: action.option_strings[0]
        for action in serve._actions
        if isinstance(action, argparse._StoreAction) and hasattr(Settings, action.dest)
    }
    flags["data_dir"] = "--data-dir"  # a Settings field without a class default
    flags["database_url"] = "--database-url"
    assert flags == dict(SERVE_FLAGS)
    assert set(FLAGGED_NUMBERS) >= {"max_workers", "sweep_interval_seconds"}


@pytest.mark.parametrize("name", FLAGGED_NUMBERS)
def test_a_refused_number_names_its_variable_or_its_flag(
    environment: pytest.MonkeyPatch, name: str
) -> None:
    variable, flag = setting_variable(name), SERVE_FLAGS[name]
    environment.setenv(variable, "-1")
    with pytest.raises(ValueError) as refused:
        Settings.from_environment()
    assert f"{name} ({variable})" in str(refused.value) and flag not in str(refused.value)
    environment.delenv(variable)
    with pytest.raises(ValueError) as refused:
        Settings.from_environment(**{name: -1})
    assert f"{name} ({flag})" in str(refused.value) and variable not in str(refused.value)


def test_a_listen_address_names_its_variable_or_its_flag(environment: pytest.MonkeyPatch) -> None:
    environment.setenv("LEDGER_LISTEN", "127.0.0.1:99999")
    with pytest.raises(ValueError, match=r"^listen \(LEDGER_LISTEN\): "):
        Settings.from_environment()
    with pytest.raises(ValueError, match=r"^listen \(--listen\): "):
        Settings.from_environment(listen="127.0.0.1:99999")


def test_a_tls_file_from_the_environment_is_named_by_its_variable(
    environment: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    missing = tmp_path / "nope.pem"
    environment.setenv("LEDGER_TLS_CERT", str(missing))
    environment.setenv("LEDGER_TLS_KEY", str(missing))
    with pytest.raises(ValueError, match=r"^LEDGER_TLS_KEY .*nope\.pem: No such file"):
        server.server_tls(Settings.from_environment(), SystemClock())
    flagged = Settings.from_environment(tls_key_path=missing)
    with pytest.raises(ValueError, match=r"^--tls-key .*nope\.pem: No such file"):
        server.server_tls(flagged, SystemClock())


@pytest.mark.parametrize(
    ("variable", "given", "missing"),
    [
        ("LEDGER_TLS_CERT", "LEDGER_TLS_CERT", "--tls-key or LEDGER_TLS_KEY"),
        ("LEDGER_TLS_KEY", "LEDGER_TLS_KEY", "--tls-cert or LEDGER_TLS_CERT"),
        (
            "LEDGER_TLS_CLIENT_CA",
            "LEDGER_TLS_CLIENT_CA",
            "(--tls-cert or LEDGER_TLS_CERT, --tls-key or LEDGER_TLS_KEY)",
        ),
    ],
)
def test_half_a_tls_configuration_from_the_environment_names_its_variable(
    environment: pytest.MonkeyPatch, tmp_path: pathlib.Path, variable: str, given: str,
    missing: str,
) -> None:  # fmt: skip
    environment.setenv(variable, str(tmp_path / "file.pem"))
    with pytest.raises(ValueError) as refused:
        server.server_tls(Settings.from_environment(), SystemClock())
    said = str(refused.value)
    assert said.startswith(f"{given} ") and missing in said, said


def test_a_flag_given_over_its_variable_is_named_as_the_flag(
    environment: pytest.MonkeyPatch,
) -> None:
    environment.setenv("LEDGER_MAX_WORKERS", "4")
    with pytest.raises(ValueError, match=r"^max_workers \(--max-workers\) must be above 0"):
        Settings.from_environment(max_workers=0)


def test_a_grants_share_of_the_pool_is_a_serve_flag(
    environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The share was only LEDGER_MAX_CONNECTIONS_PER_GRANT; `ledger serve`
    takes it as a flag, over the variable, and a refusal names the flag."""
    environment.setenv("LEDGER_MAX_CONNECTIONS_PER_GRANT", "4")
    postgresql = ["--database-url", "postgresql+psycopg://ledger@db/ledger"]
    parsed = cli.parser().parse_args(["serve", *postgresql, "--max-connections-per-grant", "8"])
    assert operate.settings_from(parsed).max_connections_per_grant == 8
    parsed = cli.parser().parse_args(["serve", *postgresql, "--max-connections-per-grant", "20"])
    with pytest.raises(SystemExit):
        operate.settings_from(parsed)
    said = capsys.readouterr().err
    assert "max_connections_per_grant (--max-connections-per-grant), 20" in said, said
