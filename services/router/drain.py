"""The router's stop: refuse new requests, let those in flight finish within a bound, then end the rest
with an error the client sees (never a stream cut short in silence)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator
from typing import TypeVar

from services.router.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_AFTER_S = 5


def stopping_error() -> ApiError:
    return ApiError(503, "The server is stopping; retry the request.", type="service_unavailable",
                    code="server_stopping", retry_after_s=RETRY_AFTER_S)


class RouterStopping(Exception):
    """A request's wait was cut because the router stops and its drain bound has passed."""


class Drain:
    """Owned by the HTTP app: requests enter through ``tracked()``; ``run()`` is the stop."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired = asyncio.Event()

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if not self.num_in_flight:
                self._idle.set()

    async def run(self, timeout_s: float, ending_s: float = 5.0) -> None:
        """Refuse new requests, wait up to ``timeout_s`` for those in flight; then make every wait in
        ``until_stopped`` raise, and give the requests ``ending_s`` to tell their clients."""
        self.draining = True
        logger.info("router draining: %d requests in flight, up to %.0f s (router.drain_timeout_s)",
                    self.num_in_flight, timeout_s)
        if await self._wait_idle(timeout_s):
            return
        logger.warning("router drain bound passed: ending %d requests in flight with an error", self.num_in_flight)
        self._expired.set()
        await self._wait_idle(ending_s)

    async def until_stopped(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, or RouterStopping once the drain bound has passed (the awaitable is
        then cancelled, and has ended, before this raises)."""
        step = asyncio.ensure_future(awaitable)
        expired = asyncio.ensure_future(self._expired.wait())
        try:
            done, _ = await asyncio.wait((step, expired), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancelled(step)
            raise
        finally:
            expired.cancel()
        if step in done:
            return step.result()
        await _cancelled(step)
        raise RouterStopping

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has ended (a generator it steps must not be closed while it runs)."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a step cut by the router's stop ended with %r", task.exception())
