"""Worker choice: a pure function of a frozen snapshot (no I/O, no clock)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerView:
    name: str
    healthy: bool
    accepts_generate: bool
    num_in_flight: int
    num_active: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float

    @property
    def load(self) -> int:
        return max(self.num_in_flight, self.num_active, self.num_running + self.num_waiting)


def pick_least_loaded(workers: tuple[WorkerView, ...], exclude: frozenset[str] = frozenset()) -> str | None:
    """The healthy generate-capable worker with the least load (then KV usage, then name); None if none."""
    candidates = [w for w in workers if w.healthy and w.accepts_generate and w.name not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load, w.kv_cache_usage, w.name)).name
