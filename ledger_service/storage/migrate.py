"""Runs Alembic programmatically, so `ledger migrate` works from any folder."""

from __future__ import annotations

import dataclasses
import pathlib

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, text

import migrations


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


def upgrade(engine: Engine) -> Upgrade:
    config = alembic_config(engine)
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Replicas starting together migrate one at a time.
            connection.execute(text("SELECT pg_advisory_xact_lock(4998)"))
        # Read under the lock, so `before` is what this upgrade started from.
        before = MigrationContext.configure(connection).get_current_revision()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        after = MigrationContext.configure(connection).get_current_revision()
    return Upgrade(before, after)


def check(engine: Engine) -> None:
    """Raises when the models and the migrated schema differ (`alembic check`)."""
    config = alembic_config(engine)
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.check(config)
