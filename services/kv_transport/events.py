"""What the receiving side hands to its user, and the byte budget behind backpressure."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from services.kv_transport.codecs import NONE
from services.kv_transport.protocol import DATA, LAYOUT


@dataclass(frozen=True, slots=True)
class Frame:
    """Blocks ``[block_start, block_start + num_blocks)`` of one layer of one transfer, coded with
    ``codec`` (``row_elems`` values per scale; checked against the handshake: ``codecs``); or, of
    kind LAYOUT, the sender's KV layout (see ``protocol``)."""

    transfer_id: str
    layer: int
    group: int
    block_start: int
    num_blocks: int
    payload: memoryview
    kind: int = DATA
    codec: int = NONE
    row_elems: int = 0

    @property
    def is_layout(self) -> bool:
        return self.kind == LAYOUT

    @property
    def block_index(self) -> int:
        """Which block of its transfer a one-block frame carries (``protocol.block_frame_fields``)."""
        return self.layer


@dataclass(frozen=True, slots=True)
class TransferDone:
    """Every frame of the transfer arrived intact (all its ``Frame`` events came before this)."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class TransferFailed:
    transfer_id: str
    reason: str


Event = Frame | TransferDone | TransferFailed


class ByteBudget:
    """A counting limit in bytes. ``acquire`` blocks while the budget is spent; one item larger
    than the whole budget is still admitted when nothing else is held, so nothing deadlocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, num_bytes: int, timeout: float | None = None) -> bool:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.used == 0 or self.used + num_bytes <= self.limit, timeout)
            if ok:
                self.used += num_bytes
            return ok

    def release(self, num_bytes: int) -> None:
        """Waiters are woken once a quarter of the budget is free (or none is used), not for every
        release: a waiter woken per frame would trade the CPU with the releasing thread per frame."""
        with self._cond:
            self.used -= num_bytes
            if self.used == 0 or self.limit - self.used >= self.limit // 4:
                self._cond.notify_all()
