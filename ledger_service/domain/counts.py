"""Counts in operators' sentences: "1 lane", "2 lanes", never "1 lanes"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str = "") -> str:
    """`count` and its noun, singular for exactly one; `plural` defaults to
    the noun plus "s" (give it for "entry" / "entries")."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
