"""Runs Alembic programmatically, so `ledger migrate` works from any folder."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Iterator
from contextlib import contextmanager

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

import migrations
from ledger_service.storage import translate

log = logging.getLogger("ledger.migrate")

# The session advisory lock replicas starting together migrate under, one at a time.
MIGRATION_LOCK_KEY = 4998
# How often a replica tries the migration lock while another one migrates.
MIGRATION_LOCK_POLL_SECONDS = 0.1
# A start that has waited this long for the lock says who holds it, and again
# as often: a holder frozen mid-migration (SIGSTOP, a paused VM) keeps it.
MIGRATION_LOCK_WAIT_LOG_SECONDS = 10.0
# The session holding the migration lock (an advisory lock on one bigint key:
# classid is its high half, objid its low, objsubid 1).
_LOCK_HOLDER = text(
    "SELECT l.pid, extract(epoch FROM now() - a.state_change)::bigint"
    " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0"
    " AND l.objid = :key AND l.objsubid = 1 AND l.database ="
    " (SELECT oid FROM pg_database WHERE datname = current_database())"
)
# SQLite: how long `ledger migrate` waits for the write lock another process
# holds (another migration, a server writing, a sqlite3 shell) before it gives
# up and says so. A migration holds it from first read to last step.
SQLITE_MIGRATION_WAIT_SECONDS = 300.0


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(pathlib.Path(migrations.__file__).parent))
    # The engine's URL keeps its password (Alembic needs it) but never reaches a log.
    config.set_main_option(
        "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
    )
    return config


@dataclasses.dataclass(frozen=True)
class Upgrade:
    """What `upgrade` did: the revision before (None: there was no schema) and after."""

    before: str | None
    after: str | None


class MigrationWaitExceeded(RuntimeError):
    """SQLite: another process held the write lock for longer than
    SQLITE_MIGRATION_WAIT_SECONDS, so this migration never had its turn."""


class RevisionRefused(ValueError):
    """The schema is at a revision this build will not serve as it is. A refused
    configuration, not an outage."""


class UnknownRevision(RevisionRefused):
    """The schema is at a revision this build's migrations do not hold: a newer
    release migrated the database."""


class OutdatedRevision(RevisionRefused):
    """The schema is at an older revision than this build's newest, and nothing
    here may migrate it (a server told not to, a recovery command): its reads
    and writes would fail on what is missing."""


def _check_known(config: Config, revision: str | None) -> None:
    script = ScriptDirectory.from_config(config)
    known = {found.revision for found in script.walk_revisions()}
    if revision is None or revision in known:
        return
    raise UnknownRevision(
        f"the database's schema is at revision {revision}, which this build does not "
        f"know (its newest is {script.get_current_head()}): a newer release migrated it; "
        "run that release (or newer) against it"
    )


def upgrade(engine: Engine, sqlite_wait_seconds: float | None = None) -> Upgrade:
    """Brings the schema to head. SQLite: waits its turn for the write lock up
    to `sqlite_wait_seconds` (SQLITE_MIGRATION_WAIT_SECONDS when None; 0, one
    busy timeout), then raises MigrationWaitExceeded."""
    config = alembic_config(engine)
    if engine.dialect.name != "postgresql":
        wait = SQLITE_MIGRATION_WAIT_SECONDS if sqlite_wait_seconds is None else sqlite_wait_seconds
        with _sqlite_turn(engine, wait) as connection:
            return _upgrade(config, connection)
    with engine.connect() as connection:
        # A schema at head needs no turn: a restart waited, silent and not
        # listening, for as long as another session held the lock.
        current = MigrationContext.configure(connection).get_current_revision()
        connection.commit()
        if (
            current is not None
            and current == ScriptDirectory.from_config(config).get_current_head()
        ):
            return Upgrade(current, current)
        # Replicas starting together migrate one at a time. A session's lock,
        # not a transaction's: a step that builds an index CONCURRENTLY (so that
        # replicas serving meanwhile keep appending) commits on its way.
        _lock_migrations(connection)
        try:
            done = _upgrade(config, connection)
            connection.commit()
            return done
        finally:
            connection.rollback()
            connection.execute(text(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"))
            connection.commit()


def _lock_migrations(connection: Connection) -> None:
    """Takes the migration lock by trying, not by waiting inside PostgreSQL:
    CREATE INDEX CONCURRENTLY waits for every transaction older than its own,
    and a replica waiting in pg_advisory_lock is one, so that wait was a
    deadlock (40P01) that failed one of three replicas started together. It
    waits as long as the migration holding the lock runs, as a start must."""
    say_at = time.monotonic() + MIGRATION_LOCK_WAIT_LOG_SECONDS
    while True:
        taken = connection.execute(
            text(f"SELECT pg_try_advisory_lock({MIGRATION_LOCK_KEY})")
        ).scalar()
        connection.commit()
        if taken:
            return
        if time.monotonic() >= say_at:
            _say_who_holds_the_lock(connection)
            say_at = time.monotonic() + MIGRATION_LOCK_WAIT_LOG_SECONDS
        time.sleep(MIGRATION_LOCK_POLL_SECONDS)


def _say_who_holds_the_lock(connection: Connection) -> None:
    holder = connection.execute(_LOCK_HOLDER, {"key": MIGRATION_LOCK_KEY}).first()
    connection.commit()
    if holder is None:
        return  # released since the last try
    pid, seconds = holder
    # Another role's session shows no state to a role without pg_read_all_stats.
    idle_seconds = "?" if seconds is None else seconds
    log.warning(
        "waiting for the migration lock (advisory key %d), held by pid %s (its state unchanged "
        "for %s s): another replica or `ledger migrate` is migrating, or is frozen while "
        "it does; if it does not end, pg_terminate_backend(%s)",
        MIGRATION_LOCK_KEY,
        pid,
        idle_seconds,
        pid,
    )


@contextmanager
def _sqlite_turn(engine: Engine, wait_seconds: float) -> Iterator[Connection]:
    """SQLite: the whole migration in one transaction begun IMMEDIATE, so that
    migrations started together take turns. A deferred one read the revision,
    then met another's write at its first step: "database is locked", and two
    of three started together failed. Each try waits the busy timeout."""
    deadline = time.monotonic() + wait_seconds
    while (connection := _begin_immediate(engine, deadline, wait_seconds)) is None:
        pass
    with connection:  # closed without its commit: rolled back
        yield connection
        connection.commit()


def _begin_immediate(engine: Engine, deadline: float, wait_seconds: float) -> Connection | None:
    """A connection holding SQLite's write lock, or None when another process
    held it for the busy timeout (raised past `deadline`). The connection's
    own setup (its switch to WAL) may wait for the lock too."""
    try:
        connection = engine.connect().execution_options(ledger_write=True)
    except DBAPIError as error:
        _lock_still_held(error, deadline, wait_seconds)
        return None
    try:
        connection.begin()
    except DBAPIError as error:
        connection.close()
        _lock_still_held(error, deadline, wait_seconds)
        return None
    return connection


def _lock_still_held(error: DBAPIError, deadline: float, wait_seconds: float) -> None:
    """Returns to try again; raises `error` when it is no lock wait, and
    MigrationWaitExceeded once `deadline` has passed."""
    if not translate.lock_wait_gave_up(error):
        raise error
    if time.monotonic() >= deadline:
        raise MigrationWaitExceeded(
            "another process held the SQLite database's write lock for longer than "
            f"{wait_seconds:g} s (another `ledger migrate`, a server "
            "writing, or a sqlite3 shell with a transaction open); run `ledger migrate` "
            "again once it is done"
        ) from error


def _upgrade(config: Config, connection: Connection) -> Upgrade:
    # Read under the lock, so `before` is what this upgrade started from.
    before = MigrationContext.configure(connection).get_current_revision()
    # Alembic's own answer to an unknown revision is a traceback.
    _check_known(config, before)
    if connection.dialect.name == "postgresql":
        connection.commit()  # Alembic begins each migration's transaction itself
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
    after = MigrationContext.configure(connection).get_current_revision()
    return Upgrade(before, after)


def check_revision(engine: Engine) -> None:
    """For a server that does not migrate the database itself, and for the
    recovery commands: raises UnknownRevision when a newer release has migrated
    it, OutdatedRevision when an older release made it and `ledger migrate` has
    not run since. A database with no schema yet passes (a server waits for its
    migration)."""
    config = alembic_config(engine)
    with engine.connect() as connection:
        revision = MigrationContext.configure(connection).get_current_revision()
    _check_known(config, revision)
    head = ScriptDirectory.from_config(config).get_current_head()
    if revision is not None and revision != head:
        raise OutdatedRevision(
            f"the database's schema is at revision {revision}, older than this build's "
            f"{head}: run `ledger migrate` first"
        )


def check(engine: Engine) -> None:
    """Raises when the models and the migrated schema differ (`alembic check`)."""
    config = alembic_config(engine)
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.check(config)
