"""What a worker holds that every router must agree on: its run-time role and drain state (changed
only by compare-and-set, ``SetRole``) and its hand-off slots. Plain classes; the RPC edge
(services/engine/worker_rpc.py) translates their refusals into gRPC statuses."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FLIP_ROLES = ("prefill", "decode")
# A hand-off reservation the Prefill does not claim within this long goes back (its router died or
# gave up between the two calls, which it makes back to back).
RESERVATION_TTL_S = 10.0


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
    (0: no limit), whatever the number of routers sending them.

    A router takes a slot in two steps: ``reserve`` waits its turn in one queue, first come first
    served across every router, and holds a slot for up to ``ttl_s``; the Prefill call naming the
    reservation takes that slot over (``held``). A slot that frees goes straight to the first caller
    still waiting, so a Prefill without a reservation never overtakes the queue."""

    def __init__(self, limit: int, ttl_s: float = RESERVATION_TTL_S) -> None:
        self.limit = limit
        self.num_held = 0
        self.peak_held = 0
        self._ttl_s = ttl_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reserved: dict[str, asyncio.TimerHandle] = {}

    @property
    def num_waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def reserve(self, wait_s: float) -> str:
        """A reservation id ("" without a limit); raises Busy when no slot came within ``wait_s``."""
        if not self.limit:
            return ""
        if self.num_held < self.limit:
            self._take()
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(wait_s):
                    await waiter
            except TimeoutError:
                if not _granted(waiter):
                    raise Busy(f"every hand-off slot is held ({self.num_held} of {self.limit}); "
                               f"waited {wait_s:g} s") from None
            except BaseException:
                if _granted(waiter):
                    self._free()
                raise
        reservation = uuid.uuid4().hex
        self._reserved[reservation] = asyncio.get_running_loop().call_later(self._ttl_s, self._expire, reservation)
        return reservation

    def refuse_waiters(self, reason: str) -> None:
        """Every caller still waiting gets Busy(reason) now (the worker drains)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(Busy(reason))

    def cancel(self, reservation: str) -> None:
        """The reservation's slot goes back (its Prefill was refused before it started)."""
        if (timer := self._reserved.pop(reservation, None)) is not None:
            timer.cancel()
            self._free()

    @contextlib.contextmanager
    def held(self, reservation: str = "") -> Iterator[None]:
        """The reservation's slot, else a free one; raises Busy when every slot is held."""
        if reservation and (timer := self._reserved.pop(reservation, None)) is not None:
            timer.cancel()
        elif self.limit and self.num_held >= self.limit:
            raise Busy(f"every hand-off slot is held ({self.num_held} of {self.limit})")
        else:
            self._take()
        try:
            yield
        finally:
            self._free()

    def _take(self) -> None:
        self.num_held += 1
        self.peak_held = max(self.peak_held, self.num_held)

    def _free(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot is the waiter's now: num_held stays
                return
        self.num_held -= 1

    def _expire(self, reservation: str) -> None:
        if self._reserved.pop(reservation, None) is not None:
            logger.warning("hand-off reservation %s expired unused (its router never sent the Prefill); "
                           "the slot goes back", reservation)
            self._free()


def _granted(waiter: asyncio.Future[None]) -> bool:
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None
