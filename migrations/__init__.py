"""Alembic migrations: the one owner of the schema on SQLite and PostgreSQL."""
