"""SQLAlchemy adapters for the application's storage interface (SQLite, PostgreSQL)."""
