"""A misspelt option is named, even when the option it was meant to be is a
required one: `--limt $1` said only that --limit is required, which the
operator had (they thought) given."""

from __future__ import annotations

import pytest

from ledger_service.cli import main
from ledger_service.cli.exits import EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["lane", "put", "x", "--limt", "$1", "--price", "j=1/1"], "--limt"),
        (["reserve", "rc", "r1", "--modle=jev", "--request-bytes", "1"], "--modle"),
        (["--versoin"], "--versoin"),
    ],
)
def test_a_misspelt_required_option_is_named(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == EXIT_BAD_VALUE
    (line,) = capsys.readouterr().err.splitlines()
    assert f"unrecognized arguments: {named}" in line
    assert "required" in line


def test_a_known_option_in_a_short_form_is_not_called_unrecognized(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["lane", "put", "x", "--pri", "j=1/1"])
    (line,) = capsys.readouterr().err.splitlines()
    assert "unrecognized" not in line
    assert "the following arguments are required: --limit" in line
