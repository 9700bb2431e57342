"""Runs Alembic programmatically, so `ledger migrate` works from any folder."""

from __future__ import annotations

import pathlib

from alembic import command
from alembic.config import Config
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


def upgrade(engine: Engine) -> None:
    config = alembic_config(engine)
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Replicas starting together migrate one at a time.
            connection.execute(text("SELECT pg_advisory_xact_lock(4998)"))
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def check(engine: Engine) -> None:
    """Raises when the models and the migrated schema differ (`alembic check`)."""
    config = alembic_config(engine)
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.check(config)
