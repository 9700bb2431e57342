"""One ledger server for the benchmark: what `ledger serve` runs, with settings
given in full.

`ledger serve` exposes only some settings as flags. The history scenario must
also turn off the periodic consistency check and the snapshots, whose walk over
a million-booking log would otherwise land in the middle of a measurement (the
start-up check still runs, and its time is reported). Everything else is the
server's own code: `server.serve`, its interceptors, its health and its stop.

    python -m bench.replica --settings '{"database_url": "...", ...}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from bench import aio, aio_writer, storeless
from ledger_service import server
from ledger_service.cli import configure_logging
from ledger_service.settings import Settings

_PATH_FIELDS = frozenset({"data_dir", "tls_cert_path", "tls_key_path", "tls_client_ca_path"})


def settings_from(values: Mapping[str, Any]) -> Settings:
    known = {field.name for field in dataclasses.fields(Settings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    converted: dict[str, Any] = {
        name: pathlib.Path(value) if name in _PATH_FIELDS and value is not None else value
        for name, value in values.items()
    }
    return Settings(**converted)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica")
    parser.add_argument("--settings", required=True, help="Settings fields as a JSON object")
    parser.add_argument("--no-migrate", action="store_true", help="the schema is already there")
    parser.add_argument(
        "--storeless",
        action="store_true",
        help="answer Reserve and Settle without the store (bench/storeless.py)",
    )
    parser.add_argument(
        "--aio", action="store_true", help="serve on grpc.aio instead of grpc.server (bench/aio.py)"
    )
    parser.add_argument(
        "--sync-writer",
        action="store_true",
        help="grpc.server, Reserve and Settle committed by one writer thread (bench/aio_writer.py)",
    )
    parser.add_argument(
        "--aio-writer",
        action="store_true",
        help="grpc.aio with async Reserve and Settle and one writer thread (bench/aio_writer.py)",
    )
    arguments = parser.parse_args(argv)
    configure_logging()
    settings = settings_from(json.loads(arguments.settings))
    return server.serve(
        settings,
        run_migrations=not arguments.no_migrate,
        prepare=storeless.storeless
        if arguments.storeless
        else aio_writer.install
        if arguments.aio_writer
        else aio_writer.install_sync
        if arguments.sync_writer
        else None,
        transport=aio_writer.transport
        if arguments.aio_writer
        else aio.transport
        if arguments.aio
        else grpc.server,
    )


if __name__ == "__main__":
    sys.exit(main())
