"""Rebuilding the projections from the log: events per second.

Two figures, measured in a process of their own so that a slow rebuild can be
stopped at its time limit (the database is scratch by then):

- `replay`: the pure fold, `domain.replay.Projection.apply` over the log's
  first events (bounded), read in batches; the reading and the folding are
  timed apart. It says what the domain's own work costs.
- `rebuild`: the project's rebuild, `Recovery.rebuild` along the whole log
  (what `ledger rebuild --from-scratch` runs): reads, checks every hash-chain
  link, folds and writes the projections in batches. Its rate is taken from
  its own progress reports, so a rebuild stopped at the time limit still
  gives the rate it kept up to there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

# A progress message at most this often.
PROGRESS_INTERVAL_SECONDS = 0.5
REPLAY_BATCH_EVENTS = 1000


@dataclasses.dataclass(frozen=True)
class RebuildProgress:
    done: int
    total: int
    elapsed_seconds: float


def _replay(database_url: str, max_events: int) -> dict[str, Any]:
    from ledger_service.domain.replay import Projection
    from ledger_service.server import build_store
    from ledger_service.settings import Settings
    from ledger_service.storage.recovery import SqlRecoveryStore

    store = build_store(Settings(database_url=database_url))
    try:
        source = SqlRecoveryStore(store.engine, batch_rows=REPLAY_BATCH_EVENTS)
        projection = Projection()
        read_seconds = fold_seconds = 0.0
        after = folded = 0
        while folded < max_events:
            started = time.perf_counter()
            batch = source.events_after(after, min(REPLAY_BATCH_EVENTS, max_events - folded))
            read_seconds += time.perf_counter() - started
            if not batch:
                break
            started = time.perf_counter()
            for event in batch:
                projection.apply(event)
            fold_seconds += time.perf_counter() - started
            after, folded = batch[-1].seq, folded + len(batch)
    finally:
        store.close()
    return {
        "events": folded,
        "read_seconds": read_seconds,
        "fold_seconds": fold_seconds,
        "fold_events_per_second": folded / fold_seconds if fold_seconds else 0.0,
        "read_and_fold_events_per_second": (
            folded / (read_seconds + fold_seconds) if folded else 0.0
        ),
    }


def _rebuild(database_url: str, connection: Connection) -> dict[str, Any]:
    from ledger_service.application.recovery import FULL_LOG_SOURCE, Route
    from ledger_service.server import build_recovery, build_store
    from ledger_service.settings import Settings

    settings = Settings(database_url=database_url)
    store = build_store(settings)
    sent = 0.0

    def progress(phase: str, done: int, total: int, elapsed_seconds: float) -> None:
        nonlocal sent
        now = time.monotonic()
        if phase == "replay" and (now - sent >= PROGRESS_INTERVAL_SECONDS or done >= total):
            sent = now
            connection.send(("progress", RebuildProgress(done, total, elapsed_seconds)))

    try:
        recovery = build_recovery(settings, store, "ledger bench")
        started = time.perf_counter()
        digest = recovery.rebuild(Route(FULL_LOG_SOURCE, None), progress)
        seconds = time.perf_counter() - started
    finally:
        store.close()
    return {"seconds": seconds, "digest": digest}


def _probe_main(database_url: str, replay_max_events: int, connection: Connection) -> None:
    # A process group of its own, with the rebuild's checking processes, so
    # that stopping it at the time limit stops them too.
    os.setpgrp()
    try:
        connection.send(("replay", _replay(database_url, replay_max_events)))
        connection.send(("rebuilt", _rebuild(database_url, connection)))
    except Exception as error:
        connection.send(("failed", f"{type(error).__name__}: {error}"))


def measure(
    database_url: str, events: int, *, replay_max_events: int, timeout_seconds: float
) -> dict[str, Any]:
    """Replays, then rebuilds, the log of `database_url` (which holds `events`
    events); stops the rebuild after `timeout_seconds`."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    # Not daemonic: the rebuild checks hashes in processes of its own, which a
    # daemonic process may not start. It is killed at the time limit (its
    # checking processes then end on their queue's EOF).
    process = context.Process(
        target=_probe_main, args=(database_url, replay_max_events, child), daemon=False
    )
    process.start()
    child.close()
    result: dict[str, Any] = {
        "events": events,
        "completed": False,
        "timeout_seconds": timeout_seconds,
    }
    last: RebuildProgress | None = None
    deadline = time.monotonic() + timeout_seconds
    try:
        while time.monotonic() < deadline and parent.poll(max(0.0, deadline - time.monotonic())):
            kind, payload = parent.recv()
            if kind == "progress":
                last = payload
            elif kind == "replay":
                result["replay"] = payload
                # The rebuild's own time limit starts now.
                deadline = time.monotonic() + timeout_seconds
            elif kind == "rebuilt":
                result.update(completed=True, seconds=payload["seconds"], digest=payload["digest"])
                break
            else:
                result["failed"] = payload
                break
    except EOFError:
        result["failed"] = "the rebuild process ended without a word"
    finally:
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.join(10)
        parent.close()
    if last is not None:
        result["events"] = last.total
    if result["completed"]:
        result["events_per_second"] = result["events"] / result["seconds"]
    elif last is not None and last.elapsed_seconds > 0:
        # Stopped at the limit: the rate it kept until then.
        result.update(
            events_done=last.done,
            seconds=last.elapsed_seconds,
            events_per_second=last.done / last.elapsed_seconds,
        )
    return result
