"""`ledger` commands given a URI-form SQLite URL, as an operator types them:
one line naming the setting and the accepted form, exit 2, and no stray
`file:` directory made in the working directory."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests import serving

URL = "sqlite:///file:{dir}/ledger.db?mode=ro&uri=true"


@pytest.mark.parametrize(
    "command",
    [["serve", "--listen", "127.0.0.1:0"], ["migrate"], ["verify"], ["snapshot"]],
    ids=lambda argv: argv[0],
)
def test_a_uri_form_database_url_is_refused_in_one_line(
    tmp_path: pathlib.Path, command: list[str]
) -> None:
    data = tmp_path / "data"
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), *command, "--data-dir", str(data),
         "--database-url", URL.format(dir=tmp_path)],
        cwd=tmp_path, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--database-url " in done.stderr, done.stderr
    assert "sqlite:////absolute/path/ledger.db" in done.stderr, done.stderr
    assert "no database" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "file:").exists()
