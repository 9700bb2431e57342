"""Key files, the admin grant, rotation, `ledger grant`, and --insecure-no-auth."""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import stat
from collections.abc import Callable

import grpc
import pytest

from ledger_service import cli
from ledger_service.domain.grants import Scope, decode_unverified
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from ledger_service.settings import is_loopback
from ledger_service.storage import keyring
from tests.security.conftest import (
    HOME_LANE,
    SecureLedger,
    all_methods,
    bearer,
    security_settings,
)

GET_BALANCE = next(method for method in all_methods() if method.name == "GetBalance")
BALANCE = pb.GetBalanceRequest(lane=HOME_LANE)


def run_cli(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Runs a `ledger` command in process (without main's logging set-up)."""
    parsed = cli.parser().parse_args(arguments)
    code = parsed.run(parsed)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def mode_of(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_files_are_private_even_under_a_loose_umask(tmp_path: pathlib.Path) -> None:
    previous = os.umask(0)
    try:
        server = LedgerServer(security_settings(tmp_path))
        # admin.grant is written once the server listens (docs/security.md).
        server.start()
    finally:
        os.umask(previous)
    try:
        assert mode_of(tmp_path / "grant-keys.json") == 0o600
        assert mode_of(tmp_path / "admin.grant") == 0o600
        assert (tmp_path / "admin.grant").read_text().strip() == server.admin_grant
        grant = decode_unverified(server.admin_grant)
        assert grant.scopes == {Scope.ADMIN}
        assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"
    finally:
        server.stop(0)


def test_the_keyring_survives_a_restart_and_grants_stay_valid(
    start_secure_ledger: Callable[..., SecureLedger], tmp_path: pathlib.Path
) -> None:
    first = start_secure_ledger(tmp_path / "data")
    issued = first.forge.grant([HOME_LANE], [Scope.READ])
    first.server.stop(0)
    second = start_secure_ledger(tmp_path / "data")
    assert second.server.keyring == first.server.keyring
    outcome = second.caller.call(GET_BALANCE, BALANCE, bearer(issued))
    assert outcome.code is grpc.StatusCode.OK, outcome
    # The first server's admin grant is still good; the file holds the newest one.
    assert second.caller.call(GET_BALANCE, BALANCE, first.admin).code is grpc.StatusCode.OK
    assert (tmp_path / "data" / "admin.grant").read_text().strip() == second.server.admin_grant


def test_rotation_and_retirement(
    start_secure_ledger: Callable[..., SecureLedger],
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data_dir = tmp_path / "data"
    first = start_secure_ledger(data_dir)
    old_key_id = first.server.keyring.signing_key_id
    old_grant = first.forge.grant([HOME_LANE], [Scope.READ])
    first.server.stop(0)

    code, out, _ = run_cli(["grant", "rotate-key", "--data-dir", str(data_dir)], capsys)
    assert code == 0 and "now signs" in out and "restart" not in out
    second = start_secure_ledger(data_dir)
    new_key_id = second.server.keyring.signing_key_id
    assert new_key_id != old_key_id
    assert decode_unverified(second.server.admin_grant).key_id == new_key_id
    assert second.caller.call(GET_BALANCE, BALANCE, bearer(old_grant)).code is grpc.StatusCode.OK

    code, _, err = run_cli(["grant", "retire-key", new_key_id, "--data-dir", str(data_dir)], capsys)
    assert code == 2 and "rotate first" in err, "the signing key cannot be retired"
    code, _, _ = run_cli(["grant", "retire-key", old_key_id, "--data-dir", str(data_dir)], capsys)
    assert code == 0
    second.server.stop(0)
    third = start_secure_ledger(data_dir)
    outcome = third.caller.call(GET_BALANCE, BALANCE, bearer(old_grant))
    assert outcome.code is grpc.StatusCode.UNAUTHENTICATED
    assert third.caller.call(GET_BALANCE, BALANCE, second.admin).code is grpc.StatusCode.OK
    code, out, _ = run_cli(["grant", "keys", "--data-dir", str(data_dir)], capsys)
    assert out.split() == [new_key_id, "(signs)"]


def test_two_servers_starting_on_one_directory_agree_on_one_keyring(tmp_path: pathlib.Path) -> None:
    keyrings = [keyring.load_or_create(tmp_path) for _ in range(5)]
    assert all(found == keyrings[0] for found in keyrings)
    assert mode_of(tmp_path / "grant-keys.json") == 0o600


def test_an_existing_keyring_is_only_read(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = keyring.load_or_create(tmp_path)

    def no_writes(*_arguments: object, **_keywords: object) -> None:
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(keyring, "_write_private", no_writes)
    assert keyring.load_or_create(tmp_path) == created
    server = LedgerServer(security_settings(tmp_path))
    try:
        assert server.keyring == created, "no admin.grant file, but the server starts"
        assert server.admin_grant
    finally:
        server.stop(0)


def test_a_broken_keyring_file_is_refused_without_quoting_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "grant-keys.json"
    path.write_text(json.dumps({"version": 1, "signing_key_id": "k1", "keys": {"k1": "c2VjcmV0"}}))
    with pytest.raises(keyring.KeyringError) as caught:
        keyring.load(tmp_path)
    assert "c2VjcmV0" not in str(caught.value)


def test_a_shared_keyring_file_is_warned_about(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    keyring.load_or_create(tmp_path)
    (tmp_path / "grant-keys.json").chmod(0o644)
    with caplog.at_level(logging.WARNING):
        keyring.load(tmp_path)
    assert "chmod 600" in caplog.text


def test_ledger_grant_issue_and_inspect(
    start_secure_ledger: Callable[..., SecureLedger],
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data_dir = tmp_path / "data"
    ledger = start_secure_ledger(data_dir)
    issue = ["grant", "issue", "--lane", HOME_LANE, "--scope", "read", "--expires", "30d"]
    code, out, _ = run_cli([*issue, "--data-dir", str(data_dir)], capsys)
    assert code == 0
    token = out.strip()
    assert "\n" not in token, "issue prints exactly one grant"
    assert ledger.caller.call(GET_BALANCE, BALANCE, bearer(token)).code is grpc.StatusCode.OK

    code, out, _ = run_cli(["grant", "inspect", token, "--data-dir", str(data_dir)], capsys)
    assert code == 0
    assert f"lanes:      {HOME_LANE}" in out and "scopes:     read" in out
    assert "(in 29 d 23 h)" in out and "signature:  valid" in out
    assert decode_unverified(token).key_id in out

    tampered = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
    code, out, _ = run_cli(["grant", "inspect", tampered, "--data-dir", str(data_dir)], capsys)
    assert code == 1 and "NOT VALID" in out
    code, out, _ = run_cli(["grant", "inspect", token, "--data-dir", str(tmp_path)], capsys)
    assert code == 1 and "not checked" in out
    code, out, err = run_cli(["grant", "inspect", "garbage"], capsys)
    # It was on stdout with an empty stderr: errors go to stderr, as every command's do.
    assert (code, out, err) == (1, "", "ledger grant inspect: not a grant (malformed)\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Bearer {token}\n"))
    code, out, _ = run_cli(["grant", "inspect", "-", "--data-dir", str(data_dir)], capsys)
    assert code == 0 and "signature:  valid" in out


def test_inspect_says_which_keyring_it_checked_and_what_a_missing_key_means(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inspect asks only the keyring of --data-dir. A grant another replica's
    key signed was called "NOT VALID" there though that replica accepts it,
    and "valid" said nothing of whether the refusing server holds the key."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    keyring.load_or_create(ours)
    their_keys = keyring.load_or_create(theirs)
    issue = ["grant", "issue", "--lane", "recall", "--scope", "read", "--data-dir", str(ours)]
    token = run_cli(issue, capsys)[1].strip()
    key_id = decode_unverified(token).key_id

    code, out, _ = run_cli(["grant", "inspect", token, "--data-dir", str(theirs)], capsys)
    signature = out.splitlines()[-1]
    assert code == 1 and "NOT VALID" not in signature, signature
    assert f"not checked: key {key_id} is not in the keyring in {theirs}" in signature
    assert f"(it holds {their_keys.signing_key_id})" in signature, signature

    code, out, _ = run_cli(["grant", "inspect", token, "--data-dir", str(ours)], capsys)
    signature = out.splitlines()[-1]
    assert code == 0 and signature.startswith("signature:  valid"), signature
    assert f"only if its own keyring holds {key_id}" in signature, signature


@pytest.mark.parametrize(
    "arguments",
    [
        ["--lane", "recall", "--scope", "admin"],
        ["--lane", "recall", "--scope", "read", "--expires", "30y"],
        ["--lane", "recall", "--scope", "read", "--expires=-1d"],
        ["--lane", "recall", "--scope", "read", "--expires", "0d"],
        ["--lane", "recall", "--scope", "read", "--expires", "4000d"],
        ["--lane", "bad lane", "--scope", "read"],
    ],
)
def test_ledger_grant_issue_refuses_bad_values(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], arguments: list[str]
) -> None:
    keyring.load_or_create(tmp_path)
    code, out, err = run_cli(["grant", "issue", *arguments, "--data-dir", str(tmp_path)], capsys)
    assert code == 2 and out == "" and err.startswith("ledger grant: ")


def test_ledger_grant_issue_needs_a_keyring(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        ["grant", "issue", "--lane", "x", "--scope", "read", "--data-dir", str(tmp_path)], capsys
    )
    assert code == 2 and out == "" and "ledger serve" in err
    assert not (tmp_path / "grant-keys.json").exists()


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:0", True),
        ("127.5.6.7:50051", True),
        ("[::1]:50051", True),
        ("localhost:50051", True),
        ("LOCALHOST:1", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        ("10.0.0.1:50051", False),
        ("example.com:50051", False),
        ("localhost.example.com:1", False),
        ("unix:/tmp/ledger.sock", False),
    ],
)
def test_loopback_addresses(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback


def test_insecure_no_auth_is_refused_off_loopback(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="loopback"):
        LedgerServer(security_settings(tmp_path, auth_enabled=False, listen="0.0.0.0:0"))
    code, _, err = run_cli(
        ["serve", "--insecure-no-auth", "--listen", "0.0.0.0:0", "--data-dir", str(tmp_path)],
        capsys,
    )
    assert code == 2 and "loopback" in err


def test_insecure_no_auth_lets_anyone_in_and_says_so_at_every_start(
    start_secure_ledger: Callable[..., SecureLedger],
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ledger = start_secure_ledger(tmp_path / "data", auth_enabled=False)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        # The address bound, not the settings' port 0.
        reaches = f"anyone who reaches 127.0.0.1:{ledger.server.port} can spend"
        assert any(reaches in record.getMessage() for record in warnings), [
            record.getMessage() for record in warnings
        ]
        outcome = ledger.caller.call(GET_BALANCE, BALANCE)
        assert outcome.code is grpc.StatusCode.OK, outcome
        ledger.server.stop(0)


def test_plaintext_off_loopback_is_warned_about_at_every_start(
    start_secure_ledger: Callable[..., SecureLedger],
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Grants are bearer tokens: served in plaintext beyond loopback, anyone on
    the path can read one and spend its lanes' budgets until it expires."""
    for listen, warned in (("0.0.0.0:0", True), ("127.0.0.1:0", False), ("0.0.0.0:0", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ledger = start_secure_ledger(tmp_path / "data", listen=listen)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("PLAINTEXT" in message for message in warnings) is warned, warnings
        ledger.server.stop(0)


def test_auth_is_on_unless_asked_off() -> None:
    parsed = cli.parser().parse_args(["serve"])
    from ledger_service.cli.operate import settings_from

    assert settings_from(parsed).auth_enabled
    parsed = cli.parser().parse_args(["serve", "--insecure-no-auth"])
    assert not settings_from(parsed).auth_enabled


def test_a_keyring_unreadable_when_it_changed_is_read_again_once_readable(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `retire-key` run as another user leaves a file the server cannot read;
    fixing its owner or mode (no write) must still bring the retirement in."""
    watched = keyring.KeyringFile(tmp_path)
    rotated = keyring.rotate(tmp_path)
    real_load = keyring.load

    def unreadable(_data_dir: pathlib.Path) -> keyring.Keyring:
        raise keyring.KeyringError("cannot read the keyring: permission denied")

    monkeypatch.setattr(keyring, "load", unreadable)
    assert watched.changed() is None, "unreadable: the keys in force stay"
    monkeypatch.setattr(keyring, "load", real_load)
    (tmp_path / "grant-keys.json").chmod(0o600)  # what `chown` or `chmod` changes
    assert watched.changed() == rotated


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_keyring_rewritten_by_root_keeps_its_owner(tmp_path: pathlib.Path) -> None:
    keyring.load_or_create(tmp_path)
    path = tmp_path / "grant-keys.json"
    os.chown(path, 65534, 65534)  # the server's user, say nobody
    keyring.rotate(tmp_path)
    status = path.stat()
    assert (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (65534, 65534, 0o600)


def test_serve_with_a_broken_keyring_says_so_in_one_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "grant-keys.json").write_text("{")
    code, _, err = run_cli(
        ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)], capsys
    )
    assert code == 2 and err.startswith("ledger serve: "), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_new_data_directory_and_database_are_their_owners_alone(tmp_path: pathlib.Path) -> None:
    """Every lane's events are in the SQLite file: a grant guards them over the
    network only, so other local users must not read the file either."""
    data_dir = tmp_path / "fresh"
    server = LedgerServer(security_settings(data_dir))
    try:
        server.start()
    finally:
        server.stop(0)
    assert mode_of(data_dir) == 0o700
    for name in ("ledger.db", "ledger.db-wal", "grant-keys.json"):
        if (data_dir / name).exists():
            assert mode_of(data_dir / name) == 0o600, name
    assert (data_dir / "ledger.db").exists()


def test_a_keyring_deleted_under_a_running_server_is_said_once(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A keyring deleted while serving keeps its keys in force, but a restart
    would make a new one and refuse every grant: the log must say so then, not
    only when the operator restarts."""
    watched = keyring.KeyringFile(tmp_path)
    kept = watched.keyring
    path = tmp_path / "grant-keys.json"
    saved = path.read_bytes()
    path.unlink()
    with caplog.at_level(logging.ERROR, logger="ledger_service.storage.keyring"):
        assert watched.changed() is None, "the keys in force stay"
        assert watched.changed() is None
    lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "restore" in lines[0], lines[0]
    assert watched.keyring == kept
    path.write_bytes(saved)
    path.chmod(0o600)
    assert watched.changed() is None, "the same keys: nothing changed"
    assert watched.keyring == kept


def test_a_new_keyring_beside_a_ledger_that_has_events_is_warned_about(
    start_secure_ledger: Callable[..., SecureLedger],
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Restarted with another data directory (LEDGER_DATA_DIR changed, the
    database URL kept), the server makes a new keyring and every lane's grant
    is refused: the log must say why and what to do, not only that a keyring
    was made."""
    first = start_secure_ledger(tmp_path / "old")
    issued = first.forge.grant([HOME_LANE], [Scope.READ])
    first.server.stop(0)
    url = f"sqlite:///{tmp_path / 'old' / 'ledger.db'}"
    with caplog.at_level(logging.WARNING):
        server = LedgerServer(security_settings(tmp_path / "new", database_url=url))
    try:
        said = " ".join(record.getMessage() for record in caplog.records)
        assert "holds a ledger" in said and str(tmp_path / "new" / "grant-keys.json") in said, said
        assert "grant-keys.json" in said and "UNAUTHENTICATED" in said, said
        assert decode_unverified(issued).key_id not in server.keyring.keys
    finally:
        server.stop(0)

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fresh = LedgerServer(security_settings(tmp_path / "fresh"))
    try:
        said = " ".join(record.getMessage() for record in caplog.records)
        assert "holds a ledger" not in said, "a first start is not warned about"
    finally:
        fresh.stop(0)


def test_a_zero_grant_lifetime_is_refused_as_zero_not_as_malformed(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--expires 0s` is a number and a unit; "use a number and s, m, h or d"
    sent the operator looking for a typo that was not there."""
    keyring.load_or_create(tmp_path)
    arguments = ["--lane", "recall", "--scope", "read", "--expires", "0s"]
    code, out, err = run_cli(["grant", "issue", *arguments, "--data-dir", str(tmp_path)], capsys)
    assert (code, out) == (2, "")
    assert err == "ledger grant: --expires '0s': a grant must live at least 1 s\n", err
