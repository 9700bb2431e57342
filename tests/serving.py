"""`ledger serve` as a process of its own, for the tests that need one: started
on port 0 (its address read from its first line) and stopped with SIGTERM,
then SIGKILL."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

STOP_SECONDS = 15.0


def clean_env(**settings: str) -> dict[str, str]:
    """This environment without its LEDGER_* variables, and with `settings`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")}
    env.update(settings)
    return env


def spawn(
    data_dir: pathlib.Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    stderr: IO[Any] | int = subprocess.DEVNULL,
) -> tuple[subprocess.Popen[str], str]:
    """The process and the address it listens on."""
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    argv: Sequence[str] = [
        str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *flags,
    ]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=stderr, env=dict(env or clean_env()), text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("ledger listening on "), line
    return process, line.rsplit(" ", 1)[1].strip()


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
