"""Pushes waiting to be sent over the pool's KV transport: a bounded queue drained by one sender
thread, so a Push RPC returns once its blocks are queued and never holds a gRPC thread while the
transport applies backpressure. A full queue refuses the Push (``PushQueueFull``) instead of waiting."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from services.cache_pool_client.types import Block

logger = logging.getLogger(__name__)

MAX_PENDING_PUSHES = 16


class PushQueueFull(Exception):
    """As many pushes as the queue holds are waiting to be sent: the caller should retry later."""


@dataclass(frozen=True, slots=True)
class Push:
    target: str
    transfer_id: str
    blocks: Sequence[Block]


class PushQueue:
    def __init__(self, transport, max_pending: int = MAX_PENDING_PUSHES) -> None:
        """``transport``: the pool's ``KVTransport``; at most ``max_pending`` pushes wait to be sent."""
        self._transport = transport
        self.max_pending = max_pending
        self._pending: queue.Queue[Push] = queue.Queue(max_pending)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="prfaas-pool-push", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._pending.qsize()

    def submit(self, push: Push) -> None:
        """Queue a push without waiting; ``PushQueueFull`` when ``max_pending`` are already waiting."""
        try:
            self._pending.put_nowait(push)
        except queue.Full:
            raise PushQueueFull(f"{self.max_pending} pushes are already waiting for the KV transport "
                                f"(transfer {push.transfer_id} refused): retry later") from None

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop after the push being sent (waiting up to ``timeout_s`` for it); pushes still queued are
        dropped, and their receivers time out."""
        self._closed.set()
        self._thread.join(timeout_s)

    def _send_loop(self) -> None:
        while not self._closed.is_set():
            try:
                push = self._pending.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                for i, block in enumerate(push.blocks):
                    self._transport.send_block(push.target, push.transfer_id, i, block.group_id, block.data)
                self._transport.finish(push.target, push.transfer_id)
            except Exception:  # noqa: BLE001 - one failed push must not stop the others
                logger.exception("cache pool: push of transfer %s to %s failed", push.transfer_id, push.target)
