"""The SQLite write-ahead log shrinks back after a reader let it grow."""

from __future__ import annotations

import pathlib

import pytest
from sqlalchemy import text

from ledger_service.storage import database


def test_the_write_ahead_log_is_cut_back_once_the_reader_that_pinned_it_is_gone(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "WAL_KEPT_BYTES", 2**20)
    path = tmp_path / "ledger.db"
    engine = database.create(f"sqlite:///{path}", database.EngineLimits(pool_size=2))
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE t (x BLOB)"))
        wal = pathlib.Path(f"{path}-wal")
        with engine.connect() as reader, reader.begin():
            reader.execute(text("SELECT count(*) FROM t")).scalar_one()
            for _ in range(40):  # 4 MB the reader's snapshot keeps from being checkpointed
                with engine.begin() as connection:
                    connection.execute(text("INSERT INTO t VALUES (randomblob(100000))"))
            grown = wal.stat().st_size
        assert grown > 4 * 10**6
        for _ in range(3):  # a checkpoint, then the log's reset and cut
            with engine.begin() as connection:
                connection.execute(text("INSERT INTO t VALUES (randomblob(1000))"))
        assert wal.stat().st_size <= 2**20
    finally:
        engine.dispose()
