"""`ledger report --json` took the flag every server command takes ("machine-
readable output: amounts in raw nanos") and printed its human line all the
same. It now prints the audit the page was drawn from as `ledger audit --json`
does, one JSON object, and still writes the page.

A real `ledger serve` process (tests/test_cli.py's helpers) on a port of this
suite's range.
"""

from __future__ import annotations

import json
import pathlib

from tests.test_cli import JEV_PRICE, pointed_at, run_ok, start_ledger_process

LISTEN = "127.0.0.1:41109"


def test_report_json_prints_the_audit_as_audit_json_does(tmp_path: pathlib.Path) -> None:
    served = start_ledger_process(tmp_path, listen=LISTEN)
    environment = pointed_at(served)
    page = tmp_path / "paged.html"
    try:
        run_ok(environment, "lane", "put", "paged", "--limit", "$1", "--price", JEV_PRICE)
        reported = json.loads(run_ok(environment, "report", "paged", "--html", str(page), "--json"))
        audited = json.loads(run_ok(environment, "audit", "paged", "--json"))
    finally:
        served.stop()
    assert reported == audited
    assert page.read_text().startswith("<!DOCTYPE html>")
