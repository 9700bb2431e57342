"""`ledger verify --at-us` past the instants the ledger keeps (an int64 the
database cannot hold, before 1970): one line naming the option, exit 2, never
a traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests import serving

LEDGER = pathlib.Path(sys.executable).with_name("ledger")


def _ledger(data: pathlib.Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LEDGER), *argv, "--data-dir", str(data)],
        cwd=data, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    data = tmp_path_factory.mktemp("verify-instant")
    assert _ledger(data, "migrate").returncode == 0
    return data


@pytest.mark.parametrize("instant", ["9223372036854775808", "-1"])
def test_an_instant_out_of_range_is_refused_in_one_line(
    data_dir: pathlib.Path, instant: str
) -> None:
    done = _ledger(data_dir, "verify", f"--at-us={instant}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "--at-us" in done.stderr and "1970" in done.stderr, done.stderr


def test_an_instant_in_range_is_verified(data_dir: pathlib.Path) -> None:
    done = _ledger(data_dir, "verify", "--at-us=1800000000000000")
    assert done.returncode == 0, done.stderr
    assert "2027-01-15" in done.stdout, done.stdout


def test_the_first_instant_is_named_as_an_instant(data_dir: pathlib.Path) -> None:
    """0 is the first instant `--at-us` takes, not an unset one: its summary
    said `window totals at -`."""
    done = _ledger(data_dir, "verify", "--at-us=0")
    assert done.returncode == 0, done.stderr
    assert "window totals at 1970-01-01T00:00:00.000Z" in done.stdout, done.stdout
