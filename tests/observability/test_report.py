"""`ledger audit` and `ledger report --html`: the audit as text and JSON, and one
self-contained HTML page whose figures, read back from the DOM a real headless
browser renders, are the audit's."""

from __future__ import annotations

import html.parser
import json
import os
import pathlib
import re
import shutil
import socket
import stat
import subprocess
from typing import Any

import pytest
from google.protobuf import timestamp_pb2

from ledger_service import cli
from ledger_service.cli.render import message_json, time_text
from ledger_service.server import LedgerServer
from tests.observability.jam import make_jam

BROWSER_TIMEOUT_SECONDS = 120
RATIO = re.compile(r"\d+\.\d{4}")
# A number with five decimals or more that is neither an amount ($0.000009264) nor a
# time's seconds (08:00:05.123456Z): a raw float.
RAW_FLOAT = re.compile(r"(?<![$\d.:])\d+\.\d{5,}")
# The figures of the page's table, by cell id, and where the audit keeps them.
BALANCE_IDS = ("limit-nanos", "spent-nanos", "held-nanos", "charged-nanos", "available-nanos",
               "overrun-nanos", "open-bookings")  # fmt: skip
AUDIT_IDS = (
    "succeeded-count", "succeeded-charged-nanos", "reconciled-count", "reconciled-charged-nanos",
    "unknown-count", "unknown-charged-nanos", "expired-count", "expired-charged-nanos",
    "open-count", "open-held-nanos", "refunded-count", "reserve-count", "denied-count",
    "denial-rate", "real-charged-nanos", "estimated-charged-nanos", "estimated-to-real-ratio",
    "next-release-nanos",
)  # fmt: skip


class Figures(html.parser.HTMLParser):
    """The text of every element with an id, the flags and the denial markers."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.flags: list[str] = []
        self.denial_markers = 0
        self.tags: set[str] = set()
        self._open: list[tuple[str, str | None, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.add(tag)
        if attributes.get("class") == "denial-marker":
            self.denial_markers += 1
        if tag in {"meta", "rect", "polyline"}:
            return  # void or self-closed: no text
        self._open.append((tag, attributes.get("id"), attributes.get("class") == "flag"))
        if attributes.get("id"):
            self.by_id[str(attributes["id"])] = ""

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for _tag, element_id, is_flag in self._open:
            if element_id:
                self.by_id[element_id] += data
            if is_flag:
                self.flags.append(data)


def read_figures(page: str) -> Figures:
    figures = Figures()
    figures.feed(page)
    figures.close()
    return figures


def run_cli(capsys: pytest.CaptureFixture[str], server: LedgerServer, *arguments: str) -> str:
    address = ("--server", f"127.0.0.1:{server.port}", "--grant", server.admin_grant)
    code = cli.main([*arguments, *address])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def assert_matches_audit(figures: Figures, audit: Any) -> None:
    for element_id in BALANCE_IDS:
        assert figures.by_id[element_id] == str(
            getattr(audit.balance, element_id.replace("-", "_"))
        )
    for element_id in AUDIT_IDS:
        value = getattr(audit, element_id.replace("-", "_"))
        shown = figures.by_id[element_id]
        if isinstance(value, float):
            # Ratios are rounded to four places: no raw float on the page.
            assert RATIO.fullmatch(shown), (element_id, shown)
            assert abs(float(shown) - value) <= 0.00005, element_id
        else:
            assert int(shown) == value, element_id
    assert figures.by_id["next-release-at"] == audit.next_release_at.ToJsonString()
    assert figures.by_id["lane"] == audit.lane
    assert figures.by_id["summary"] == audit.summary
    assert figures.flags == list(audit.flags)
    assert figures.denial_markers == audit.denied_count


def test_audit_prints_a_readable_report_and_json(
    traced_server: LedgerServer, ledger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    make_jam(ledger)
    audit = ledger.audit(biggest=5)
    text = run_cli(capsys, traced_server, "audit", "recall")
    assert "flags             MOSTLY_ESTIMATES, NEAR_LIMIT, HIGH_DENIAL_RATE" in text
    assert "  estimates       $0.000008748: 10 UNKNOWN $0.000004860, 8 expired $0.000003888" in text
    assert "reserves          29, 5 denied (17.2%)" in text
    assert "biggest bookings:" in text
    assert text.rstrip().endswith(audit.summary)
    printed = json.loads(run_cli(capsys, traced_server, "audit", "recall", "--json"))
    assert printed == message_json(audit)


def test_report_writes_one_self_contained_page(
    traced_server: LedgerServer,
    ledger: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    make_jam(ledger)
    audit = ledger.audit(biggest=5)
    path = tmp_path / "recall.html"
    before = os.umask(0o077)
    try:
        out = run_cli(capsys, traced_server, "report", "recall", "--html", str(path))
    finally:
        os.umask(before)
    assert out.startswith(f"wrote {path}: ")
    # Meant to be shared: readable by all even under a restrictive umask.
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ledger-report-")]
    page = path.read_text()
    assert RAW_FLOAT.findall(page) == []
    # The chart spans the whole 1d window, not the jam's five seconds of events.
    as_of = audit.balance.as_of
    start = timestamp_pb2.Timestamp(
        seconds=as_of.seconds - audit.balance.window.seconds, nanos=as_of.nanos
    )
    assert f">{time_text(start)}</text>" in page and f">{time_text(as_of)} (now)</text>" in page
    for outside in ("<script", "src=", "href=", "http:", "https:", "@import", "url("):
        assert outside not in page
    figures = read_figures(page)
    assert {"svg", "polyline", "table", "style"} <= figures.tags
    assert_matches_audit(figures, audit)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return found


def test_the_page_renders_in_a_headless_browser_with_the_audits_figures(
    traced_server: LedgerServer,
    ledger: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    make_jam(ledger)
    audit = ledger.audit(biggest=5)
    path = tmp_path / "report.html"
    run_cli(capsys, traced_server, "report", "recall", "--html", str(path))
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'browser-profile'}",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        timeout=BROWSER_TIMEOUT_SECONDS,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    dom = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0 and "window-chart" in dom, done.stderr.decode()[-2000:]
    figures = read_figures(dom)
    assert {"svg", "polyline", "table"} <= figures.tags
    assert_matches_audit(figures, audit)


def report_to_no_server(path: pathlib.Path) -> int:
    """`ledger report recall --html PATH` against an address that refuses every call."""
    with socket.socket() as closed:  # bound, never listening: a call to it is refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        return cli.main(["report", "recall", "--html", str(path), "--server", address])


@pytest.mark.parametrize("where", ["reports", "missing/recall.html"])
def test_a_report_path_that_cannot_be_a_page_is_refused_before_the_server_is_asked(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, where: str
) -> None:
    # `--html reports/` (the directory meant to hold the page) exited 1, the status of a
    # call the server refused; and both it and a missing directory were found only
    # after the audit had been read, so a server that did not answer hid them (exit 3).
    (tmp_path / "reports").mkdir()
    path = tmp_path / where
    code = report_to_no_server(path)
    said = capsys.readouterr().err
    assert code == 2, said
    if where == "reports":
        assert said == f"ledger: --html: {str(path)!r} is a directory: name the page's file\n"
    else:
        assert said == f"ledger: --html: {str(path.parent)!r} is not a directory\n"
    assert list((tmp_path / "reports").iterdir()) == []


@pytest.mark.parametrize("kind", ["pipe", "link"])
def test_a_report_path_that_is_no_regular_file_is_refused_and_left_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, kind: str
) -> None:
    # The page is written to a temporary file and renamed over the path, so
    # `--html /dev/null` (or a pipe) replaced the device with an HTML file, and
    # `--html /dev/stdout` the link: as root, for the whole machine.
    pipe = tmp_path / "page.html"
    if kind == "pipe":
        os.mkfifo(pipe)
    else:
        (tmp_path / "real.html").write_text("old")
        pipe.symlink_to(tmp_path / "real.html")
    code = report_to_no_server(pipe)
    said = capsys.readouterr().err
    assert code == 2, said
    assert said == (
        f"ledger: --html: {str(pipe)!r} is not a regular file (a link, a device, a pipe "
        "or a socket): name the page's own file\n"
    )
    mode = pipe.lstat().st_mode
    assert stat.S_ISFIFO(mode) if kind == "pipe" else stat.S_ISLNK(mode)
