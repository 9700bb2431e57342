"""Every limit and knob of the server, in one frozen object passed explicitly.

TigerBeetle's rule: put a limit on everything. Each field names its unit last.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import pathlib
from collections.abc import Mapping

DEFAULT_DATA_DIR = pathlib.Path("data")
DEFAULT_LISTEN = "127.0.0.1:50051"
TLS_ENVIRONMENT = {
    "tls_cert_path": "LEDGER_TLS_CERT",
    "tls_key_path": "LEDGER_TLS_KEY",
    "tls_client_ca_path": "LEDGER_TLS_CLIENT_CA",
}
# The settings `ledger serve` also takes as a flag, and the flag. The source
# table: a refusal names the flag or the variable its value came from
# (Settings.source), and the serve command reads its overrides from it.
SERVE_FLAGS = {
    "database_url": "--database-url",
    "data_dir": "--data-dir",
    "listen": "--listen",
    "sweep_interval_seconds": "--sweep-interval",
    "max_workers": "--max-workers",
    "max_calls_per_grant": "--max-calls-per-grant",
    "max_connections_per_grant": "--max-connections-per-grant",
    "tls_cert_path": "--tls-cert",
    "tls_key_path": "--tls-key",
    "tls_client_ca_path": "--tls-client-ca",
    "snapshot_every_events": "--snapshot-every",
    "recovery_budget_seconds": "--recovery-budget-seconds",
    "recovery_max_risk": "--recovery-max-risk",
    "recovery_min_viable_sources": "--recovery-min-viable-sources",
}


def either_source(name: str) -> str:
    """Both ways to give a setting, for a message that asks for one."""
    variable = setting_variable(name)
    return f"{SERVE_FLAGS[name]} or {variable}" if name in SERVE_FLAGS else variable


def setting_variable(name: str) -> str:
    """The environment variable of a setting: LEDGER_<NAME>, but for the TLS files."""
    return TLS_ENVIRONMENT.get(name, f"LEDGER_{name.upper()}")


def data_dir_from_environment() -> pathlib.Path:
    """LEDGER_DATA_DIR, or ./data when it is unset or empty (an empty one was the
    current directory to the server and ./data to the commands); a leading `~`
    is the home directory, as a shell would have made it (a systemd unit or a
    quoted value makes none, and the server made a directory named '~')."""
    return pathlib.Path(os.environ.get("LEDGER_DATA_DIR") or str(DEFAULT_DATA_DIR)).expanduser()


def default_database_url(data_dir: pathlib.Path) -> str:
    return f"sqlite:///{data_dir / 'ledger.db'}"


def database_url_problem(url: str) -> str | None:
    """Why the ledger refuses a database URL's form, or None. A SQLite URL
    names the file by its path, with no query: SQLite's URI form
    (`sqlite:///file:PATH?mode=ro&uri=true`) is refused, for its options
    (read-only, immutable, nolock, shared memory) undo what the ledger
    promises, and the ledger checks, creates and watches its file by path."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return "is not a database URL"
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        # Refused here, before a server makes a keyring or a command a traceback.
        return (
            f"names a {backend[:40]!r} database; the ledger takes sqlite:/// or "
            "postgresql+psycopg:// URLs"
        )
    if backend == "postgresql" and parsed.get_driver_name() != "psycopg":
        # Only psycopg 3 is installed and spoken to (storage/libpq.py): another
        # driver (psycopg2, asyncpg) was an ImportError's traceback, exit 1.
        return (
            f"names the PostgreSQL driver {parsed.get_driver_name()[:40]!r}; the ledger "
            "takes postgresql+psycopg:// URLs (psycopg 3)"
        )
    if backend != "sqlite":
        return None
    if (parsed.database or "").startswith("file:") or parsed.query:
        return (
            "is a SQLite URI (file:..., ?uri=true or other query options), which the "
            "ledger does not take; give the database file's path: "
            "sqlite:///relative/path/ledger.db or sqlite:////absolute/path/ledger.db, "
            "with no query"
        )
    return None


def home_expanded(url: str) -> str:
    """A SQLite URL whose path starts with `~` (`sqlite:///~/ledger.db`), with
    the home directory in its place, as a shell would give a path; anything
    else unchanged. Left as it was, SQLite made a directory named `~`. A `~name`
    that is no user's (`~backup.db`) stays as it is, as a shell leaves it."""
    prefix = "sqlite:///~"
    if not url.startswith(prefix):
        return url
    return "sqlite:///" + os.path.expanduser(url.removeprefix("sqlite:///"))


# The largest value of any setting: a count (gRPC's channel options and
# PostgreSQL's statement_timeout are C ints) and a number of seconds (the
# longest a grant may live, far within what a thread can wait).
MAX_SETTING_COUNT = 2**31 - 1
MAX_SETTING_SECONDS = 10 * 366 * 86_400
# The least max_metadata_bytes: a grant of MAX_GRANT_LENGTH and gRPC's own headers.
MIN_METADATA_BYTES = 8 * 1024
# The fastest client pings a server admits (client_ping_min_interval_seconds),
# and the slowest floor: the lane clients ping every 5 s (KEEPALIVE_INTERVAL_MS
# in clients/python/ledger_client/channels.py), and a floor above it sent every
# idle lane client GOAWAY too_many_pings.
MIN_CLIENT_PING_INTERVAL_SECONDS = 1.0
MAX_CLIENT_PING_INTERVAL_SECONDS = 5.0
_PING = "client_ping_min_interval_seconds"


# Limits that must stay above max_watchers, or a stream past it never reaches
# the watchers' check, and what such a stream meets instead.
_ABOVE_MAX_WATCHERS = (
    ("max_calls_per_connection", "one connection's stream past it is refused by gRPC"),
    ("max_concurrent_rpcs", "a stream past max_watchers gets gRPC's own RESOURCE_EXHAUSTED"),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    database_url: str
    data_dir: pathlib.Path = DEFAULT_DATA_DIR
    listen: str = DEFAULT_LISTEN
    # Serves the TestClock service and lets clients move time. Tests only.
    test_clock: bool = False
    # Grants (docs/security.md). Off only with --insecure-no-auth, on loopback.
    auth_enabled: bool = True
    admin_grant_lifetime_seconds: int = 365 * 86_400
    # TLS: a certificate and key serve TLS; a client CA as well demands mTLS.
    tls_cert_path: pathlib.Path | None = None
    tls_key_path: pathlib.Path | None = None
    tls_client_ca_path: pathlib.Path | None = None
    # gRPC server.
    max_workers: int = 16
    # Calls and streams at the server at once, health checks included: running
    # (at most rpc_threads) or waiting for a thread, a refused one until its
    # answer is sent. gRPC counts each from its arrival and refuses one more
    # before any of ours runs, so the total is kept well above what one grant
    # may run: a lane that floods the server has max_calls_per_grant running
    # and the rest answered TOO_MANY_CALLS, and those answers waiting for a
    # thread must not fill the total (docs/benchmarks.md, "One grant's share").
    max_concurrent_rpcs: int = 1024
    # One client connection's calls and streams at once (HTTP/2's concurrent
    # streams); its others wait in the connection, so one flooding client
    # takes at most an eighth of max_concurrent_rpcs. Above max_watchers, so that
    # one connection's stream past that limit is refused, not kept waiting.
    max_calls_per_connection: int = 128
    # Client connections open at once; gRPC closes one more as it arrives,
    # before it reads a byte of it. A connection that never sends (a raw TCP
    # socket, or an HTTP/2 preface and then silence) is never timed out by
    # gRPC, so without a bound 20,000 silent sockets took every file
    # descriptor of a server whose limit was 20,000: no new client could
    # connect, and the database could open no file. The server also raises
    # its open-file limit to fit this many and CONNECTION_FD_HEADROOM more
    # (server.py), or lowers this bound to fit the limit, with a WARNING.
    max_connections: int = 4096
    # One grant's calls running at once (event streams apart: they have
    # max_watchers_per_grant); one more is refused at once, TOO_MANY_CALLS
    # (api/shares.py). Above the lane clients' own bound (64 calls in flight)
    # with room for calls the server still finishes after their client gave
    # up at the deadline, so that no lone client meets it. Grants together
    # run at most grant_calls_total (208), whose last 16 places past two
    # shares go only to a grant running fewer than 4 (a quarter of them), so
    # up to five flooding lanes leave a calm lane's calls a place, and any
    # number leave the pool's threads (rpc_threads) to streams and health.
    max_calls_per_grant: int = 96
    max_message_bytes: int = 1 * 1024 * 1024
    # A call's headers (metadata) in all, as gRPC counts them (each name and
    # value plus 32 bytes). One bound: gRPC's own pair (8 KiB soft, 16 KiB
    # hard) refused a call between them at random. A grant (4,096 characters)
    # and the trace headers fit with room to spare.
    max_metadata_bytes: int = 16 * 1024
    # Longest a call may take, from its headers, to deliver its whole request
    # message before it is cancelled (api/arrival.py): a call waiting holds one
    # of the pool's threads. 2 s is 1 MiB at 4 Mbit/s.
    request_arrival_seconds: float = 2.0
    grace_period_seconds: float = 5.0
    # Longest a request may wait for the database before it gets UNAVAILABLE.
    request_deadline_seconds: float = 5.0
    # Database pool (PostgreSQL); SQLite uses one writer and a small pool.
    # A worker waits for a connection at most pool_timeout_seconds; with as many
    # connections as workers it never has to.
    pool_size: int = 16
    pool_max_overflow: int = 4
    pool_timeout_seconds: float = 5.0
    # PostgreSQL: connections one grant's calls hold at once; its others wait
    # for one of them until their deadline (storage/pool_shares.py). Below the
    # pool's pool_size + pool_max_overflow, so that a grant whose calls wait
    # on a slow or locked lane leaves the others connections; as many as the
    # workers, so that a grant alone is not slowed by it.
    max_connections_per_grant: int = 16
    statement_timeout_ms: int = 5000
    # Check every incremental window read against a full sum (tests; the pair
    # assertion). Costs O(window) per move: off in production.
    verify_windows: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("LEDGER_VERIFY_WINDOWS") == "1"
    )
    # Group commit: at most this many moves share one durable commit, SQLite's
    # or, on PostgreSQL, one lane's in one replica (1: one commit per move).
    group_commit_batch: int = 64
    # Bounded retries of serialization failures and deadlocks.
    max_transaction_retries: int = 5
    # Health: how often a probe asks the database, and how long each may wait
    # for an answer before health turns NOT_SERVING.
    health_check_interval_seconds: float = 1.0
    health_check_timeout_seconds: float = 2.0
    # Expiry sweeper: how often it looks, and how many holds per transaction.
    sweep_interval_seconds: float = 1.0
    sweep_batch_size: int = 500
    # Paging and tailing.
    default_page_size: int = 100
    max_page_size: int = 1000
    watch_poll_interval_seconds: float = 0.2
    watch_batch_size: int = 500
    # WatchEvents streams open at once: in all, and for one grant. The pool
    # has a thread for each beside max_workers; past max_workers other calls
    # at once, streams share the pool's threads with them.
    max_watchers: int = 64
    max_watchers_per_grant: int = 16
    # Reconciles served at once (dry runs included); one more waits for a turn
    # at most request_deadline_seconds (or its caller's deadline), then gets
    # STORE_UNAVAILABLE. Each parses up to 10,000 rows and holds them and its
    # report in memory, and on SQLite each holds the one writer while it runs:
    # unbounded, 24 at once took the server from 284 to 854 MiB and 21 of them
    # still ran out of time waiting for the writer.
    max_concurrent_reconciles: int = 2
    # The newest events kept in memory for the streams (application/feed.py),
    # and how long a stream whose reader takes nothing may stay blocked.
    watch_buffer_events: int = 10_000
    watch_stall_seconds: float = 30.0
    # gRPC keepalive: the server pings a connection this long idle and drops
    # it when the ping goes unanswered as long again. A stream whose reader
    # froze (a paused VM, a silent partition) on a quiet lane has no event
    # waiting, so only this gives its slot back.
    keepalive_seconds: float = 20.0
    # How often a client may ping a connection on which the server sent nothing
    # since: the lane clients ping every 5 s to find a frozen replica. A peer
    # pinging faster is sent GOAWAY (too_many_pings) at its third early ping.
    # At least 1 s: each ping costs the server a write.
    client_ping_min_interval_seconds: float = 4.0
    # Recovery (docs/recovery.md). A snapshot of the projections every this many
    # events (0: none), the newest snapshot_keep kept.
    snapshot_every_events: int = 10_000
    snapshot_keep: int = 2
    # The planner's policy when the projections need rebuilding at start.
    recovery_budget_seconds: float = 300.0
    recovery_max_risk: float = 0.3
    recovery_min_viable_sources: int = 1
    # Events per rebuild batch (and rows per snapshot chunk); events in the
    # sample that measures the replay rate.
    recovery_batch_events: int = 1000
    recovery_sample_events: int = 2000
    # Seqs per range of a rebuild's replay: a checking process's unit of work
    # and one fold statement. Larger ranges cost less per event in hand-offs
    # and statements; a process holds one range's rows at a time.
    recovery_replay_range_events: int = 5000
    # Processes that check events' hashes while a rebuild of at least 50,000
    # events folds them (0: the rebuild's own thread checks them).
    recovery_check_processes: int = 2
    # While refusing moves: how often to look again; while serving: how often
    # to check the projections against the log (0: never).
    recovery_check_interval_seconds: float = 5.0
    consistency_check_interval_seconds: float = 60.0
    # A rebuild whose marker has not moved for this long is taken as dead.
    rebuild_lease_seconds: float = 30.0
    # Where each value from_environment took came from: a flag or a variable
    # (SERVE_FLAGS, setting_variable). Not a setting; see source().
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def rpc_threads(self) -> int:
        """The server's pool: a thread for each stream it admits, one for each
        place of grant_calls_total, and a quarter of max_workers (at least
        one) for calls of no grant (health checks, reflection) and refusals on
        their way out. 276 at the defaults."""
        return self.max_watchers + self.grant_calls_total + max(1, self.max_workers // 4)

    @property
    def reflection_streams(self) -> int:
        """Reflection streams open at once (api/reflection.py): half the pool's
        threads for calls of no grant, so that health checks keep the rest."""
        return max(1, self.max_workers // 8)

    @property
    def grant_calls_total(self) -> int:
        """Calls of all grants together running at once (api/shares.py): two
        grants' shares and max_workers more, so two lane clients at their own
        bound (64 each) never meet it. 208 at the defaults."""
        return 2 * self._call_share + self.max_workers

    @property
    def grant_calls_reserved(self) -> int:
        """The last of grant_calls_total's places, past two grants' shares:
        only a grant running few calls gets one (max_workers, 16 at the defaults)."""
        return self.max_workers

    @property
    def _call_share(self) -> int:
        return min(self.max_calls_per_grant, self.max_concurrent_rpcs)

    @property
    def on_postgresql(self) -> bool:
        return self.database_url.startswith("postgresql")

    @property
    def pool_connections(self) -> int:
        """PostgreSQL: the connections of the server's pool, its overflow included."""
        return self.pool_size + self.pool_max_overflow

    def source(self, name: str) -> str:
        """What a refusal of setting `name` names: the flag or the variable its
        value came from; for a Settings built in code, its flag if it has one."""
        if name in self.sources:
            return self.sources[name]
        return SERVE_FLAGS.get(name) or setting_variable(name)

    def __post_init__(self) -> None:
        """Refuses a number no server could run with, naming the setting: a
        negative count, a zero interval, NaN. Raises ValueError."""
        for field in dataclasses.fields(self):
            kind = type(field.default)
            if kind not in (int, float):
                continue  # the switches (bool defaults) and the paths
            value = getattr(self, field.name)
            name = f"{field.name} ({self.source(field.name)})"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
            if field.name in _POSITIVE and value <= 0:
                raise ValueError(f"{name} must be above 0")
            if value < 0:
                raise ValueError(f"{name} must not be negative")
            if field.name.endswith("_seconds") and value > MAX_SETTING_SECONDS:
                # Past what a thread can wait or a grant may live.
                raise ValueError(f"{name} must be at most {MAX_SETTING_SECONDS} (3,660 days)")
            if kind is int and value > MAX_SETTING_COUNT:
                # gRPC's channel options and PostgreSQL's settings are C ints.
                raise ValueError(f"{name} must be at most {MAX_SETTING_COUNT}")
        _check_listen(self.listen, self.source("listen"))
        if not (
            MIN_CLIENT_PING_INTERVAL_SECONDS
            <= self.client_ping_min_interval_seconds
            <= MAX_CLIENT_PING_INTERVAL_SECONDS
        ):
            raise ValueError(
                f"client_ping_min_interval_seconds ({self.source(_PING)}) "
                f"must be at least {MIN_CLIENT_PING_INTERVAL_SECONDS:g} and at most "
                f"{MAX_CLIENT_PING_INTERVAL_SECONDS:g}, the lane clients' ping interval"
            )
        if self.recovery_max_risk > 1:
            raise ValueError(
                f"recovery_max_risk ({self.source('recovery_max_risk')}) must be at most 1"
            )
        if self.max_metadata_bytes < MIN_METADATA_BYTES:
            raise ValueError(
                f"max_metadata_bytes ({self.source('max_metadata_bytes')}) must be at least "
                f"{MIN_METADATA_BYTES}, room for a grant and the trace headers"
            )
        if self.default_page_size > self.max_page_size:
            raise ValueError("default_page_size must not exceed max_page_size")
        self._check_pool_share()
        for larger, instead in _ABOVE_MAX_WATCHERS:
            if getattr(self, larger) <= self.max_watchers:
                raise ValueError(
                    f"{larger} ({self.source(larger)}), {getattr(self, larger)}, must be above "
                    f"max_watchers ({self.source('max_watchers')}), {self.max_watchers}: else "
                    f"{instead} instead of getting TOO_MANY_WATCHERS"
                )

    def _check_pool_share(self) -> None:
        """PostgreSQL: one grant's share of the pool leaves the others some."""
        pool = self.pool_connections
        if self.max_connections_per_grant < pool or not self.on_postgresql:
            return
        raise ValueError(
            f"max_connections_per_grant ({self.source('max_connections_per_grant')}), "
            f"{self.max_connections_per_grant}, must be below the pool's connections, "
            f"pool_size ({self.source('pool_size')}) + pool_max_overflow "
            f"({self.source('pool_max_overflow')}), {pool}: else one grant's calls "
            "waiting on a slow lane take every connection and the other lanes wait for one"
        )

    @classmethod
    def from_environment(cls, **overrides: object) -> Settings:
        """Builds settings from LEDGER_* variables, then explicit overrides."""
        data_dir = data_dir_from_environment()
        if overrides.get("data_dir") is not None:
            overrides["data_dir"] = pathlib.Path(str(overrides["data_dir"])).expanduser()
        values: dict[str, object] = {
            "data_dir": data_dir,
            "database_url": os.environ.get("LEDGER_DATABASE_URL") or default_database_url(data_dir),
            "listen": os.environ.get("LEDGER_LISTEN", DEFAULT_LISTEN),
        }
        for name, variable in TLS_ENVIRONMENT.items():
            if os.environ.get(variable):
                values[name] = pathlib.Path(os.environ[variable]).expanduser()
        values.update(_numbers_from_environment())
        given = {key: value for key, value in overrides.items() if value is not None}
        values.update(given)
        # Where each value came from, for a refusal to name (source()).
        sources = {
            name: setting_variable(name)
            for name in values
            if os.environ.get(setting_variable(name))
            or (name == "listen" and "LEDGER_LISTEN" in os.environ)
        }
        sources.update({name: SERVE_FLAGS[name] for name in given if name in SERVE_FLAGS})
        values["sources"] = sources
        if (
            "data_dir" in overrides
            and overrides["data_dir"] is not None
            and not (os.environ.get("LEDGER_DATABASE_URL") or overrides.get("database_url"))
        ):
            values["database_url"] = default_database_url(pathlib.Path(str(overrides["data_dir"])))
        values["database_url"] = home_expanded(str(values["database_url"]))
        problem = database_url_problem(str(values["database_url"]))
        if problem is not None:
            source = sources.get(
                "database_url",
                f"the default database URL {values['database_url']} (from the data directory)",
            )
            raise ValueError(f"{source} {problem}")
        return cls(**values)  # type: ignore[arg-type]


# Numbers that must be above 0; every other one may be 0 (where 0 means none,
# never or no wait, as each setting's comment says) but never negative.
_POSITIVE = frozenset(
    {
        "admin_grant_lifetime_seconds",
        "max_workers",
        "max_concurrent_rpcs",
        "max_calls_per_connection",
        "max_connections",
        "max_calls_per_grant",
        "max_message_bytes",
        "max_metadata_bytes",
        "request_deadline_seconds",
        "request_arrival_seconds",
        "pool_size",
        "pool_timeout_seconds",
        "max_connections_per_grant",
        "statement_timeout_ms",
        "group_commit_batch",
        "health_check_interval_seconds",
        "health_check_timeout_seconds",
        "sweep_interval_seconds",
        "sweep_batch_size",
        "default_page_size",
        "max_page_size",
        "watch_poll_interval_seconds",
        "watch_batch_size",
        "max_watchers_per_grant",
        "max_concurrent_reconciles",
        "watch_buffer_events",
        "watch_stall_seconds",
        "keepalive_seconds",
        "client_ping_min_interval_seconds",
        "snapshot_keep",
        "recovery_batch_events",
        "recovery_sample_events",
        "recovery_replay_range_events",
        "recovery_check_interval_seconds",
        "rebuild_lease_seconds",
    }
)


def is_host(host: str) -> bool:
    """A name, an IPv4 address or a bracketed IPv6 one: no space, brackets that
    close, and a colon only inside them ('::1:50051' is ambiguous). Else gRPC
    takes it and fails as if the port were taken or nobody answered."""
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (
        bool(inner)
        and not any(c.isspace() or c in "[]" for c in inner)
        and (inner is not host or ":" not in host)
    )


def _check_listen(listen: str, source: str) -> None:
    """HOST:PORT with a port from 0 to 65535. Raises ValueError: grpcio itself
    takes '127.0.0.1:99999' and listens on some other port, unsaid."""
    host, colon, port = listen.rpartition(":")
    if not (is_host(host) and colon and port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(
            f"listen ({source}): {listen[:100]!r} is not HOST:PORT "
            "with a port from 0 to 65535 (0 picks a free one)"
        )


def _numbers_from_environment() -> dict[str, object]:
    """Every numeric limit may be set as LEDGER_<NAME>, e.g. LEDGER_POOL_SIZE=32
    or LEDGER_STATEMENT_TIMEOUT_MS=2000. The switches (auth_enabled, test_clock)
    are not: only their `ledger serve` flags turn auth off or the clock manual
    (docs/security.md), so no stray variable does it unseen."""
    values: dict[str, object] = {}
    for field in dataclasses.fields(Settings):
        if field.default is dataclasses.MISSING:
            continue
        kind = type(field.default)
        raw = os.environ.get(f"LEDGER_{field.name.upper()}")
        if raw is None or kind not in (int, float):
            continue
        try:
            values[field.name] = kind(raw)
        except ValueError as error:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(
                f"LEDGER_{field.name.upper()} must be {what}, not {raw[:40]!r}"
            ) from error
    return values


# LEDGER_* variables read elsewhere than Settings: by the `ledger` commands
# (README, Configuration), the project's own tests and benchmark, and the
# Node client's examples; none of them is a mistake in a server's environment.
_OTHER_VARIABLES = frozenset(
    {
        "LEDGER_SERVER",
        "LEDGER_GRANT",
        "LEDGER_TLS_CA",
        "LEDGER_TLS_CLIENT_CERT",
        "LEDGER_TLS_CLIENT_KEY",
        "LEDGER_TLS_SERVER_NAME",
        "LEDGER_CLIENT_KEEPALIVE_SECONDS",
        "LEDGER_VERIFY_WINDOWS",
        "LEDGER_ADDRESS",
        "LEDGER_BIN",
        "LEDGER_TEST_POSTGRES_URL",
        "LEDGER_BENCH_POSTGRES_URL",
        "LEDGER_FUZZ_SEED",
    }
)


def read_variables() -> frozenset[str]:
    """Every LEDGER_* variable some part of the ledger reads."""
    numbers = {
        f"LEDGER_{field.name.upper()}"
        for field in dataclasses.fields(Settings)
        if field.default is not dataclasses.MISSING and type(field.default) in (int, float)
    }
    own = {"LEDGER_DATA_DIR", "LEDGER_DATABASE_URL", "LEDGER_LISTEN", *TLS_ENVIRONMENT.values()}
    return frozenset(numbers | own | _OTHER_VARIABLES)


def unread_variables(environment: Mapping[str, str]) -> list[str]:
    """A sentence for each LEDGER_* variable nothing reads (a misspelled name, or a
    switch only a flag sets), naming the closest one that is read: such a variable
    was ignored without a word, and the server ran on the default it was meant to
    change."""
    known = read_variables()
    said = []
    for name in sorted(environment):
        if not name.startswith("LEDGER_") or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        meant = f" (did you mean {close[0]}?)" if close else ""
        said.append(f"{name[:100]} is not a setting the ledger reads{meant}: ignored")
    return said


def grpc_server_options(
    settings: Settings, max_connections: int | None = None
) -> list[tuple[str, int]]:
    """The channel options of the ledger's grpc.server; the benchmark's echo
    baseline uses the same ones (without importing the server).
    `max_connections`: the bound the server could fit in its open-file limit
    (server.py), when lower than the setting's."""
    # gRPC takes milliseconds as a C int: past 24.8 days is taken as that.
    keepalive_ms = min(MAX_SETTING_COUNT, max(1, round(settings.keepalive_seconds * 1000)))
    client_ping_ms = min(MAX_SETTING_COUNT, round(settings.client_ping_min_interval_seconds * 1000))
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_metadata_size", settings.max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", settings.max_metadata_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", settings.max_calls_per_connection),
        ("grpc.max_allowed_incoming_connections", max_connections or settings.max_connections),
        # Pings find a peer that stopped answering; gRPC's default is none
        # (2 hours), and two pings without data, which a quiet stream is.
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        ("grpc.http2.ping_timeout_ms", keepalive_ms),
        ("grpc.http2.max_pings_without_data", 0),
        # Clients' own pings (the lane clients', `ledger history --follow`'s),
        # idle connections included, no more often than client_ping_ms.
        # The C core's name for GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS:
        # "min_recv_ping_..." is read by nothing, and left the 5-minute default.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", client_ping_ms),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT (or a bare host) is loopback only: 127.0.0.0/8, ::1
    (bracketed with a port, or bare) or localhost."""
    if address.startswith("["):
        host = address[1:].partition("]")[0]
    elif address.count(":") == 1:
        host = address.partition(":")[0]
    else:
        host = address  # no port, or a bare IPv6 address
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
