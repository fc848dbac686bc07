"""A Prefill call that stands behind its KV: it fails when the transfer to the decode worker fails.

The engine's prefill ends when its KV is computed, while the transport sends it from the engine's
own process; a send that cannot connect, or stalls (``transport.stall_timeout_s``), fails only
there. The connector publishes its sending transfers, and the ones that failed with why
(``TransportSnapshot.sends_pending``/``sends_failed``, every ``stats_file.PUBLISH_S``), so the call
watches them: a failure aborts the prefill and fails the call (``KvSendFailed``), which the router
answers with a local prefill. After the prefill, the call waits until its transfer has left the
sender (or failed); a failure only seen once the call returned is the decode worker's to notice.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from services.kv_connector.layouts.tp_routes import WIRE_SEPARATOR
from services.kv_connector.stats_file import PUBLISH_S
from services.kv_transport.telemetry import TransportSnapshot
from services.worker_api.types import TokenDelta

POLL_S = 0.1
SETTLE_S = 2 * PUBLISH_S  # after the prefill: a failure before its end is published by then


class KvSendFailed(Exception):
    """The request's KV transfer failed at the sender; the message says why."""


class KvSendWatch:
    """One request's transfer, as the connector's latest published snapshot shows it (``snapshot``
    returns None while there is none: nothing is known, so nothing fails)."""

    def __init__(self, transfer_id: str, snapshot: Callable[[], TransportSnapshot | None]) -> None:
        self._transfer_id = transfer_id
        self._snapshot = snapshot

    def _ours(self, wire_id: str) -> bool:
        """Each TP rank sends its own stream, ``<transfer id>#p<rank>`` (``tp_routes.wire_id``)."""
        return wire_id == self._transfer_id or wire_id.startswith(self._transfer_id + WIRE_SEPARATOR)

    def failure(self) -> str | None:
        snapshot = self._snapshot()
        if snapshot is None:
            return None
        return next((why for wire_id, why in snapshot.sends_failed if self._ours(wire_id)), None)

    def pending(self) -> bool:
        snapshot = self._snapshot()
        return snapshot is not None and any(self._ours(wire_id) for wire_id in snapshot.sends_pending)

    async def prefill(self, stream: AsyncIterator[TokenDelta]) -> TokenDelta | None:
        """The stream's last delta; raises KvSendFailed (the stream is closed, which aborts the
        prefill) as soon as the transfer failed."""
        drain = asyncio.ensure_future(_last(stream))
        try:
            while not drain.done():
                await asyncio.wait({drain}, timeout=POLL_S)
                if not drain.done() and (why := self.failure()) is not None:
                    raise KvSendFailed(why)
            return drain.result()
        finally:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)

    async def wait_for_sent(self) -> None:
        """Returns once the transfer has left the sender; raises KvSendFailed if it failed. The sender
        fails a transfer that makes no progress within its bound, so this ends."""
        settled = time.monotonic() + SETTLE_S
        while True:
            if (why := self.failure()) is not None:
                raise KvSendFailed(why)
            if time.monotonic() >= settled and not self.pending():
                return
            await asyncio.sleep(POLL_S)


async def _last(stream: AsyncIterator[TokenDelta]) -> TokenDelta | None:
    last = None
    async for delta in stream:
        last = delta
    return last
