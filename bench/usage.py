"""What a server process spends while a phase is measured: CPU and context switches.

Read from /proc (Linux) at the end of the warm-up and at the end of the
measurement, and divided by the calls counted in between. Near saturation a
Python gRPC server spends much of its CPU switching between its threads (each
call crosses the completion-queue thread and a worker thread, and every
thread that runs Python takes the GIL in turn); these two figures per call,
beside the echo's, say how much of a call's cost is that and how much is work.

The CPU is the process's user and system time (every thread's, the exited
ones' too). The switches are summed over the threads alive at each reading,
so a thread that ends between the two readings takes its own with it: the
servers measured keep their threads for their whole life.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterable
from typing import Any

PROC = pathlib.Path("/proc")


@dataclasses.dataclass(frozen=True)
class Usage:
    """Totals of one or more processes at one instant, or a difference of two."""

    cpu_seconds: float
    voluntary_switches: int
    involuntary_switches: int

    def __sub__(self, earlier: Usage) -> Usage:
        return Usage(
            self.cpu_seconds - earlier.cpu_seconds,
            self.voluntary_switches - earlier.voluntary_switches,
            self.involuntary_switches - earlier.involuntary_switches,
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.cpu_seconds + other.cpu_seconds,
            self.voluntary_switches + other.voluntary_switches,
            self.involuntary_switches + other.involuntary_switches,
        )

    @property
    def switches(self) -> int:
        return self.voluntary_switches + self.involuntary_switches

    def per_call(self, calls: int) -> dict[str, Any]:
        """The JSON form, with the figures per counted call (None without calls)."""
        return {
            **dataclasses.asdict(self),
            "calls": calls,
            "cpu_ms_per_call": self.cpu_seconds * 1000 / calls if calls else None,
            "switches_per_call": self.switches / calls if calls else None,
        }


ZERO = Usage(0.0, 0, 0)


def read(pids: Iterable[int]) -> Usage | None:
    """The processes' totals now; None when one is gone or /proc cannot tell."""
    total = ZERO
    try:
        ticks_per_second = os.sysconf("SC_CLK_TCK")
        for pid in pids:
            total = total + _read_one(PROC / str(pid), ticks_per_second)
    except (OSError, ValueError, IndexError):
        return None
    return total


def _read_one(process: pathlib.Path, ticks_per_second: int) -> Usage:
    # Fields after the command's closing parenthesis: utime and stime are the
    # 12th and 13th (proc(5) numbers them 14 and 15).
    fields = (process / "stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    cpu_seconds = (int(fields[11]) + int(fields[12])) / ticks_per_second
    voluntary = involuntary = 0
    for task in (process / "task").iterdir():
        try:
            status = (task / "status").read_text(encoding="ascii")
        except FileNotFoundError:
            continue  # the thread ended just now
        for line in status.splitlines():
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return Usage(cpu_seconds, voluntary, involuntary)
