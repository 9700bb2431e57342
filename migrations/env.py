"""Alembic environment. The URL comes from the Config's `sqlalchemy.url`, set
by `ledger migrate`, or from LEDGER_DATABASE_URL when alembic runs directly."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from ledger_service.settings import Settings
from ledger_service.storage.schema import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    configured = config.get_main_option("sqlalchemy.url")
    if configured:
        return configured
    return os.environ.get("LEDGER_DATABASE_URL") or Settings.from_environment().database_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
        # A migration may build an index CONCURRENTLY (0008), outside any
        # transaction; each migration commits on its own.
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
