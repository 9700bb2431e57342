"""The server process: wiring, health, reflection, the sweeper, graceful stop.

Health reports SERVING only once the database answers, and NOT_SERVING while it
does not or while the server is shutting down. A thread of its own probes the
database every health_check_interval_seconds, each probe bounded by
health_check_timeout_seconds, so a database that stops answering turns health
NOT_SERVING even while the sweeper or a recovery check waits on it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from types import FrameType
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from ledger_service.api import tracing
from ledger_service.api.arrival import ArrivalWatch, RequestArrivalInterceptor
from ledger_service.api.auth import AuthInterceptor, current_grant_id
from ledger_service.api.deadlines import CallDeadlineInterceptor
from ledger_service.api.drain import Drain
from ledger_service.api.errors import ErrorInterceptor
from ledger_service.api.gate import RecoveryGateInterceptor
from ledger_service.api.health import HealthServicer
from ledger_service.api.pipeline import MethodPipeline
from ledger_service.api.reflection import BoundedReflectionServicer
from ledger_service.api.servicers import (
    AbsentTestClockServicer,
    LaneAdminServicer,
    LedgerServicer,
    TestClockServicer,
)
from ledger_service.api.shares import CallShares, GrantShareInterceptor
from ledger_service.application.audit import Auditor
from ledger_service.application.feed import EventFeed, FeedLimits
from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import Clock, ManualClock, SteadyClock, SystemClock
from ledger_service.domain.counts import counted
from ledger_service.domain.errors import RecoveryRequired, StoreDamaged, StoreUnavailable
from ledger_service.domain.grants import Keyring, Scope, key_id_of
from ledger_service.generated.ledger.v1 import ledger_pb2, ledger_pb2_grpc
from ledger_service.recovery.plan import RecoveryPolicy
from ledger_service.recovery.rebuild import Recovery, RecoveryGuard, RecoverySettings
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.settings import Settings, either_source, grpc_server_options, is_loopback
from ledger_service.storage import database, keyring, migrate, translate
from ledger_service.storage.pool_shares import PoolShares
from ledger_service.storage.sql import SqlStore
from ledger_service.telemetry import Telemetry, configure_telemetry

if TYPE_CHECKING:  # imported at run time only with TLS (server_tls)
    from ledger_service.tls_files import ServerTls

log = logging.getLogger("ledger.server")

# File descriptors the server keeps beside its client connections: the
# database's files and pool, the log, the keyring, TLS files, gRPC's pipes.
CONNECTION_FD_HEADROOM = 256


def connection_bound(max_connections: int) -> int:
    """The client connections this process may hold: `max_connections`, with
    the open-file limit raised to fit them and CONNECTION_FD_HEADROOM more
    when the hard limit allows; else as many as fit, with a WARNING. Silent
    connections past the open-file limit took every descriptor, and with
    them every new client's connection and the database's files."""
    needed = max_connections + CONNECTION_FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    bound = max(1, soft - CONNECTION_FD_HEADROOM)
    log.warning(
        "the open-file limit (%d, hard %d) fits %d client connections, not max_connections "
        "(%d): serving at most %d; raise the limit (ulimit -n, LimitNOFILE=)",
        soft,
        hard,
        bound,
        max_connections,
        bound,
    )
    return bound


# How often `serve` looks for a stop signal that reached another thread.
SIGNAL_POLL_SECONDS = 0.2
# How long past its grace period a stop still waits for its own threads and
# the last commit before it abandons them (and the process exits regardless).
STOP_SECONDS = 1.0
# How long grpcio's stop waits, at the least, before it cancels the calls
# still running: the calls held by the drain are answered meanwhile. Within
# STOP_SECONDS.
ANSWER_HELD_SECONDS = 0.2
# `ledger serve`'s status after a stop that cut work off: a call still running
# at the grace limit or at a second signal, a thread or commit that did not end
# within STOP_SECONDS more, or a database that failed to close. 0 is a clean
# stop; 1 a listen address it could not bind; 2 a refused configuration.
EXIT_CUT_OFF = 3

SERVICE_NAMES = tuple(
    ledger_pb2.DESCRIPTOR.services_by_name[name].full_name
    for name in ("Ledger", "LaneAdmin", "TestClock")
)


class ListenFailed(Exception):
    """The server could not bind its address."""


def cannot_listen_text(listen: str, *, tls: bool) -> str:
    """Why `listen` could not be bound, and what to do about it."""
    causes = ["the port is taken (is another ledger running?)"]
    causes.append("the address is not this machine's")
    if tls:
        causes.append("its TLS certificate and key do not match")
    return (
        f"cannot listen on {listen}: {', '.join(causes[:-1])} or {causes[-1]}; "
        "choose another with --listen HOST:PORT or LEDGER_LISTEN (and point the "
        "ledger commands at it with LEDGER_SERVER)"
    )


def refuse_an_address_nobody_can_bind(listen: str) -> None:
    """Raises ListenFailed when no address `listen` resolves to can be bound now,
    before the server makes a keyring or a database, or migrates one: a start
    that cannot listen changes nothing. grpcio binds the address again at start
    (and says the same when it cannot), so a port taken in between is still refused."""
    host, port = listen.rsplit(":", 1)
    if int(port) == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return  # Left to grpcio, which says what it finds.
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            # As grpcio binds: a port whose last connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError:
                continue
            return  # grpcio listens when one of the addresses binds.
    raise ListenFailed(cannot_listen_text(listen, tls=False))


def build_store(settings: Settings, *, logs_damage: bool = True) -> SqlStore:
    """The store a server or command uses; `logs_damage`: off in a command, whose
    own line says what is damaged."""
    if settings.on_postgresql and settings.max_workers > settings.pool_connections:
        # It works, but a busy server's calls past the pool wait for a connection.
        log.warning(
            "max_workers (%d) is above the database pool's connections, pool_size + "
            "pool_max_overflow (%d): calls past the pool wait up to pool_timeout_seconds "
            "for a connection; raise LEDGER_POOL_SIZE with LEDGER_MAX_WORKERS",
            settings.max_workers,
            settings.pool_connections,
        )
    engine = database.create(
        settings.database_url,
        database.EngineLimits(
            pool_size=settings.pool_size,
            pool_max_overflow=settings.pool_max_overflow,
            pool_timeout_seconds=settings.pool_timeout_seconds,
            statement_timeout_ms=settings.statement_timeout_ms,
        ),
    )
    return SqlStore(
        engine,
        max_transaction_retries=settings.max_transaction_retries,
        request_deadline_seconds=settings.request_deadline_seconds,
        group_commit_batch=settings.group_commit_batch,
        pool_shares=PoolShares(
            settings.max_connections_per_grant, settings.pool_connections, current_grant_id
        ),
        logs_damage=logs_damage,
    )


def _resume_after_last_event(clock: ManualClock | SteadyClock, ledger: Ledger) -> None:
    """A server's clock starts at wall time. Restarted behind what the ledger
    has recorded (a test clock, or a system clock stepped back), it resumes at
    the last event: a ledger's time never runs backwards, and a hold booked
    ahead of the wall keeps counting."""
    try:
        last_us = ledger.last_event_at_us()
    except StoreUnavailable as error:
        why = translate.unavailable_words(error, "the database does not answer")
        log.warning("the clock starts at wall time: %s", why)
        return
    clock.resume_at(last_us)


def _warn_new_keyring_beside_a_ledger(settings: Settings, ledger: Ledger) -> None:
    """A keyring made at this start beside a database that already holds a
    ledger: the data directory moved (LEDGER_DATA_DIR changed, the database
    URL kept) or its keyring was lost, and every grant issued before is
    refused. Said at start, with what to do, not first by the lanes."""
    try:
        events = ledger.last_seq()
    except StoreUnavailable:
        return
    if events == 0:
        return
    log.warning(
        "the database %s holds a ledger (%s), but its grant keyring is new (%s): "
        "every grant issued before this start is refused (UNAUTHENTICATED). If the data "
        "directory moved, copy its grant-keys.json over this one (taken within a health "
        "check), or restart with LEDGER_DATA_DIR (--data-dir) naming it; otherwise issue "
        "the lanes new grants (docs/security.md)",
        database.redacted(settings.database_url),
        counted(events, "event"),
        keyring.keyring_path(settings.data_dir),
    )


class LedgerServer:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        run_migrations: bool = True,
        telemetry: Telemetry | None = None,
        transport: Callable[..., grpc.Server] = grpc.server,
    ) -> None:
        """`transport` builds the gRPC server, with grpc.server's arguments (the
        benchmark measures grpc.aio through it: bench/aio.py)."""
        self.settings = settings
        self._new_grpc_server = transport
        if not settings.auth_enabled and not is_loopback(settings.listen):
            raise ValueError("--insecure-no-auth is refused unless the server listens on loopback")
        recovery_policy(settings)  # refused here, before any file is made
        # Certificate expiry follows the real clock, as grant expiry does.
        self._tls = server_tls(settings, SystemClock())
        self.server_credentials = None if self._tls is None else self._tls.credentials()
        # From the OTEL_* variables unless given (tests); shut down with the server if ours.
        self.telemetry = telemetry or configure_telemetry()
        self._owns_telemetry = telemetry is None
        fresh_test_clock = ManualClock() if clock is None and settings.test_clock else None
        if clock is None:
            clock = fresh_test_clock or SystemClock()
        resuming: ManualClock | SteadyClock | None = fresh_test_clock
        if not settings.test_clock:
            clock = resuming = SteadyClock(clock)
        self.clock = clock
        empty = database.empty_sqlite_file(settings.database_url) if run_migrations else None
        if empty is not None:
            # Before the store opens it: a migration would make a new ledger in it.
            raise ValueError(
                f"{database.empty_file_text(empty)}, and a ledger may have been lost: if one "
                "was there, restore it from a backup; to start a new ledger in it, run "
                "`ledger migrate` (docs/recovery.md)"
            )
        lost_wal = database.lost_wal_text(settings.database_url)
        if lost_wal:
            raise ValueError(lost_wal)  # before SQLite opens the file and resets its -shm
        # SQLite: the keyring before the store. A data directory that is a
        # file, or one this process may not write, is refused here in one line
        # (exit 2), before the store fails on the same path and logs that it
        # will retry. PostgreSQL's store does not use the directory: the
        # database is asked first, so that a URL it refuses makes no keyring.
        if not settings.on_postgresql:
            self._keyring_file = keyring.KeyringFile(settings.data_dir)
        self.store = build_store(settings)
        # Without migrations, the schema's revision is still read: a newer
        # release's, or an older one's not yet migrated, is refused at start
        # (exit 2), never served.
        schema_step = _upgrade if run_migrations else _check_revision
        unreached = self._first_schema_step(schema_step)
        if settings.on_postgresql:
            try:
                self._keyring_file = keyring.KeyringFile(settings.data_dir)
            except BaseException:
                self.store.close()
                raise
        # The schema brought up to date now, or, when the database cannot be
        # reached (or is damaged), by the recovery guard before its first look:
        # the server comes up NOT_SERVING and tries again, never a traceback.
        pending_migration: Callable[[], None] | None = None
        if unreached is not None:
            _log_schema_pending(settings, unreached, run_migrations)
            pending_migration = functools.partial(self._prepare_late, schema_step, resuming)
        self.ledger = Ledger(
            self.store,
            clock,
            max_page_size=settings.max_page_size,
            verify_windows=settings.verify_windows,
        )
        if resuming is not None and pending_migration is None:
            _resume_after_last_event(resuming, self.ledger)
        if self._keyring_file.created and pending_migration is None:
            _warn_new_keyring_beside_a_ledger(settings, self.ledger)
        # One reader of the log's tail for every WatchEvents stream.
        self.feed = EventFeed(
            self.ledger.read_events,
            self.ledger.last_seq,
            self.ledger.signal,
            FeedLimits(
                max_streams=settings.max_watchers,
                max_streams_per_owner=settings.max_watchers_per_grant,
                buffer_events=settings.watch_buffer_events,
                batch_events=settings.watch_batch_size,
                poll_interval_seconds=settings.watch_poll_interval_seconds,
                stall_seconds=settings.watch_stall_seconds,
            ),
        )
        # Serves moves only while the projections are whole (docs/recovery.md).
        self.guard = recovery_guard(
            settings, self.store, self._on_recovery_change, prepare=pending_migration
        )
        self.health = HealthServicer(SERVICE_NAMES)
        self._stopping = threading.Event()
        # Set by `hurry`: the stop's drain ends now.
        self._hurried = threading.Event()
        # Set while the health probe finds the database answering.
        self._database_answers = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="sweeper", daemon=True)
        self._health_probe = threading.Thread(target=self._probe, name="health", daemon=True)
        # For the local CLI and in-process tests: an admin grant, issued afresh every
        # start, and written to its file only once the server listens (start).
        self.admin_grant = issue_admin_grant(settings, self.keyring)
        # Never read back: a system clock stepped back must not revive an expired grant.
        self._auth = AuthInterceptor(self.keyring, SteadyClock(SystemClock()))
        self._tracing, self._messages = tracing.interceptors(
            self.telemetry.tracer, self.telemetry.meter, records_spans=self.telemetry.records_spans
        )
        self._drain = Drain()
        self.call_shares = CallShares(
            settings.max_calls_per_grant, settings.grant_calls_total, settings.grant_calls_reserved
        )
        self._arrivals = ArrivalWatch(
            settings.request_arrival_seconds, settings.max_workers, threads=settings.rpc_threads
        )
        self._server = self._build_grpc_server()
        self.port = 0

    def _first_schema_step(
        self, schema_step: Callable[[SqlStore], None]
    ) -> StoreUnavailable | None:
        """Runs `schema_step` once; the outage (or damage) that stopped it, for
        the server to come up NOT_SERVING through. A schema of another release,
        or a URL the database refuses (it does not exist, a role refused: no
        retry mends it), ends the start, exit 2 in one line."""
        try:
            schema_step(self.store)
        except migrate.RevisionRefused:
            self.store.close()
            raise
        except StoreUnavailable as error:
            wrong = translate.misconfigured(error)
            if wrong is not None:
                self.store.close()
                raise ValueError(": ".join(wrong)) from None
            return error
        return None

    def _build_grpc_server(self) -> grpc.Server:
        settings = self.settings
        # Tracing outermost, so a call refused by the arrival bound, auth or the
        # error table is traced with its status; the message observer
        # innermost, on decoded messages.
        chain = [
            self._tracing,
            # grpcio must see each one-message method as a request stream (tracing
            # keeps the shape), so that a request that never arrives holds no thread.
            RequestArrivalInterceptor(self._arrivals),
            ErrorInterceptor(),
            # Inside the error table (SHUTTING_DOWN is its row), before any work.
            self._drain,
            # The caller's deadline bounds the store's work (storage/watchdog.py).
            CallDeadlineInterceptor(),
            *self._auth_interceptors(),
            RecoveryGateInterceptor(self._ready_for_moves, self.guard.required),
            self._messages,
        ]
        server = self._new_grpc_server(
            # A thread for each stream and for each place of the grants'
            # calls (Settings.rpc_threads): streams never wait for one, and
            # lanes that flood the server leave the others threads (api/shares.py).
            futures.ThreadPoolExecutor(max_workers=settings.rpc_threads, thread_name_prefix="rpc"),
            # Composed once per method, not on every call (api/pipeline.py).
            interceptors=[MethodPipeline(chain)],
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
            options=grpc_server_options(settings, connection_bound(settings.max_connections)),
        )
        ledger_pb2_grpc.add_LedgerServicer_to_server(
            LedgerServicer(self.ledger, settings, self.feed, Auditor(self.store, self.clock)),
            server,
        )
        ledger_pb2_grpc.add_LaneAdminServicer_to_server(
            LaneAdminServicer(self.ledger, settings), server
        )
        names = [SERVICE_NAMES[0], SERVICE_NAMES[1]]
        if settings.test_clock:
            assert isinstance(self.clock, ManualClock), "--test-clock needs a ManualClock"
            ledger_pb2_grpc.add_TestClockServicer_to_server(
                TestClockServicer(self.clock, self.ledger), server
            )
            names.append(SERVICE_NAMES[2])
        else:
            # Answers UNIMPLEMENTED, after the grant check and traced (not listed
            # by reflection): an unregistered service would skip both.
            ledger_pb2_grpc.add_TestClockServicer_to_server(AbsentTestClockServicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            BoundedReflectionServicer(
                (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), settings.reflection_streams
            ),
            server,
        )
        self._service_names = names
        return server

    @property
    def keyring(self) -> Keyring:
        """The keys in force: the keyring file as last read."""
        return self._keyring_file.keyring

    def _auth_interceptors(self) -> list[grpc.ServerInterceptor[Any, Any]]:
        """The grant check, and after it, where the grant is known and before
        any store work, each grant's share of the calls (api/shares.py).
        Without grants there is no share to hold a call to: neither is composed."""
        if not self.settings.auth_enabled:
            return []
        return [self._auth, GrantShareInterceptor(self.call_shares)]

    def _reload_keyring(self) -> None:
        """A rotated or retired key takes effect here within a health interval;
        the local admin grant is issued again when its key is no longer the
        signing key."""
        changed = self._keyring_file.changed()
        if changed is None:
            return
        self._auth.use(changed)
        log.info(
            "keyring reloaded: %s, %s signs",
            counted(len(changed.keys), "key"),
            changed.signing_key_id,
        )
        if key_id_of(self.admin_grant) != changed.signing_key_id:
            self.admin_grant = issue_admin_grant(self.settings, changed)
            write_admin_grant(self.settings, self.admin_grant)

    def start(self) -> int:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if self.server_credentials is None:
                self.port = self._server.add_insecure_port(self.settings.listen)
            else:
                self.port = self._server.add_secure_port(
                    self.settings.listen, self.server_credentials
                )
        except RuntimeError:  # grpcio's "Failed to bind to address"
            self.port = 0
        if self.port == 0:
            raise ListenFailed(
                cannot_listen_text(self.settings.listen, tls=self.server_credentials is not None)
            )
        # The address bound: port 0 in the settings picks one.
        bound = f"{self.settings.listen.rsplit(':', 1)[0]}:{self.port}"
        if not self.settings.auth_enabled:
            log.warning("AUTH IS OFF (--insecure-no-auth): anyone who reaches %s can spend "
                        "every lane's budget", bound)  # fmt: skip
        elif self.server_credentials is None and not is_loopback(self.settings.listen):
            log.warning("PLAINTEXT beyond loopback on %s: grants and amounts cross the "
                        "network readable by anyone on the path; serve TLS (--tls-cert, "
                        "--tls-key)", bound)  # fmt: skip
        self._check_certificate_expiry()
        self._tracing.listening_on(self.settings.listen.rsplit(":", 1)[0], self.port)
        log.info("telemetry: %s", self.telemetry.description)
        self._server.start()
        self.feed.start()
        self.store.check_writable()
        self.guard.start()
        self._check_database()
        self._health_probe.start()
        self._maintenance.start()
        # Only now: a start that fails (the port taken by the server already running
        # on this data directory) leaves the grant file to the server it belongs to.
        write_admin_grant(self.settings, self.admin_grant)
        host = self.settings.listen.rsplit(":", 1)[0]
        log.info(
            "listening on %s:%d (%s, database %s%s)",
            host,
            self.port,
            _transport(self.settings),
            database.redacted(self.settings.database_url),
            ", TEST CLOCK" if self.settings.test_clock else "",
        )
        return self.port

    def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        self.health.set("", status)
        for name in self._service_names:
            self.health.set(name, status)

    def _ready_for_moves(self) -> bool:
        """The gate's question. A damaged store answers with its own error, not
        with RECOVERY_REQUIRED: no recovery can run until an operator repairs it;
        and so does a database that does not answer."""
        damage = self.store.damage
        if damage is not None:
            raise StoreDamaged(damage.what, damage.advice)
        ready = self.guard.is_ready()
        if not ready and not self._database_answers.is_set():
            # Nothing is being recovered: the database does not answer (an
            # outage, a file SQLite cannot open). Said as the log says it.
            raise StoreUnavailable()
        steps = "" if ready else self.guard.operator_steps()
        if steps:
            # The planner refused: nothing recovers until an operator acts.
            raise RecoveryRequired(steps)
        return ready

    def _check_database(self) -> bool:
        """Whether the database answers within the health check's bound; health
        NOT_SERVING when not. A damaged store (the store logs what and what to
        do, once) stays NOT_SERVING, and the maintenance thread stops its
        recovery checks and sweeps."""
        try:
            # A stop ends the probe's wait for another process's write lock.
            self.store.ping(
                timeout_seconds=self.settings.health_check_timeout_seconds, stop=self._stopping
            )
        except (StoreDamaged, StoreUnavailable) as error:
            if self._database_answers.is_set():
                what = (
                    "is damaged"
                    if isinstance(error, StoreDamaged)
                    else "does not answer, or refuses a connection or a write (the lines "
                    "before this one say which)"
                )
                log.warning("health: the database %s; NOT_SERVING", what)
            self._database_answers.clear()
            if not self._stopping.is_set():
                self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            return False
        if not self._database_answers.is_set():
            log.info("health: the database answers")
        self._database_answers.set()
        if not self._stopping.is_set():
            self._on_recovery_change(self.guard.is_ready())
        return True

    def _on_recovery_change(self, ready: bool) -> None:
        if not self._stopping.is_set():
            serving = ready and self._database_answers.is_set()
            self._set_health(
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )

    def _probe(self) -> None:
        """Probes the database until stopped (health follows each answer)."""
        while not self._stopping.wait(self.settings.health_check_interval_seconds):
            self._check_database()
            try:
                self._reload_keyring()
            except Exception:
                log.exception("keyring check failed; the keys in force stay")
            self._check_certificate_expiry()

    def _check_certificate_expiry(self) -> None:
        """At start and at every health check; says something at most once a day."""
        if self._tls is None:
            return
        try:
            self._tls.check_expiry()
        except Exception:
            log.exception("certificate expiry check failed")

    def _maintain(self) -> None:
        """Sweeps expired holds while the database answers, until stopped. It
        turns at the shorter of the sweep's and the recovery checks' intervals,
        so that a slow sweep (`--sweep-interval 3600`) does not hold back the
        checks a refused server serves again by (docs/recovery.md)."""
        sweep_every = self.settings.sweep_interval_seconds
        turn = min(sweep_every, self.settings.recovery_check_interval_seconds)
        next_sweep = time.monotonic() + sweep_every
        while not self._stopping.wait(max(turn, 0.01)):
            if not self._database_answers.is_set():
                continue
            # Recovery checks and snapshots; no sweep unless the projections are whole.
            self.guard.tick()
            if not self.guard.is_ready() or time.monotonic() < next_sweep:
                continue
            next_sweep = time.monotonic() + sweep_every
            try:
                while not self._stopping.is_set():
                    expired = self.ledger.sweep(self.settings.sweep_batch_size)
                    if expired:
                        log.info("expired %s open past the deadline", counted(expired, "hold"))
                    if expired < self.settings.sweep_batch_size:
                        break
            except StoreDamaged:
                pass  # the store logged it; the next turn's check stops the sweeps
            except StoreUnavailable:
                log.warning("sweeper: database unavailable; will retry")
            except Exception:
                log.exception("sweeper failed; will retry")

    def hurry(self) -> None:
        """Ends a stop's drain now (the operator's second signal), as its grace
        limit would: the calls still running are cut off. Called before the
        stop begins, its drain ends as soon as it begins."""
        self._hurried.set()
        self._drain.hurry()

    def stop(self, grace_seconds: float | None = None) -> bool:
        """Drains and stops within the grace period (or sooner, at `hurry`);
        whether it was clean: False when a call was cut off, a thread or the
        last commit did not end within STOP_SECONDS more (it may still hold a
        thread), or the database failed to close."""
        if self._stopping.is_set():
            return True
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        grace = self.settings.grace_period_seconds if grace_seconds is None else grace_seconds
        began = time.monotonic()
        deadline = began + grace
        last = deadline + STOP_SECONDS

        def until(instant: float) -> float:
            return max(0.0, instant - time.monotonic())

        self.feed.stop()  # open streams end with SHUTTING_DOWN, not at the grace limit
        running = self._drain.drain(deadline)
        if self._hurried.is_set():
            # Cut off now, not at the grace limit; the threads and the last
            # commit still get their STOP_SECONDS.
            now = time.monotonic()
            deadline, last = min(deadline, now), min(last, now + STOP_SECONDS)
        if running:
            why = (
                "stopping now"
                if self._hurried.is_set()
                else f"grace limit of {grace:.1f} s reached"
            )
            log.warning("%s: %s cut off", why, counted(running, "call"))
        else:
            log.info("drained in %.2f s", time.monotonic() - began)
        # Past the grace limit (or hurried) grpcio still gets ANSWER_HELD_SECONDS
        # before it cancels every call: the held ones, which did no work, are
        # answered SHUTTING_DOWN in it rather than cut off with the running ones.
        stopped = self._server.stop(max(until(deadline), ANSWER_HELD_SECONDS))
        self._drain.release()  # grpcio takes no more calls: the held ones are answered
        # Closed once grpcio has stopped: until then it still ends the calls
        # waiting for their request at the arrival bound, not at the grace limit.
        clean = stopped.wait(until(last)) and running == 0
        self._arrivals.close()
        for thread in (self._maintenance, self._health_probe):
            if thread.is_alive():
                thread.join(timeout=until(last))
                clean = clean and not thread.is_alive()
        try:
            clean = self.store.close(until(last)) and clean
        except Exception:
            log.exception("closing the database failed")
            clean = False
        if self._owns_telemetry:
            try:
                self.telemetry.shutdown()
            except Exception:
                log.exception("telemetry shutdown failed")  # not the ledger's work: no effect
        log.info("stopped" if clean else "stopped; work cut off is abandoned")
        return clean

    def _prepare_late(
        self, schema_step: Callable[[SqlStore], None], resuming: ManualClock | SteadyClock | None
    ) -> None:
        """What a start did not do while the database did not answer: the
        schema's step, then the clock resumed at the last recorded event."""
        schema_step(self.store)
        if resuming is not None:
            resuming.resume_at(self.ledger.last_event_at_us())

    def wait(self) -> None:
        self._server.wait_for_termination()


def _log_schema_pending(settings: Settings, error: StoreUnavailable, run_migrations: bool) -> None:
    """Says why the schema step waits, and for how long."""
    damaged = isinstance(error, StoreDamaged)
    why = "it is damaged" if damaged else translate.unavailable_words(error, "it does not answer")
    said = translate.driver_message(error)
    why += f" ({said})" if said else ""
    every = settings.recovery_check_interval_seconds
    then = (
        " until it is repaired and the server restarted"
        if damaged
        else f"; the server tries again every {every:g} s"
    )
    log.error(
        "the database's schema could not be %s: %s. Health is NOT_SERVING%s",
        "brought up to date" if run_migrations else "read",
        why,
        then,
    )


def _upgrade(store: SqlStore) -> None:
    """migrate.upgrade, its database errors translated (StoreUnavailable, StoreDamaged).
    SQLite: a write lock held past one busy timeout is an outage the server
    comes up NOT_SERVING through and tries again, not a start held back."""
    try:
        with translate.translated():
            migrate.upgrade(store.engine, sqlite_wait_seconds=0.0)
    except migrate.MigrationWaitExceeded as error:
        raise StoreUnavailable() from error.__cause__


def _check_revision(store: SqlStore) -> None:
    """migrate.check_revision, its database errors translated."""
    with translate.translated():
        migrate.check_revision(store.engine)


def recovery_guard(
    settings: Settings,
    store: SqlStore,
    on_change: Callable[[bool], None],
    prepare: Callable[[], None] | None = None,
) -> RecoveryGuard:
    recovery = build_recovery(settings, store, f"server {socket.gethostname()}:{os.getpid()}")
    return RecoveryGuard(
        recovery,
        recovery_policy(settings),
        actor=recovery.owner,
        check_interval_seconds=settings.recovery_check_interval_seconds,
        consistency_check_seconds=settings.consistency_check_interval_seconds,
        snapshot_every_events=settings.snapshot_every_events,
        on_change=on_change,
        prepare=prepare,
        on_damage=store.note_damage,
    )


def build_recovery(settings: Settings, store: SqlStore, owner: str) -> Recovery:
    """Assessment, planning, rebuilds and snapshots on the store's database."""
    return Recovery(
        SqlRecoveryStore(
            store.engine, batch_rows=settings.recovery_batch_events, horizon=store.horizon
        ),
        SystemClock(),
        RecoverySettings(
            batch_events=settings.recovery_batch_events,
            sample_events=settings.recovery_sample_events,
            snapshot_keep=settings.snapshot_keep,
            lease_seconds=settings.rebuild_lease_seconds,
            check_processes=settings.recovery_check_processes,
            replay_range_events=settings.recovery_replay_range_events,
        ),
        owner,
    )


def recovery_policy(settings: Settings) -> RecoveryPolicy:
    """The planner's policy from the settings, refused by the rule `ledger
    recover` applies too (RecoveryPolicy.validate). Raises ValueError."""
    policy = RecoveryPolicy(
        max_budget_seconds=settings.recovery_budget_seconds,
        max_risk_score=settings.recovery_max_risk,
        min_viable_sources=settings.recovery_min_viable_sources,
    )
    try:
        policy.validate()
    except ValueError as error:
        raise ValueError(
            f"the recovery policy (--recovery-* or LEDGER_RECOVERY_*): {error}"
        ) from None
    return policy


def issue_admin_grant(settings: Settings, grant_keys: Keyring) -> str:
    """Issues an admin grant, for the local commands once written (write_admin_grant)."""
    now_us = SystemClock().now_us()
    return grant_keys.issue(
        ["*"],
        [Scope.ADMIN],
        issued_at_us=now_us,
        expires_at_us=now_us + settings.admin_grant_lifetime_seconds * 1_000_000,
    )


def write_admin_grant(settings: Settings, grant: str) -> None:
    """Writes `grant` to <data-dir>/admin.grant (mode 0600), or warns that it cannot."""
    try:
        keyring.write_admin_grant(settings.data_dir, grant)
    except OSError as error:
        # A read-only data directory still serves; only the local commands miss the file.
        path = keyring.admin_grant_path(settings.data_dir)
        log.warning("cannot write %s (%s): give local commands --grant", path, error.strerror)


def server_tls(settings: Settings, clock: Clock) -> ServerTls | None:
    """The TLS files, checked, when a certificate is configured; with a client
    CA, mutual TLS. Replaced files are taken at the next handshake."""
    cert, key, client_ca = (
        settings.tls_cert_path,
        settings.tls_key_path,
        settings.tls_client_ca_path,
    )
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError(
                f"{settings.source('tls_client_ca_path')} needs a certificate and its key "
                f"({either_source('tls_cert_path')}, {either_source('tls_key_path')})"
            )
        return None
    if cert is None or key is None:
        given, missing = (
            ("tls_cert_path", "tls_key_path") if key is None else ("tls_key_path", "tls_cert_path")
        )
        raise ValueError(
            f"{settings.source(given)} needs {either_source(missing)}: "
            "a certificate and its key go together"
        )
    # Imported here: cryptography adds about 10 MiB to every server, TLS or not.
    from ledger_service import tls_files

    names = tls_files.Sources(
        settings.source("tls_cert_path"),
        settings.source("tls_key_path"),
        settings.source("tls_client_ca_path"),
    )
    return tls_files.ServerTls(cert, key, client_ca, clock, names)


def _transport(settings: Settings) -> str:
    if settings.tls_client_ca_path is not None:
        return "mutual TLS"
    return "TLS" if settings.tls_cert_path is not None else "plaintext"


def _announce(line: str) -> None:
    """The one line on stdout, written to its descriptor. A stdout nobody reads
    (`ledger serve | true`, a supervisor that read the line and left, a full
    disk) is logged, and the server serves on: the failed write ended the
    process, exit 1 and not a word, without its clean stop. Then stdout is
    /dev/null, so that no later flush fails."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        os.write(1, line.encode())
    except Exception as error:  # an OSError, or the CLI stdout wrapper's own error
        log.warning("cannot write the listening line to stdout (%s): serving on", error)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)


def serve_existing(settings: Settings) -> int:
    """Like serve, on a schema that is already migrated."""
    return serve(settings, run_migrations=False)


def serve(
    settings: Settings,
    *,
    run_migrations: bool = True,
    prepare: Callable[[LedgerServer], None] | None = None,
    transport: Callable[..., grpc.Server] = grpc.server,
) -> int:
    """Runs until SIGTERM or SIGINT, then stops with a grace period; a second
    signal ends the drain at once. Returns 0 after a clean stop (the process
    exits with EXIT_CUT_OFF after one that cut work off). `prepare` sees the
    server before it starts (the benchmark's storeless server); `transport` is
    LedgerServer's."""
    try:
        refuse_an_address_nobody_can_bind(settings.listen)
    except ListenFailed as error:
        # One line, as for every other refused start: nothing has started to log.
        print(f"ledger: {error}", file=sys.stderr)
        return 1
    server = LedgerServer(settings, run_migrations=run_migrations, transport=transport)
    if prepare is not None:
        prepare(server)
    try:
        server.start()
    except ListenFailed as error:
        log.error("%s", error)
        print(f"ledger: {error}", file=sys.stderr)
        server.stop(0)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before the handlers below: what the start began ends with it.
        server.stop(0)
        raise
    done = threading.Event()
    # Counts the signals: next() is one step, which a second handler, run
    # inside the first one as Python may do, cannot split.
    signals = itertools.count()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if next(signals) > 0:
            server.hurry()
            log.warning("received %s again: stopping now; calls still running are cut off",
                        name)  # fmt: skip
            return
        done.set()
        log.info("received %s: draining (at most %.1f s; signal again to stop now)", name,
                 settings.grace_period_seconds)  # fmt: skip

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # A closed terminal stops it as cleanly; under nohup (SIGHUP ignored) it runs on.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_signal)
    # The line only now: whoever waits for it may stop the server at once, and a
    # SIGTERM before the handlers met the default action (no drain, status -15).
    _announce(f"ledger listening on {settings.listen.rsplit(':', 1)[0]}:{server.port}\n")
    # Python runs a handler in the main thread, and only when that thread runs:
    # a signal the kernel gives another thread (as after SIGSTOP and SIGCONT)
    # does not wake a wait without a timeout, and would be lost. So the main
    # thread keeps waiting in short turns, and the stop runs in a thread of
    # its own, where a second signal can reach it at once.
    while not done.wait(SIGNAL_POLL_SECONDS):
        pass
    outcome: list[bool] = []
    stopper = threading.Thread(
        target=lambda: outcome.append(server.stop()), name="stop", daemon=True
    )
    stopper.start()
    while stopper.is_alive():
        stopper.join(SIGNAL_POLL_SECONDS)
    if outcome != [True]:
        # Work was cut off, and a thread still blocked in it (say, a statement
        # the database never answered) would hold the interpreter's exit, which
        # joins the worker threads: leave now, as promised, with a status that
        # says so. What committed is on disk; what did not is rolled back, as
        # after a kill.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(EXIT_CUT_OFF)
    return 0
