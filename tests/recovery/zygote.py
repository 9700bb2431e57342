"""Forks real server processes quickly, for the SIGKILL tests.

Starting `ledger serve` pays for importing gRPC, SQLAlchemy and OpenTelemetry
every time: seconds on a busy machine. This process imports them once and,
for each line of JSON settings read on stdin, forks a child that builds and
starts a LedgerServer, prints {"pid": ..., "port": ...} and serves until it is
killed. Nothing gRPC or database-related exists in this parent before a fork
(only imports), which is what gRPC requires of a forking process. The child is
a whole server process: a SIGKILL to it is a crash of the ledger.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import sys
import threading
import traceback
from typing import Any

from ledger_service.server import LedgerServer
from ledger_service.settings import Settings


def _serve(values: dict[str, Any]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        values["data_dir"] = pathlib.Path(values["data_dir"])
        server = LedgerServer(Settings(**values), run_migrations=False)
        port = server.start()
        print(json.dumps({"pid": os.getpid(), "port": port}), flush=True)
        threading.Event().wait()
    except BaseException:
        print(json.dumps({"pid": os.getpid(), "error": traceback.format_exc()}), flush=True)
    finally:
        os._exit(1)


def main() -> None:
    # Killed children are reaped by the kernel: no zombies, no waiting.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        values = json.loads(line)
        if os.fork() == 0:
            _serve(values)


if __name__ == "__main__":
    main()
