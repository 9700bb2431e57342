"""Rebuilding the projections from the log: events per second.

Two figures:

- `replay`: the pure fold, `domain.replay.Projection.apply` over the log's
  first events (bounded), read in batches through `ledger_service.seeding`;
  the reading and the folding are timed apart. It says what the domain's own
  work costs.
- `rebuild`: `ledger rebuild --from-scratch`, the command an operator runs, in
  a process group of its own so that a slow rebuild can be stopped at its time
  limit (the database is scratch by then). It reads, checks every hash-chain
  link, folds and writes the projections in batches. Its rate is taken from
  the progress lines it prints on stderr, so a rebuild stopped at the time
  limit still gives the rate it kept up to there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import servers
from ledger_service.domain.replay import Projection
from ledger_service.seeding import log_batches

REPLAY_BATCH_EVENTS = 1000
POLL_SECONDS = 0.2
# "replay: 12000/20001 (59%), 81,234/s"
_PROGRESS = re.compile(r"^replay: (\d+)/(\d+) \(\d+%\)(?:, ([\d,]+)/s)?$")
# "rebuilt from full-log in 12.34s; digest abc..."
_REBUILT = re.compile(r"^rebuilt from \S+ in ([\d.]+)s; digest (\S+)$")


@dataclasses.dataclass(frozen=True)
class RebuildProgress:
    done: int
    total: int
    elapsed_seconds: float


def replay(database_url: str, max_events: int) -> dict[str, Any]:
    projection = Projection()
    read_seconds = fold_seconds = 0.0
    folded = 0
    batches = log_batches(database_url, REPLAY_BATCH_EVENTS, max_events)
    while True:
        started = time.perf_counter()
        batch = next(batches, None)
        read_seconds += time.perf_counter() - started
        if batch is None:
            break
        started = time.perf_counter()
        for event in batch:
            projection.apply(event)
        fold_seconds += time.perf_counter() - started
        folded += len(batch)
    return {
        "events": folded,
        "read_seconds": read_seconds,
        "fold_seconds": fold_seconds,
        "fold_events_per_second": folded / fold_seconds if fold_seconds else 0.0,
        "read_and_fold_events_per_second": (
            folded / (read_seconds + fold_seconds) if folded else 0.0
        ),
    }


def ledger_command() -> list[str]:
    """The `ledger` console script beside this interpreter, else its entry point."""
    found = shutil.which("ledger", path=str(pathlib.Path(sys.executable).parent))
    if found:
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; from ledger_service.cli import main; sys.exit(main())",
    ]


def parse_progress(line: str) -> RebuildProgress | None:
    found = _PROGRESS.match(line.strip())
    if not found:
        return None
    done, total = int(found.group(1)), int(found.group(2))
    rate = float(found.group(3).replace(",", "")) if found.group(3) else 0.0
    return RebuildProgress(done, total, done / rate if rate else 0.0)


def _last_progress(text: str) -> RebuildProgress | None:
    last = None
    for line in text.splitlines():
        last = parse_progress(line) or last
    return last


def measure(
    database_url: str, events: int, *, replay_max_events: int, timeout_seconds: float
) -> dict[str, Any]:
    """Replays, then rebuilds, the log of `database_url` (which holds `events`
    events); stops the rebuild after `timeout_seconds`."""
    result: dict[str, Any] = {
        "events": events,
        "completed": False,
        "timeout_seconds": timeout_seconds,
        "replay": replay(database_url, replay_max_events),
    }
    argv = [*ledger_command(), "rebuild", "--from-scratch", "--database-url", database_url]
    with tempfile.TemporaryDirectory(prefix="ledger-rebuild-") as temporary:
        out_path, err_path = pathlib.Path(temporary, "out"), pathlib.Path(temporary, "err")
        with open(out_path, "w", encoding="utf-8") as out, open(err_path, "w") as err:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=temporary,
                env=servers.server_environment(),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_seconds
        try:
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        stdout = out_path.read_text(encoding="utf-8", errors="replace")
        stderr = err_path.read_text(encoding="utf-8", errors="replace")
    last = _last_progress(stderr)
    rebuilt = next(
        (found for line in stdout.splitlines() if (found := _REBUILT.match(line.strip()))), None
    )
    if last is not None:
        result["events"] = last.total
    if process.returncode == 0 and rebuilt is not None:
        seconds = float(rebuilt.group(1))
        result.update(completed=True, seconds=seconds, digest=rebuilt.group(2))
        result["events_per_second"] = result["events"] / seconds if seconds else 0.0
    elif process.returncode in (0, -signal.SIGKILL) and last is not None:
        # Stopped at the limit: the rate it kept until then.
        if last.elapsed_seconds > 0:
            result.update(
                events_done=last.done,
                seconds=last.elapsed_seconds,
                events_per_second=last.done / last.elapsed_seconds,
            )
    else:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        result["failed"] = f"ledger rebuild exited with {process.returncode}: {tail[0]}"
    return result
