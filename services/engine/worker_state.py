"""What a worker holds that every router must agree on: its run-time role and drain state (changed
only by compare-and-set, ``SetRole``) and its hand-off slots. Plain classes; the RPC edge
(services/engine/worker_rpc.py) translates their refusals into gRPC statuses."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

FLIP_ROLES = ("prefill", "decode")


class StaleGeneration(Exception):
    """A compare-and-set named a generation other than the current one."""

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(f"role generation {expected} is stale: the worker is at generation {current}")
        self.expected = expected
        self.current = current


class NotFlippable(Exception):
    """The request asks for a role this worker cannot take."""


class Busy(Exception):
    """The worker cannot take this request now (draining, another role, or no free slot): wait or try
    another worker; not a failure."""


@dataclass(frozen=True, slots=True)
class RoleSnapshot:
    role: str
    draining: bool
    generation: int


class RoleState:
    """The worker's run-time role, owned here; generation 1 at start, one more per change."""

    def __init__(self, configured_role: str) -> None:
        self._configured = configured_role
        self._current = RoleSnapshot(configured_role, False, 1)

    @property
    def current(self) -> RoleSnapshot:
        return self._current

    def compare_and_set(self, expected_generation: int, role: str, draining: bool) -> RoleSnapshot:
        """Raises StaleGeneration unless ``expected_generation`` is current, NotFlippable for a role
        outside ``FLIP_ROLES`` or a worker not configured with one of them."""
        if role not in FLIP_ROLES:
            raise NotFlippable(f"role must be one of {', '.join(FLIP_ROLES)}, not {role!r}")
        if self._configured not in FLIP_ROLES:
            raise NotFlippable(f"this worker's configured role is {self._configured!r}; only prefill and decode "
                               "workers flip")
        if expected_generation != self._current.generation:
            raise StaleGeneration(expected_generation, self._current.generation)
        self._current = RoleSnapshot(role, draining, self._current.generation + 1)
        return self._current

    def check_generate(self) -> None:
        """Raises Busy when the worker takes no new generation (draining, or flipped to prefill)."""
        if self._current.draining:
            raise Busy("the worker is draining for a role flip")
        if self._current.role == "prefill" and self._current.generation > 1:
            raise Busy("the worker was flipped to prefill")

    def check_prefill(self) -> None:
        if self._current.draining:
            raise Busy("the worker is draining for a role flip")


class HandoffSlots:
    """Hand-offs (Prefill calls that stream KV to another worker) open at once, at most ``limit``
    (0: no limit), whatever the number of routers sending them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_held = 0
        self.peak_held = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Raises Busy when every slot is held."""
        if self.limit and self.num_held >= self.limit:
            raise Busy(f"every hand-off slot is held ({self.num_held} of {self.limit})")
        self.num_held += 1
        self.peak_held = max(self.peak_held, self.num_held)
        try:
            yield
        finally:
            self.num_held -= 1
