"""Block bytes that other pools push to this one over the KV transport, held until a Put claims them.

A cross-cluster copy is two calls the router makes at once: ``Put(kv_transfer_id=T)`` on the target
pool (metadata: which blocks) and ``Push(kv_transfer_id=T)`` on the source pool (the bytes, sent
pool to pool over the KV transport). Frames may arrive before or after the Put; ``take`` waits for
the whole transfer. A transfer nobody claims within ``expire_s`` is dropped, so memory held here
is bounded by what arrives in that time (a transfer counts as unclaimed from its last frame).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from services.kv_transport import Frame, KVTransport, TransferDone, TransferFailed

logger = logging.getLogger(__name__)


class TransferError(Exception):
    """The transfer failed at the transport, or did not complete in time."""


@dataclass(slots=True)
class _Arrival:
    frames: list[Frame] = field(default_factory=list)
    done: bool = False
    failed: str | None = None
    last_event: float = field(default_factory=time.monotonic)


class TransferInbox:
    def __init__(self, transport: KVTransport, expire_s: float) -> None:
        self.transport = transport
        self._expire_s = expire_s
        self._arrivals: dict[str, _Arrival] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._receive_loop, name="prfaas-pool-inbox", daemon=True).start()

    def take(self, transfer_id: str, timeout_s: float, still_wanted=lambda: True) -> list[Frame]:
        """The transfer's frames once complete; ``TransferError`` when it failed, did not complete in
        ``timeout_s``, or ``still_wanted()`` turned false (the caller gave up)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                arrival = self._arrivals.get(transfer_id)
                if arrival is not None and (arrival.done or arrival.failed):
                    del self._arrivals[transfer_id]
                    if arrival.failed:
                        raise TransferError(arrival.failed)
                    return arrival.frames
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not still_wanted() or self._closed:
                    self._arrivals.pop(transfer_id, None)
                    self.transport.forget(transfer_id)
                    raise TransferError(f"KV transfer {transfer_id} did not complete in {timeout_s:.0f} s")
                self._cond.wait(min(remaining, 0.5))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.transport.close()

    def _receive_loop(self) -> None:
        while not self._closed:
            events = self.transport.poll(0.5)
            with self._cond:
                for event in events:
                    arrival = self._arrivals.setdefault(event.transfer_id, _Arrival())
                    arrival.last_event = time.monotonic()
                    if isinstance(event, Frame):
                        arrival.frames.append(event)
                    elif isinstance(event, TransferDone):
                        arrival.done = True
                    elif isinstance(event, TransferFailed):
                        arrival.failed = event.reason
                self._expire()
                if events:
                    self._cond.notify_all()

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, a in self._arrivals.items() if now - a.last_event > self._expire_s]:
            del self._arrivals[transfer_id]
            self.transport.forget(transfer_id)
            logger.warning("KV transfer %s into the pool expired unclaimed", transfer_id)
