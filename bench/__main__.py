"""`make bench`: run every scenario, print one table, write bench-results/bench-<stamp>.json.

    python -m bench                  # the full run (9-13 minutes here)
    python -m bench --quick          # a smoke run: tiny durations and counts
    python -m bench --skip-postgres  # without the PostgreSQL scenario
    python -m bench --only server-model  # grpc.server against grpc.aio, run only when named
    python -m bench --only reference     # issue 25's reference server beside ours, likewise
    python -m bench --only reference-postgres  # issue 24's, on PostgreSQL, likewise

Exit status 0 when every scenario ran (whether or not it met its target), 1
when one failed, 2 on bad arguments. docs/benchmarks.md explains the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import pathlib
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from bench import machine, report, scenarios
from bench.load import LoadGenerator
from bench.scenarios import Plan

log = logging.getLogger("ledger.bench")
FORMAT_VERSION = 1
# The echo baseline always runs: every other figure is a ratio to it.
# `roundtrips` (through a latency proxy) needs PostgreSQL, like `postgres`.
OPTIONAL_SCENARIOS = ("sqlite", "postgres", "roundtrips", "history")
# Run only when named with --only: the server model's comparison (bench/aio.py)
# issue 25's reference server beside ours (bench/reference.py), and issue
# 24's on PostgreSQL (bench/reference_pg.py).
NAMED_SCENARIOS = ("server-model", "reference", "reference-postgres")
NEEDS_POSTGRES = ("postgres", "roundtrips", "reference-postgres")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument(
        "--quick",
        action="store_true",
        help="tiny durations and 10,000 bookings instead of 1,000,000",
    )
    root.add_argument(
        "--skip-postgres", action="store_true", help="leave out scenarios (3) and (6)"
    )
    root.add_argument(
        "--only",
        action="append",
        choices=OPTIONAL_SCENARIOS + NAMED_SCENARIOS,
        help="run the echo baseline and this scenario only (repeatable)",
    )
    root.add_argument(
        "--postgres-url",
        default=os.environ.get("LEDGER_BENCH_POSTGRES_URL", scenarios.DEFAULT_POSTGRES_URL),
        help="a database where schemas may be created and dropped "
        "(default LEDGER_BENCH_POSTGRES_URL or %(default)s)",
    )
    root.add_argument(
        "--output-dir",
        type=pathlib.Path,
        default=pathlib.Path("bench-results"),
        help="where the JSON file goes (default %(default)s)",
    )
    return root


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every server and load process is stopped."""

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)


def _guarded(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.monotonic()
    log.info("scenario %s", name)
    try:
        result = run()
    except Exception as error:
        log.exception("scenario %s failed", name)
        result = {"failed": f"{type(error).__name__}: {error}"}
    result["seconds"] = time.monotonic() - started
    return result


def run_all(plan: Plan, arguments: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "plan": {**dataclasses.asdict(plan), "saturating_calls": plan.saturating_calls},
        "source": machine.source_revision(),
        "load_average_before": machine.load_average(),
        "scenarios": {},
    }
    found: dict[str, Any] = results["scenarios"]
    postgres_url = arguments.postgres_url
    with (
        tempfile.TemporaryDirectory(prefix="ledger-bench-") as temporary,
        LoadGenerator(plan.processes) as generator,
    ):
        workdir = pathlib.Path(temporary)
        results["load_processes"] = generator.pids
        found["echo"] = _guarded("echo", lambda: scenarios.echo_scenario(plan, generator, workdir))
        wanted = set(arguments.only or OPTIONAL_SCENARIOS)
        if arguments.skip_postgres:
            wanted.difference_update(NEEDS_POSTGRES)
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "sqlite": lambda: scenarios.sqlite_scenario(plan, generator, workdir),
            "postgres": lambda: scenarios.postgres_scenario(plan, generator, workdir, postgres_url),
            "roundtrips": lambda: scenarios.roundtrips_scenario(plan, workdir, postgres_url),
            "history": lambda: scenarios.history_scenario(plan, generator, workdir),
            "server-model": lambda: scenarios.server_model_scenario(plan, generator, workdir),
            "reference": lambda: scenarios.reference_scenario(plan, generator, workdir),
            "reference-postgres": lambda: scenarios.reference_postgres_scenario(
                plan, generator, workdir, postgres_url
            ),
        }
        for name, run in runs.items():
            if name in wanted:
                found[name] = _guarded(name, run)
            else:
                by_flag = name in NEEDS_POSTGRES and arguments.skip_postgres
                found[name] = {"skipped": "--skip-postgres" if by_flag else "not in --only"}
    postgres = found["postgres"].get("server_version", "")
    results["machine"] = machine.describe(postgres)
    results["load_average_after"] = machine.load_average()
    results["finished_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return results


def failures(node: Any, path: str = "") -> list[str]:
    """Where a scenario or phase failed: "sqlite.phases.reserve_1: ...", and so on."""
    if not isinstance(node, dict):
        return []
    if "failed" in node:
        return [f"{path}: {node['failed']}"]
    return [
        found
        for key, value in node.items()
        for found in failures(value, f"{path}.{key}" if path else key)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _stop_on_sigterm()
    plan = scenarios.QUICK if arguments.quick else scenarios.FULL
    started = time.monotonic()
    results = run_all(plan, arguments)
    results["seconds"] = time.monotonic() - started
    rows, targets = report.evaluate(results)
    results["table"] = [dataclasses.asdict(row) for row in rows]
    results["targets"] = [dataclasses.asdict(target) for target in targets]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = report.write_json(results, arguments.output_dir, stamp)
    facts = results["machine"]
    print(report.table(rows))
    print()
    print(
        f"machine: {facts['nproc']} cores ({facts['cpu_model']}), "
        f"{facts['memory_bytes'] / 2**30:.1f} GiB; Python {facts['python']}, grpcio "
        f"{facts['grpcio']}, SQLite {facts['sqlite']}, PostgreSQL {facts['postgresql'] or '-'}"
    )
    source = results["source"]
    dirty = " + uncommitted changes" if source["uncommitted_changes"] else ""
    print(f"source: {source['commit'][:12] or 'unknown'}{dirty}")
    print(
        f"load average before {results['load_average_before']}, after "
        f"{results['load_average_after']}; plan {plan.name}; {results['seconds']:.0f} s"
    )
    met = sum(1 for target in targets if target.met)
    print(f"targets met: {met} of {len(targets)}; figures in {path}")
    broken = failures(results["scenarios"])
    for failure in broken:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
