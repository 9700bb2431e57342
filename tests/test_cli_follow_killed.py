"""`ledger history --follow` on a server killed with SIGKILL: no SHUTTING_DOWN
ends its stream, the connection breaks, and the command ended with "the ledger
at HOST:PORT closed the connection", exit 3, not saying where to resume. It now
ends with the hint a follow whose server does not come back gives, naming the
last event it printed.

A real `ledger serve` process (tests/test_cli.py's helpers), on a port of this
suite's range, and the follow as a process of its own.
"""

from __future__ import annotations

import pathlib
import signal

from ledger_service.cli import exits
from tests.test_cli import JEV_PRICE, _follower, pointed_at, run_ok, start_ledger_process

LISTEN = "127.0.0.1:41107"
COMMAND_SECONDS = 60


def test_a_follow_whose_server_is_killed_says_where_to_resume(tmp_path: pathlib.Path) -> None:
    served = start_ledger_process(tmp_path, listen=LISTEN)
    environment = pointed_at(served)
    run_ok(environment, "lane", "put", "killed", "--limit", "$1", "--price", JEV_PRICE)
    follower = _follower(["killed"], environment)
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline().startswith("SEQ")
        assert "lane_configured" in follower.stdout.readline()
        run_ok(environment, "reserve", "killed", "k-1", "--model", "jev",
               "--request-bytes", "7000", "--max-output-tokens", "200")  # fmt: skip
        printed = follower.stdout.readline().split()
        assert printed[2:4] == ["reserved", "k-1"], printed
        served.process.send_signal(signal.SIGKILL)
        served.process.wait(timeout=COMMAND_SECONDS)
        out, err = follower.communicate(timeout=COMMAND_SECONDS)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
        served.stop()
    assert follower.returncode == exits.EXIT_UNREACHABLE, err
    assert out == "" and "Traceback" not in err, (out, err)
    assert err.count("\n") == 1, err
    assert err.startswith(f"ledger: the ledger at {served.address} "), err
    assert err.endswith(f"; resume with --after-seq {printed[0]}\n"), err
