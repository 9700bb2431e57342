"""Commands that run next to the database: `serve` and `migrate`."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
from typing import Any

from ledger_service.cli.exits import EXIT_INTERRUPTED
from ledger_service.settings import SERVE_FLAGS, Settings, unread_variables


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the ledger's gRPC server")
    database_options(serve)
    serve.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where to listen (port 0 picks one); default LEDGER_LISTEN or 127.0.0.1:50051",
    )
    serve.add_argument(
        "--test-clock",
        action="store_true",
        help="serve the TestClock service so clients can set time (tests only)",
    )
    serve.add_argument(
        "--sweep-interval",
        type=float,
        dest="sweep_interval_seconds",
        metavar="SECONDS",
        help="seconds between expiry sweeps (default 1)",
    )
    serve.add_argument(
        "--max-workers",
        type=int,
        metavar="N",
        help="gRPC worker threads for calls (default 16); streams get one more each (64)",
    )
    serve.add_argument(
        "--max-calls-per-grant",
        type=int,
        metavar="N",
        help="calls one grant may have running at once, streams apart (default 96); "
        "one more is refused, TOO_MANY_CALLS; all grants together run at most twice this "
        "plus --max-workers, the last --max-workers places only for grants running few",
    )
    serve.add_argument(
        "--max-connections-per-grant",
        type=int,
        metavar="N",
        help="PostgreSQL: database connections one grant's calls hold at once (default 16), "
        "below the pool's (20); its others wait for one until their deadline",
    )
    # Recovery (docs/recovery.md).
    serve.add_argument(
        "--snapshot-every",
        type=int,
        dest="snapshot_every_events",
        metavar="N",
        help="snapshot the projections every N events (0: never; default 10000)",
    )
    serve.add_argument(
        "--recovery-budget-seconds",
        type=float,
        metavar="SECONDS",
        help="longest rebuild the server may start on its own (default 300)",
    )
    serve.add_argument(
        "--recovery-max-risk",
        type=float,
        metavar="RISK",
        help="largest risk score of a source it may rebuild from (default 0.3)",
    )
    serve.add_argument(
        "--recovery-min-viable-sources",
        type=int,
        metavar="N",
        help="independent sources whose rebuilds must agree (default 1)",
    )
    serve.add_argument("--no-migrate", action="store_true",
                       help="do not upgrade the schema at start-up")  # fmt: skip
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="accept calls without a grant (only on a loopback listen address; "
        "logged as a warning at every start)",
    )
    serve.add_argument(
        "--tls-cert",
        type=pathlib.Path,
        dest="tls_cert_path",
        metavar="FILE",
        help="PEM certificate chain: serve TLS (default LEDGER_TLS_CERT)",
    )
    serve.add_argument(
        "--tls-key",
        type=pathlib.Path,
        dest="tls_key_path",
        metavar="FILE",
        help="PEM private key of --tls-cert (default LEDGER_TLS_KEY)",
    )
    serve.add_argument(
        "--tls-client-ca",
        type=pathlib.Path,
        dest="tls_client_ca_path",
        metavar="FILE",
        help="PEM CA certificates: demand client certificates they signed, i.e. mutual TLS "
        "(default LEDGER_TLS_CLIENT_CA)",
    )
    serve.set_defaults(run=_serve)

    migrate = commands.add_parser("migrate", help="create or upgrade the database schema")
    database_options(migrate)
    migrate.set_defaults(run=_migrate)


def database_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="default LEDGER_DATABASE_URL or a SQLite file in the data directory",
    )
    parser.add_argument(
        "--data-dir", type=pathlib.Path, metavar="DIR", help="default LEDGER_DATA_DIR or ./data"
    )


def settings_from(arguments: argparse.Namespace) -> Settings:
    _refuse_a_data_dir_the_variable_overrides(arguments)
    overrides: dict[str, object] = {}
    for name in SERVE_FLAGS:
        value = getattr(arguments, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(arguments, "test_clock", False):
        overrides["test_clock"] = True
    if getattr(arguments, "insecure_no_auth", False):
        overrides["auth_enabled"] = False
    try:
        return Settings.from_environment(**overrides)
    except ValueError as error:
        # A refused setting (a LEDGER_* number that is not one, a database
        # URL in a form the ledger does not take): one line, no traceback.
        print(f"ledger {arguments.command}: {error}", file=sys.stderr)
        raise SystemExit(2) from error


def _refuse_a_data_dir_the_variable_overrides(arguments: argparse.Namespace) -> None:
    """`migrate` and the recovery commands use the data directory only to find its
    SQLite file, which LEDGER_DATABASE_URL overrides: `ledger rebuild --data-dir
    DIR` with the variable exported rebuilt the variable's database, not DIR's.
    Refused, one line, exit 2, so that nothing is done to a database the operator
    did not mean. `serve` keeps its keyring in the data directory, beside any URL."""
    exported = os.environ.get("LEDGER_DATABASE_URL")
    if arguments.command == "serve" or arguments.data_dir is None or not exported:
        return
    if arguments.database_url is not None:
        return
    from ledger_service.storage import database

    print(
        f"ledger {arguments.command}: --data-dir {arguments.data_dir} names the SQLite "
        f"ledger in it, but LEDGER_DATABASE_URL ({database.redacted(exported)}) overrides "
        "it: give --database-url, or unset LEDGER_DATABASE_URL, to say which database",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _serve(arguments: argparse.Namespace) -> int:
    """Ctrl-C once the server serves is its own signal handler's (a drain, exit 0);
    before that (the imports, the migrations, the start) it ends here in one line."""
    try:
        return _serve_until_stopped(arguments)
    except KeyboardInterrupt:
        print("ledger serve: interrupted while starting; it served nothing", file=sys.stderr)
        return EXIT_INTERRUPTED


def _serve_until_stopped(arguments: argparse.Namespace) -> int:
    from ledger_service import server
    from ledger_service.storage.keyring import KeyringError

    try:
        settings = settings_from(arguments)
        for sentence in unread_variables(os.environ):
            logging.getLogger("ledger.settings").warning("%s", sentence)
        served = server.serve_existing if arguments.no_migrate else server.serve
        code = served(settings)
    except (ValueError, KeyringError) as error:
        # A refused configuration (say --insecure-no-auth on 0.0.0.0, or a
        # keyring that cannot be read): one line, no traceback.
        print(f"ledger serve: {error}", file=sys.stderr)
        return 2
    # The stop is done, and the interpreter's exit, which still takes a moment,
    # puts a signal with a Python handler back to its default action: a second
    # signal then (Ctrl-C twice, a supervisor signalling again) killed the
    # process, status -15, after a clean stop. Nothing is left to stop, and
    # Python leaves an ignored signal ignored.
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, signal.SIG_IGN)
    return code


def _migrate(arguments: argparse.Namespace) -> int:
    from ledger_service.cli.recovery import database_unavailable
    from ledger_service.domain.errors import StoreUnavailable
    from ledger_service.server import build_store
    from ledger_service.storage import database, migrate, translate

    settings = settings_from(arguments)
    where = database.redacted(settings.database_url)
    try:
        store = build_store(settings, logs_damage=False)
    except (ValueError, OSError) as error:
        # A URL of no database the ledger takes, or a data directory it cannot
        # create: one line, exit 2, as for any refused configuration.
        print(f"ledger migrate: {error} ({where})", file=sys.stderr)
        return 2
    try:
        with translate.translated():
            done = migrate.upgrade(store.engine)
    except StoreUnavailable as error:
        return database_unavailable("migrate", error, where)
    except (migrate.RevisionRefused, migrate.MigrationWaitExceeded) as error:
        print(f"ledger migrate: {error} ({where})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Most likely while it waits its turn for SQLite's write lock (up to
        # 300 s beside a server): one line, as the recovery commands say it.
        print(
            "ledger migrate: interrupted; a step it had begun was rolled back "
            f"(SQLite: all of them): run `ledger migrate` again ({where})",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    finally:
        store.close()
    relative = database.relative_sqlite_file(settings.database_url)
    if done.before is None and relative is not None:
        # sqlite:///tmp/x.db is tmp/x.db under the current directory: a new,
        # empty ledger made where an absolute path was meant said nothing.
        where = f"{where} (the file {relative})"
    print(f"{migrate_text(done.before, done.after)} in {where}", file=sys.stderr)
    return 0


def migrate_text(before: str | None, after: str | None) -> str:
    """What `ledger migrate` did: created, upgraded, or found the schema up to date."""
    if before is None:
        return f"created the schema at revision {after}"
    if before != after:
        return f"upgraded the schema from revision {before} to {after}"
    return f"the schema is already at revision {after} (up to date)"
