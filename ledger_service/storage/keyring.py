"""The grant keyring and the local admin grant, as files in the data directory.

`<data-dir>/grant-keys.json` holds every key that verifies grants and names the
one that signs new ones; `<data-dir>/admin.grant` holds an admin grant for the
local command line. Both are created with mode 0600, written to a temporary file
and renamed into place, so a reader never sees half a key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import pathlib
import stat
import threading

from ledger_service.domain.grants import Keyring, new_key, new_key_id

log = logging.getLogger(__name__)

KEYRING_FILE = "grant-keys.json"
ADMIN_GRANT_FILE = "admin.grant"
FORMAT_VERSION = 1
MAX_KEYRING_BYTES = 64 * 1024
MAX_KEYS = 16


class KeyringError(Exception):
    """The keyring file is missing, unreadable or not a keyring. Names no key."""


def keyring_path(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / KEYRING_FILE


def admin_grant_path(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / ADMIN_GRANT_FILE


def load(data_dir: pathlib.Path) -> Keyring:
    path = keyring_path(data_dir)
    try:
        with path.open("rb") as file:
            _warn_if_shared(path, os.fstat(file.fileno()))
            text = file.read(MAX_KEYRING_BYTES + 1)
    except FileNotFoundError as error:
        raise KeyringError(f"no keyring at {path}") from error
    except OSError as error:
        raise KeyringError(f"cannot read the keyring at {path}") from error
    if len(text) > MAX_KEYRING_BYTES:
        raise KeyringError(f"the keyring at {path} is too large")
    return _parse(text, path)


def load_or_create(data_dir: pathlib.Path) -> Keyring:
    """The keyring in `data_dir`, created with one fresh key if there is none.

    An existing keyring is only read, so a read-only data directory works.
    """
    if keyring_path(data_dir).exists():
        return load(data_dir)
    key_id = new_key_id()
    created = Keyring(keys={key_id: new_key()}, signing_key_id=key_id)
    try:
        if not data_dir.exists():
            data_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                data_dir.chmod(0o700)  # as a new database's (storage/database.py)
        # O_EXCL: when two servers start on one data directory, one key wins.
        _write_private(keyring_path(data_dir), _render(created), replace=False)
    except FileExistsError:
        return load(data_dir)
    except OSError as error:
        # A data directory that is a file, or that this process may not write
        # (a read-only mount, a full disk): the operator's to fix, in one line.
        reason = error.strerror or error.__class__.__name__
        raise KeyringError(
            f"cannot create the keyring at {keyring_path(data_dir)}: {reason}"
        ) from error
    log.warning("created a new grant keyring at %s (key id %s)", keyring_path(data_dir), key_id)
    return created


_NOT_FAILED = object()


class KeyringFile:
    """The keyring file of a running server, read again when it changes, so that
    a rotated or retired key takes effect without a restart (on every replica
    that reads the file: its own copy, or one mounted file)."""

    def __init__(self, data_dir: pathlib.Path) -> None:
        self._path = keyring_path(data_dir)
        # Whether this start made the keyring (the server warns when the
        # database it opens already holds a ledger: its grants are refused).
        self.created = not self._path.exists()
        self.keyring = load_or_create(data_dir)
        self._seen = self._stamp()
        # The stamp of a changed file that failed (None: a missing file), or
        # _NOT_FAILED; a missing file must be told, not taken for one told.
        self._unreadable: object = _NOT_FAILED

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            status = self._path.stat()
        except OSError:
            return None
        return (status.st_ino, status.st_size, status.st_mtime_ns)

    def changed(self) -> Keyring | None:
        """The keyring if the file changed since it was last read; None when it
        did not, or when it cannot be read now (the keys in force stay)."""
        stamp = self._stamp()
        if stamp == self._seen:
            return None
        try:
            keyring = load(self._path.parent)
        except KeyringError as error:
            # Read again at every check: a file made readable by `chown` or
            # `chmod` (no write, the same stamp) must still take effect.
            if stamp != self._unreadable:
                restart = (
                    "; a restart would create a new keyring and refuse every grant"
                    " issued before: restore the file"
                    if stamp is None
                    else ""
                )
                log.error("%s; the keys read before stay in force%s", error, restart)
                self._unreadable = stamp
            return None
        self._seen, self._unreadable = stamp, _NOT_FAILED
        if keyring == self.keyring:
            return None
        self.keyring = keyring
        return keyring


def rotate(data_dir: pathlib.Path) -> Keyring:
    """Adds a new key and makes it the signing key; the old keys still verify."""
    keyring = load(data_dir)
    if len(keyring.keys) >= MAX_KEYS:
        raise KeyringError(f"the keyring holds {MAX_KEYS} keys already; retire one first")
    key_id = new_key_id()
    rotated = Keyring(keys={**keyring.keys, key_id: new_key()}, signing_key_id=key_id)
    _write_private(keyring_path(data_dir), _render(rotated), replace=True)
    return rotated


def retire(data_dir: pathlib.Path, key_id: str) -> Keyring:
    """Removes a verification key: every grant it signed stops working."""
    keyring = load(data_dir)
    if key_id not in keyring.keys:
        raise KeyringError(f"the keyring has no key {key_id!r}")
    if key_id == keyring.signing_key_id:
        raise KeyringError("that key signs new grants: rotate first, then retire it")
    keys = {kid: key for kid, key in keyring.keys.items() if kid != key_id}
    retired = Keyring(keys=keys, signing_key_id=keyring.signing_key_id)
    _write_private(keyring_path(data_dir), _render(retired), replace=True)
    return retired


def write_admin_grant(data_dir: pathlib.Path, grant: str) -> pathlib.Path:
    path = admin_grant_path(data_dir)
    _write_private(path, (grant + "\n").encode("ascii"), replace=True)
    return path


def _render(keyring: Keyring) -> bytes:
    document = {
        "version": FORMAT_VERSION,
        "signing_key_id": keyring.signing_key_id,
        "keys": {
            key_id: base64.b64encode(key).decode("ascii") for key_id, key in keyring.keys.items()
        },
    }
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("ascii")


def _parse(text: bytes, path: pathlib.Path) -> Keyring:
    try:
        document = json.loads(text)
        if document.get("version") != FORMAT_VERSION:
            raise KeyringError(f"the keyring at {path} has an unknown format version")
        keys = {
            str(key_id): base64.b64decode(encoded, validate=True)
            for key_id, encoded in document["keys"].items()
        }
        return Keyring(keys=keys, signing_key_id=str(document["signing_key_id"]))
    except KeyringError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, binascii.Error) as error:
        # The message names the file only: a parse error could quote key material.
        raise KeyringError(f"the keyring at {path} is not valid") from error


def _write_private(path: pathlib.Path, content: bytes, *, replace: bool) -> None:
    """Writes a file that only its owner can read, whole or not at all.

    The content goes to a private temporary file first; then a rename replaces
    the target, or a hard link creates it only if it does not exist yet (so two
    servers starting at once agree on one keyring). Raises FileExistsError then.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(temporary, flags, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # whatever the umask said
        _keep_owner(path, descriptor)
        view = memoryview(content)
        while view:
            view = view[os.write(descriptor, view) :]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    try:
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def _keep_owner(path: pathlib.Path, descriptor: int) -> None:
    """A replacement keeps the file's owner: `ledger grant retire-key` run as
    root must not leave the server's user a keyring it cannot read (only root
    may give a file away; anyone else writes a file of their own anyway)."""
    if os.geteuid() != 0:
        return
    try:
        status = path.stat()
    except FileNotFoundError:
        return
    os.fchown(descriptor, status.st_uid, status.st_gid)


def _warn_if_shared(path: pathlib.Path, status: os.stat_result) -> None:
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s can be read by other users: chmod 600 it", path)
