"""The producer half: copies a layer's blocks of a request out of the paged cache without the engine
thread or the compute stream ever waiting for it.

``save`` runs on the engine thread, right after the layer's attention was enqueued: it records an
event on the compute stream; the side stream waits for that event, gathers the blocks into a GPU
staging buffer (``index_select``) and copies them into a ring slot (``non_blocking``), then records
a done event. A sender thread waits for done events, in order, and hands each slot's bytes (a view
of the pinned memory) to the caller's ``deliver``, which gives the slot back once the bytes are sent.
``fence`` makes the compute stream's later work (the next step may reuse a finished request's
blocks) wait for the gathers issued so far: a dependency between streams, not a host wait.

On CPU the gather writes straight into the slot, the events complete at once, and ``deliver`` runs
on the calling thread unless ``threaded`` asks for the sender thread (tests do, to run its code).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.kv_connector.device.ring import HostRing, Slot
from services.kv_connector.device.streams import Device

logger = logging.getLogger(__name__)

# deliver(first, count, payload, release): blocks [first, first + count) of the call's block ids
# are in ``payload``; ``release()`` must be called once the payload is no longer read.
Deliver = Callable[[int, int, memoryview, Callable[[], None]], None]


@dataclass(slots=True)
class _Copy:
    slot: Slot
    num_bytes: int
    first: int
    count: int
    deliver: Deliver
    done: Any
    held: torch.Tensor  # what the copy reads (its index, or the bytes made): kept until it completed


class LayerSaver:
    def __init__(self, device: Device, ring: HostRing, threaded: bool | None = None) -> None:
        self.device = device
        self.ring = ring
        self.num_failed = 0
        self._staging: torch.Tensor | None = None  # on CUDA: the gather's target, one slot's size
        self._copies: queue.SimpleQueue[_Copy | Callable[[], None] | None] = queue.SimpleQueue()
        self._num_pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        if device.is_cuda if threaded is None else threaded:
            self._thread = threading.Thread(target=self._send_loop, daemon=True, name="prfaas-kv-save")
            self._thread.start()

    def save(self, cache: torch.Tensor, block_dim: int, block_ids: Sequence[int], deliver: Deliver) -> None:
        """Queue copies of ``block_ids`` of ``cache`` (its blocks along ``block_dim``), in slot-sized
        chunks; called on the engine thread, waits only for a free slot."""
        if not block_ids:
            return
        side = self._after_layer()
        per_slot = self.blocks_per_slot(cache, block_dim)
        for first in range(0, len(block_ids), per_slot):
            self._queue_copy(cache, block_dim, block_ids[first:first + per_slot], first, deliver, side)

    def save_made(self, make: Callable[[Sequence[int]], torch.Tensor], block_bytes: int, block_ids: Sequence[int],
                  deliver: Deliver, max_run_bytes: int | None = None) -> None:
        """As ``save``, for bytes that ``make(ids)`` cuts out of the cache (a contiguous tensor of
        ``block_bytes`` per block of ``ids``: e.g. the heads a consumer of another TP size gets), in
        runs of blocks of at most a slot (and ``max_run_bytes``, but at least one block). ``make``
        runs on the engine thread with the side stream current, so its kernels run there, after the
        layer; its result is copied into a slot and kept until that copy completed."""
        if not block_ids:
            return
        side = self._after_layer()
        per_slot = self._per_slot(block_bytes)
        if max_run_bytes is not None:
            per_slot = min(per_slot, max(1, max_run_bytes // block_bytes))
        for first in range(0, len(block_ids), per_slot):
            ids = block_ids[first:first + per_slot]
            slot = self.ring.acquire()
            try:
                with self.device.use(side):
                    made = make(ids).reshape(-1).view(torch.uint8)
                    slot.memory[:made.numel()].copy_(made, non_blocking=self.device.is_cuda)
                    done = self.device.event()
                    done.record(side)
            except BaseException:
                self.ring.release(slot)
                raise
            self._put(_Copy(slot, made.numel(), first, len(ids), deliver, done, made))

    def _after_layer(self) -> Any:
        """The side stream, made to wait for what the compute stream enqueued so far (the layer)."""
        ready = self.device.event()
        ready.record(self.device.current_stream())
        side = self.device.side_stream()
        side.wait_event(ready)
        return side

    def blocks_per_slot(self, cache: torch.Tensor, block_dim: int) -> int:
        return self._per_slot(cache.numel() // cache.shape[block_dim] * cache.element_size())

    def _per_slot(self, block_bytes: int) -> int:
        if block_bytes > self.ring.slot_bytes:
            raise ValueError(f"a block of {block_bytes} bytes does not fit a host ring slot of "
                             f"{self.ring.slot_bytes} bytes")
        return self.ring.slot_bytes // block_bytes

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every copy queued so far was delivered (on the sender thread; at once
        on the calling thread when there is none): ends a transfer after its last frame."""
        self._put(action)

    def fence(self) -> None:
        """Later work on the compute stream waits for every gather issued so far (GPU side only)."""
        if self.device.is_cuda:
            self.device.current_stream().wait_stream(self.device.side_stream())

    def flush(self) -> None:
        """Wait until every queued copy was handed to its ``deliver`` (for a request's end and
        ``handle_preemptions``: its blocks may be reused after this). Waits on the host only."""
        with self._idle:
            self._idle.wait_for(lambda: self._num_pending == 0)

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._copies.put(None)
            self._thread.join()

    def _queue_copy(self, cache: torch.Tensor, block_dim: int, block_ids: Sequence[int], first: int,
                    deliver: Deliver, side: Any) -> None:
        slot = self.ring.acquire()
        try:
            with self.device.use(side):
                index, num_bytes = self._gather(cache, block_dim, block_ids, slot)
                done = self.device.event()
                done.record(side)
        except BaseException:
            self.ring.release(slot)
            raise
        self._put(_Copy(slot, num_bytes, first, len(block_ids), deliver, done, index))

    def _put(self, item: _Copy | Callable[[], None]) -> None:
        if self._thread is None:
            self._run(item)
            return
        with self._idle:
            self._num_pending += 1
        self._copies.put(item)

    def _gather(self, cache: torch.Tensor, block_dim: int, block_ids: Sequence[int],
                slot: Slot) -> tuple[torch.Tensor, int]:
        """Issue the gather into ``slot`` on the current (side) stream; the index and the byte count."""
        shape = list(cache.shape)
        shape[block_dim] = len(block_ids)
        num_bytes = cache.numel() // cache.shape[block_dim] * len(block_ids) * cache.element_size()
        index = self.device.index(block_ids)
        if not self.device.is_cuda:
            torch.index_select(cache, block_dim, index, out=_typed(slot.memory, num_bytes, cache.dtype, shape))
            return index, num_bytes
        staging = self._staging_buffer()
        torch.index_select(cache, block_dim, index, out=_typed(staging, num_bytes, cache.dtype, shape))
        slot.memory[:num_bytes].copy_(staging[:num_bytes], non_blocking=True)
        return index, num_bytes

    def _staging_buffer(self) -> torch.Tensor:
        """One slot's worth of GPU memory, reused by every gather: the side stream runs them in order."""
        if self._staging is None:
            self._staging = torch.empty(self.ring.slot_bytes, dtype=torch.uint8, device=self.device.device)
        return self._staging

    def _send_loop(self) -> None:
        self.device.bind_thread()
        while (item := self._copies.get()) is not None:
            try:
                self._run(item)
            except Exception:
                logger.exception("a step queued after KV copies failed")
            finally:
                with self._idle:
                    self._num_pending -= 1
                    self._idle.notify_all()

    def _run(self, item: _Copy | Callable[[], None]) -> None:
        if not isinstance(item, _Copy):
            item()
            return
        release = _releaser(self.ring, item.slot)
        try:
            item.done.synchronize()
            item.deliver(item.first, item.count, item.slot.view(item.num_bytes), release)
        except Exception:
            self.num_failed += 1
            release()
            logger.exception("KV copy of blocks %d+%d could not be delivered", item.first, item.count)


def _typed(memory: torch.Tensor, num_bytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return memory[:num_bytes].view(dtype).view(shape)


def _releaser(ring: HostRing, slot: Slot) -> Callable[[], None]:
    """Gives ``slot`` back once, however many times it is called."""
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):
            ring.release(slot)
    return release
