"""The machine a run measured: what the figures are figures of."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import sqlite3
import subprocess
from typing import Any


def _first_value(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


GIT_TIMEOUT_SECONDS = 10.0


def source_revision() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    root = pathlib.Path(__file__).resolve().parents[1]

    def git(*arguments: str) -> str:
        done = subprocess.run(
            ["git", *arguments],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_SECONDS,
            check=False,
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "HEAD")
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", "ledger_service", "bench"
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": "", "uncommitted_changes": None}
    return {"commit": commit, "uncommitted_changes": bool(changed) if commit else None}


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: how busy the machine was besides us."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def describe(postgres_version: str = "") -> dict[str, Any]:
    memory_kb = _first_value("/proc/meminfo", "MemTotal").split()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _first_value("/proc/cpuinfo", "model name") or platform.processor(),
        "memory_bytes": int(memory_kb[0]) * 1024 if memory_kb else 0,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "sqlalchemy": _version("sqlalchemy"),
        "sqlite": sqlite3.sqlite_version,
        "postgresql": postgres_version,
    }
