"""Engines for SQLite (embedded default) and PostgreSQL (replicas sharing one).

SQLite runs in WAL mode with synchronous=FULL: every answered move is on disk
before the answer leaves. PostgreSQL gets a bounded pool and statement and lock
timeouts so that no request hangs on the database, and its checkouts run under
the store's watchdog (storage/watchdog.py), which also holds a server that stops
answering altogether to the call's deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pathlib
import sqlite3
import stat
import struct
import threading
import time
import weakref
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.pool import ConnectionPoolEntry

from ledger_service.storage import translate, watchdog

# A pooled PostgreSQL connection idle this long is pinged before it is used.
PING_AFTER_IDLE_SECONDS = 1.0
_IDLE_SINCE = "ledger_idle_since"


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    pool_size: int = 8
    pool_max_overflow: int = 4
    pool_timeout_seconds: float = 2.0
    statement_timeout_ms: int = 5000
    # How long SQLite waits for the write lock before giving up.
    sqlite_busy_timeout_ms: int = 5000


# SQLite: one lock per engine that every writer of this process holds around its
# write transaction (write_gate).
_WRITE_GATES: weakref.WeakKeyDictionary[Engine, threading.Lock] = weakref.WeakKeyDictionary()
_WRITE_GATES_LOCK = threading.Lock()


# A reader that holds a snapshot (a backup, `ledger verify`) keeps checkpoints
# from resetting the write-ahead log, which then grows with every commit. Once
# a checkpoint resets it, SQLite cuts the file back to this size; unset, it
# stayed at its largest (438 MB after a 40 s read under load).
WAL_KEPT_BYTES = 64 * 2**20


def write_gate(engine: Engine) -> threading.Lock | None:
    """The lock this process's writers of a SQLite database hold from before
    BEGIN IMMEDIATE until their COMMIT or ROLLBACK is done; None on PostgreSQL.

    SQLite has one writer at a time. Without this lock a writer that finds
    another one's transaction open waits in SQLite's busy handler, which
    sleeps 1, 2, 5, 10, 15, 20, 25 ... 100 ms between tries, so a BEGIN behind
    a snapshot's chunk writes, taken back to back, could wait a long time. On
    the lock it is woken as soon as the other commits (docs/benchmarks.md has
    both figures). Writers in other processes still meet in the busy handler."""
    if engine.dialect.name != "sqlite":
        return None
    with _WRITE_GATES_LOCK:
        gate = _WRITE_GATES.get(engine)
        if gate is None:
            gate = _WRITE_GATES[engine] = threading.Lock()
        return gate


# What write_problem says while another process holds the write lock.
LOCK_HELD = "another process has held the write lock"


def write_problem(
    engine: Engine,
    *,
    grow: bool = False,
    lock_held: bool = False,
    stop: threading.Event | None = None,
) -> str | None:
    """Why this process cannot write the SQLite database, naming the file; None
    when it can (and always on PostgreSQL, whose server owns its files).
    `grow`: commit a write too (the database's user_version, set to what it
    is: one frame more in the write-ahead log), for a full disk or a file-size
    limit, which fail only a write that makes a file longer.

    SQLite opens a file it may not write read-only without a word, and only a
    write fails, so the files' permissions are checked first and then a write
    transaction is begun and rolled back: an immutable file, a read-only mount
    or a root-owned WAL file show only there. Takes the write gate, so that the
    probe never waits in SQLite's busy handler behind this process's writers.
    `lock_held`: a move gave up waiting for another process's write lock; the
    probe waits the busy timeout for it, and still busy, says so. It waits in
    short tries and gives up once `stop` is set (the server stops): a stop
    never waits the busy timeout for the probe."""
    path = engine.url.database
    if engine.dialect.name != "sqlite" or not path:
        return None
    database = pathlib.Path(path)
    for file in (database, *(database.with_name(database.name + s) for s in ("-wal", "-shm"))):
        if file.exists() and not os.access(file, os.W_OK):
            return f"{file} is not writable by this process ({_ownership(file)})"
    directory = database.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} does not let this process create files ({_ownership(directory)})"
    if not database.exists():
        return f"{database} is missing"
    gate = write_gate(engine)
    assert gate is not None
    with gate:
        wait = _BUSY_SECONDS.get(engine, _PROBE_TIMEOUT_SECONDS) if lock_held else None
        give_up = time.monotonic() + (wait or _PROBE_TIMEOUT_SECONDS)
        while True:
            left = give_up - time.monotonic()
            connection = sqlite3.connect(path, timeout=max(0.0, min(_PROBE_TRY_SECONDS, left)))
            try:
                connection.isolation_level = None
                connection.execute("BEGIN IMMEDIATE")
                if grow:
                    version = connection.execute("PRAGMA user_version").fetchone()[0]
                    connection.execute(f"PRAGMA user_version={int(version)}")
                    connection.execute("COMMIT")
                else:
                    connection.execute("ROLLBACK")
                return None
            except sqlite3.Error as error:
                if translate.driver_code(error) in translate.CANNOT_WRITE:
                    return f"SQLite cannot write {database}: {error}"
                if not translate.lock_wait_gave_up(error):
                    return None  # damage: not this question
                stopped = stop is not None and stop.is_set()
                if not stopped and time.monotonic() < give_up:
                    continue  # busy still: the next try
                if wait is None:
                    return None  # busy a moment (another process writes it)
                if stopped:
                    return f"{LOCK_HELD} on {database} (the probe stopped waiting: a stop)"
                return f"{LOCK_HELD} on {database} for longer than the busy timeout ({wait:g} s)"
            finally:
                connection.close()


# How long the write probe waits for another process's write transaction.
_PROBE_TIMEOUT_SECONDS = 1.0
# How long one try of the probe waits in SQLite's busy handler: a stop is
# looked for between tries.
_PROBE_TRY_SECONDS = 0.1
# Each SQLite engine's busy timeout (EngineLimits.sqlite_busy_timeout_ms), in seconds.
_BUSY_SECONDS: weakref.WeakKeyDictionary[Engine, float] = weakref.WeakKeyDictionary()


def _ownership(path: pathlib.Path) -> str:
    info = path.stat()
    return (
        f"mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}; "
        f"this process runs as uid {os.geteuid()}"
    )


# libpq's connection parameters that hold a secret, as a URL's query may carry them.
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def redacted(url: str | URL) -> str:
    """The URL with its password hidden, for logs and messages: the one after
    the user name, and any in its query (`?password=...`)."""
    parsed = make_url(url)
    secrets = {key: "***" for key in parsed.query if key.lower() in _SECRET_PARAMETERS}
    rendered = parsed.update_query_dict(secrets).render_as_string(hide_password=True)
    return rendered.replace("=%2A%2A%2A", "=***")


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_file(url: str | URL) -> pathlib.Path | None:
    """The file a SQLite URL names, as the URL gives it; None for PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return pathlib.Path(parsed.database)


def relative_sqlite_file(url: str | URL) -> pathlib.Path | None:
    """The absolute path of a SQLite URL's file when the URL gives it relative
    (sqlite:///data/ledger.db: under the current directory), else None."""
    path = sqlite_file(url)
    return None if path is None or path.is_absolute() else path.absolute()


# The URL each engine was created from: its own lacks the server options
# moved into its connect arguments.
_SOURCE_URLS: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def create(url: str, limits: EngineLimits) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed, limits)
    elif parsed.get_backend_name() == "postgresql":
        engine = _postgres_engine(parsed, limits)
    else:
        raise ValueError("the database URL must be sqlite:/// or postgresql+psycopg://")
    _SOURCE_URLS[engine] = url
    return engine


def source_url(engine: Engine) -> str:
    """The URL `create` made the engine from, for another process to open
    the same database (secret: it may hold a password)."""
    return _SOURCE_URLS.get(engine) or engine.url.render_as_string(hide_password=False)


@dataclasses.dataclass(frozen=True, slots=True)
class _Opened:
    """The SQLite file an engine's connections opened: its path and its log's,
    as strings, and its (device, inode), None when it could not be read. Every
    batch checks both paths (SqlStore._check_file): os.stat on kept strings,
    not a pathlib.Path made afresh each time."""

    path: str
    wal: str
    file_id: tuple[int, int] | None


_OPENED: weakref.WeakKeyDictionary[Engine, _Opened] = weakref.WeakKeyDictionary()


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _exists(path: str) -> bool:
    """pathlib's Path.exists() on a string: False for the errors it takes for
    "not there", any other OSError raised."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return False
        raise
    return True


def file_replaced(engine: Engine) -> str | None:
    """Why the engine's SQLite file is no longer the one its connections
    opened (deleted, or another file moved to its path); None when it is, and
    always on PostgreSQL. Moves written to the old file would be lost."""
    opened = _OPENED.get(engine)
    if opened is None or opened.file_id is None:
        return None
    now = _file_id(opened.path)
    if now == opened.file_id:
        return None
    how = "deleted" if now is None else "replaced by another file"
    return f"{pathlib.Path(opened.path)} was {how} while the server had it open"


def wal_deleted(engine: Engine) -> str | None:
    """Why the engine's SQLite file has lost its write-ahead log while a
    connection holds it open (SQLite removes it only when the last one
    closes); None when it has not, and always on PostgreSQL. The moves in a
    deleted log survive only a clean close, which copies them into the file."""
    opened = _OPENED.get(engine)
    if opened is None or _exists(opened.wal):
        return None
    return (
        f"{pathlib.Path(opened.wal)} was deleted while the server had it open (moves since "
        "the last checkpoint are only in the deleted file: stop the server with SIGTERM, "
        "not kill -9, so that its close copies them into the database)"
    )


def empty_sqlite_file(url: str | URL) -> pathlib.Path | None:
    """The SQLite database file of `url` when it is there but empty (0 bytes);
    None for PostgreSQL, a file with content, or none at all.

    SQLite takes an empty file for an empty database, but a ledger's file is
    never empty once it has been made: one that is empty now most often held
    a ledger (a copy to a full disk, a failed restore). `serve` does not make
    a new ledger in it; `ledger migrate`, asked in so many words, does."""
    path = sqlite_file(url)
    return path if path is not None and path.is_file() and path.stat().st_size == 0 else None


def empty_file_text(path: pathlib.Path) -> str:
    """What `serve` and the recovery commands say of an empty database file."""
    return f"{path} is empty (0 bytes): there is no ledger in it"


# SQLite's -shm file opens with two copies of the WAL index header (48 bytes
# each: the version at 0, the last valid frame, mxFrame, at 16), then the
# checkpoint's progress (nBackfill, the frames copied into the file, at 96);
# native byte order. https://www.sqlite.org/walformat.html
_SHM_HEADER_BYTES = 48
_SHM_VERSION = 3007000
_SHM_MAX_FRAME_OFFSET = 16
_SHM_BACKFILL_OFFSET = 96


def lost_wal_text(url: str | URL) -> str:
    """What `serve` and the commands say when a SQLite file's -wal is gone
    while its -shm says the -wal held commits not yet copied into the file
    ("" otherwise). SQLite opens such a file without a word, resets the -shm,
    and serves the older ledger: the moves only the -wal held are lost, and
    nothing could tell it afterwards. Read before anything opens the file."""
    path = sqlite_file(url)
    if path is None:
        return ""
    wal, shm = pathlib.Path(f"{path}-wal"), pathlib.Path(f"{path}-shm")
    if not path.is_file() or wal.exists() or not shm.is_file():
        return ""
    try:
        with shm.open("rb") as file:
            header = file.read(_SHM_BACKFILL_OFFSET + 4)
    except OSError:
        return ""
    if len(header) < _SHM_BACKFILL_OFFSET + 4:
        return ""
    first = header[:_SHM_HEADER_BYTES]
    (version,) = struct.unpack_from("=I", first, 0)
    if version != _SHM_VERSION or first != header[_SHM_HEADER_BYTES : 2 * _SHM_HEADER_BYTES]:
        return ""  # not a header SQLite finished writing: nothing to go by
    (frames,) = struct.unpack_from("=I", header, _SHM_MAX_FRAME_OFFSET)
    (copied,) = struct.unpack_from("=I", header, _SHM_BACKFILL_OFFSET)
    if frames <= copied:
        return ""
    return (
        f"{wal} is missing, but {shm} says it held {frames - copied} page(s) of commits "
        f"not yet copied into {path.name}: opened now, the moves in them would be lost "
        f"and the ledger would answer from an older state. Put the -wal file back beside "
        f"it; if it is lost, restore the database from a backup, or delete {shm.name} to "
        f"accept the loss (docs/recovery.md)"
    )


def _create_private(path: pathlib.Path) -> None:
    """A new database is its owner's alone: its directory, made here, 0700, and
    the file 0600 (SQLite gives its WAL and shared-memory files the same mode),
    whatever the umask. Every lane's events are in it, and a grant guards them
    only over the network. Existing ones are left as the operator set them."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            path.parent.chmod(0o700)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # there already, or not ours to make: SQLite says what is wrong
        return
    try:
        os.fchmod(descriptor, 0o600)
    finally:
        os.close(descriptor)


def _sqlite_engine(url: URL, limits: EngineLimits) -> Engine:
    if not url.database or url.database == ":memory:":
        raise ValueError("the SQLite database must be a file (the ledger is durable)")
    path = pathlib.Path(url.database)
    _create_private(path)
    engine = create_engine(
        url,
        pool_size=limits.pool_size,
        max_overflow=limits.pool_max_overflow,
        pool_timeout=limits.pool_timeout_seconds,
        hide_parameters=True,
        connect_args={
            "timeout": limits.sqlite_busy_timeout_ms / 1000,
            "check_same_thread": False,
        },
    )

    _BUSY_SECONDS[engine] = limits.sqlite_busy_timeout_ms / 1000

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        # Let SQLAlchemy's "begin" event below issue BEGIN itself.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute(f"PRAGMA busy_timeout={int(limits.sqlite_busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA journal_size_limit={WAL_KEPT_BYTES}")
        except UnicodeDecodeError as error:
            # SQLite's "malformed database schema (...)" quotes the damaged
            # schema text, and Python's sqlite3 cannot decode it: said as the
            # damage it is, not a traceback.
            raise sqlite3.DatabaseError(translate.DAMAGED_SCHEMA_TEXT) from error
        cursor.close()
        # The file the first connection opened (WAL mode above has created it).
        if engine not in _OPENED:
            _OPENED[engine] = _Opened(str(path), f"{url.database}-wal", _file_id(str(path)))

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # A writer takes the write lock up front, so that two writers never
        # both read a balance and then race to commit. Issued on the driver,
        # which is cheaper than through SQLAlchemy, for every transaction pays it.
        write = connection.get_execution_options().get("ledger_write", False)
        sql = "BEGIN IMMEDIATE" if write else "BEGIN"
        dbapi_error = connection.dialect.loaded_dbapi.Error
        try:
            connection.connection.driver_connection.execute(sql)
        except dbapi_error as error:  # "database is locked": the store's retry sees it
            raise DBAPIError.instance(sql, None, error, dbapi_error) from error

    return engine


def _postgres_engine(url: URL, limits: EngineLimits) -> Engine:
    timeout = int(limits.statement_timeout_ms)
    # Server options in the URL (?options=-csearch_path%3Dx) are kept, ours appended.
    given = url.query.get("options", "")
    given_options = given if isinstance(given, str) else " ".join(given)
    url = url.difference_update_query(["options"])
    connect_timeout = max(1, timeout // 1000)
    # PostgreSQL takes its timeouts as an int of milliseconds; Linux takes a
    # keepalive's idle time up to 32,767 s.
    idle_timeout = min(timeout * 4, 2**31 - 1)
    keepalive_idle = min(max(1, timeout // 1000), 32_767)
    engine = create_engine(
        url,
        # The wait for a free connection ends at the watch's deadline too.
        poolclass=watchdog.DeadlinePool,
        pool_size=limits.pool_size,
        max_overflow=limits.pool_max_overflow,
        pool_timeout=limits.pool_timeout_seconds,
        # Pinged on checkout below, under the watch, instead.
        pool_pre_ping=False,
        hide_parameters=True,
        connect_args={
            "connect_timeout": connect_timeout,
            "options": f"{given_options} -c statement_timeout={timeout}"
            f" -c lock_timeout={timeout} -c idle_in_transaction_session_timeout={idle_timeout}",
            "application_name": "ledger",
            # Off: psycopg's own prepared statements make its ROLLBACK send
            # DEALLOCATE ALL, which would drop those of storage/libpq.py.
            "prepare_threshold": None,
            # storage/libpq.py sends and reads text as UTF-8, whatever the database's encoding.
            "client_encoding": "utf8",
            # A database that vanishes without closing the connection (a network
            # partition, a crashed host) is noticed within the timeout, not after
            # TCP's retransmission timeout of many minutes: statement_timeout
            # only works while the server can still answer. A server that is
            # frozen still ACKs, so neither fires: the watchdog covers that.
            "keepalives": 1,
            "keepalives_idle": keepalive_idle,
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": timeout,
        },
    )

    @event.listens_for(engine, "do_connect")
    def _on_connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        # A new connection's handshake ends by the watch's deadline
        # (DeadlineConnection; libpq's own timeout counts whole seconds, at
        # least 2). cparams is shared: copied, not changed.
        bounded = {**cparams, "connect_timeout": watchdog.connect_timeout_for(connect_timeout)}
        return watchdog.DeadlineConnection.connect(*cargs, **bounded)

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
        # The pre-ping, under the watch: a frozen server blocks it like any
        # statement. A connection found dead is replaced (DisconnectionError);
        # one the watch interrupted fails the checkout, and the pool drops it.
        # Only a connection idle for PING_AFTER_IDLE_SECONDS is pinged: under
        # load the ping would be a round trip more on every move, and a
        # connection that died meanwhile fails its statement with UNAVAILABLE
        # and takes the pool's other connections with it (SQLAlchemy's rule).
        watch = watchdog.current()
        if watch is not None:
            watch.attach(record.driver_connection)
        idle_since = record.info.get(_IDLE_SINCE)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return  # new, or back in the pool a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            if watch is not None and watch.detach():
                raise
            raise DisconnectionError() from error

    @event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> None:
        # A statement the watch interrupted: its connection is not reused.
        # The watch lets go of a connection about to be closed, so that it
        # never shuts down a descriptor number reused by another socket.
        watch = watchdog.current()
        if watch is None:
            return
        if watch.interrupted:
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = False  # one late call, not the pool
        if context.is_disconnect:
            watch.detach()

    return engine
