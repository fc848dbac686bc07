"""The machine's process table, read from /proc: what tests and benchmarks check for leftovers."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    state: str      # R, S, D, Z (zombie), ...
    ppid: int
    pgid: int
    sid: int

    @property
    def alive(self) -> bool:
        return self.state != "Z"


def processes() -> list[Process]:
    """Every process now (one that ends while it is read is left out)."""
    table = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table.append(Process(int(entry), fields[0], int(fields[1]), int(fields[2]), int(fields[4])))
    return table


def group_pids(pgid: int) -> list[int]:
    return [p.pid for p in processes() if p.pgid == pgid]


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the process group."""
    return any(p.alive for p in processes() if p.pgid == pgid)


def descendants(root: int) -> list[int]:
    """Every process below ``root`` now: its children, theirs, and the members of their sessions
    (a service started in a session of its own keeps its engines there after it exits)."""
    table = processes()
    found, frontier = set(), {root}
    while frontier:
        found |= frontier
        frontier = {p.pid for p in table if p.ppid in frontier or p.sid in frontier} - found
    return sorted(found - {root})


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
