"""Ctrl-C while `ledger` is still loading (importing the CLI takes about half a
second) ends as any other interrupted command: one line, exit 130, no traceback."""

from __future__ import annotations

import builtins
import importlib.metadata
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

LEDGER = pathlib.Path(sys.executable).with_name("ledger")


def test_the_ledger_script_loads_the_cli_under_the_guard() -> None:
    (script,) = [
        entry
        for entry in importlib.metadata.entry_points(group="console_scripts")
        if entry.name == "ledger"
    ]
    assert script.value == "ledger_service.launch:main"


def test_ctrl_c_while_the_cli_imports_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger_service import launch
    from ledger_service.cli.exits import EXIT_INTERRUPTED

    real_import = builtins.__import__

    def interrupted(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ledger_service.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert launch.main() == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "ledger: interrupted\n"


def test_ctrl_c_soon_after_start_prints_no_traceback() -> None:
    process = subprocess.Popen(
        [str(LEDGER), "balance", "recall", "--server", "127.0.0.1:1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LEDGER_GRANT": "x"},
        # A shell's background job ignores SIGINT; a terminal's Ctrl-C does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert "Traceback" not in err
    # Before Python installs its handler the signal itself ends it (-2).
    assert process.returncode in (130, -signal.SIGINT)
    assert len(err.splitlines()) <= 1
