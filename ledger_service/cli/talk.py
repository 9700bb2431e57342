"""Commands that talk to a running server over gRPC (filled in below)."""

from __future__ import annotations

from typing import Any


def register(commands: Any) -> None:
    del commands
