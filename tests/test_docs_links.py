"""Every document a clone has points only at files a clone has: each relative
Markdown link resolves, and nothing names the team's shared folder outside the
repository (its contract now lives in docs/semantics.md)."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
# [text](target) with a target that is not a URL or an in-page anchor.
_LINK = re.compile(r"\[[^\]]*\]\((?!https?://|mailto:|#)([^)\s]+)\)")
_OUTSIDE = re.compile(r"(?:\.\./)?shared/|seeds/0|ledger-semantics\.md")


# A repository path a comment or a document names as a test file.
_TEST_FILE = re.compile(r"(?<![\w/.])((?:clients/\w+/)?tests/[\w/]+\.(?:py|js))")


def _files(*patterns: str) -> list[pathlib.Path]:
    listed = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if "node_modules" not in name]


def _documents() -> list[pathlib.Path]:
    return _files("*.md")


def _sources() -> list[pathlib.Path]:
    """Code and protocol files, whose comments are read as documents are."""
    here = pathlib.Path(__file__).resolve()
    return [path for path in _files("*.py", "*.js", "*.ts", "*.proto") if path != here]


def test_every_relative_link_resolves() -> None:
    broken = []
    for document in _documents():
        for target in _LINK.findall(document.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path and not (document.parent / path).exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_document_or_comment_names_a_file_outside_the_repository() -> None:
    found = [
        f"{document.relative_to(ROOT)}:{number}: {line.strip()}"
        for document in [*_documents(), *_sources()]
        for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert not found, found


def test_every_test_file_a_comment_or_document_names_exists() -> None:
    missing = [
        f"{document.relative_to(ROOT)}: {name}"
        for document in [*_documents(), *_sources()]
        for name in _TEST_FILE.findall(document.read_text(encoding="utf-8"))
        if not (ROOT / name).exists() and not (document.parent / name).exists()
    ]
    assert not missing, missing


def test_the_contract_is_in_the_repository_and_the_readmes_link_it() -> None:
    assert (ROOT / "docs" / "semantics.md").is_file()
    for readme, link in (
        ("README.md", "docs/semantics.md"),
        ("clients/python/README.md", "../../docs/semantics.md"),
        ("clients/node/README.md", "../../docs/semantics.md"),
    ):
        assert f"]({link}" in (ROOT / readme).read_text(encoding="utf-8"), readme
