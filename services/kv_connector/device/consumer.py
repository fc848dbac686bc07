"""The consumer half: copies received blocks into the paged cache without the engine thread waiting for
the GPU.

``write`` runs on the engine thread between forwards. On CUDA the transport reads frames straight
into pinned slots of a receive ring (``allocate``); a frame that found no slot (or lies in ordinary
memory: decoded, an inline pool block) is staged through PyTorch's pinned allocator, which keeps it
until its copy completed, so the engine thread never waits for a slot. On the side stream, after
everything enqueued so far on the compute stream (the zeroing of new blocks, reads of reused ones),
a ``non_blocking`` copy moves the bytes into a GPU staging buffer and ``index_copy_`` puts them in
their blocks; a done event closes each copy. A request counts as received only once all its copies'
events completed (``poll``, which never blocks). On CPU the blocks are written in place at once,
exactly as ``KVLayout.write_some`` writes them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device
from services.kv_transport.receiver import heap_buffer


COPY, WRITE = 1, 2  # the loader's side streams (host-to-device copies, writes into the cache); 0 is the saver's


class BlockLoader:
    def __init__(self, device: Device, slot_bytes: int, receive_ring: HostRing | None = None) -> None:
        """``slot_bytes``: the most bytes one batch (and each of the two GPU staging buffers) holds."""
        self.device = device
        self.slot_bytes = slot_bytes
        self.receive_ring = receive_ring
        self.pinned: list = []  # other pinned host memory frames may lie in (``pool.copies.PinnedRegion``)
        self._staging: list[torch.Tensor] = []  # two on the device: a batch's copy in, the last one's write
        self._staging_free: list[Any] = [None, None]  # when the write that read each one completed
        self._turn = 0
        self._pending: dict[str, list[tuple[Any, tuple]]] = {}  # key -> (done event, what its copy reads)
        self._batches: dict[int, _Batch] = {}  # by layer (its cache's id): received frames not yet copied in

    def allocate(self, num_bytes: int) -> memoryview:
        """Where the transport reads a frame of ``num_bytes`` (``KVTransport.receive_into``): a pinned
        slot of the receive ring while one is free and big enough, ordinary memory otherwise."""
        leased = self.receive_ring.lease(num_bytes) if self.receive_ring is not None else None
        return leased if leased is not None else heap_buffer(num_bytes)

    def write(self, key: str, cache: torch.Tensor, block_dim: int, payload: memoryview, keep: Sequence[int],
              block_ids: Sequence[int]) -> None:
        """Copy blocks ``keep`` of ``payload`` (blocks along ``block_dim``, as the producer gathered
        them) into ``block_ids`` (one per kept block) of ``cache``, for the request ``key``."""
        source = _source(cache, block_dim, payload)
        if self._is_pinned(source) and _run_of(keep, block_dim) and len(payload) <= self.slot_bytes:
            self._add(key, cache, source.narrow(0, keep[0], len(keep)), block_ids, payload)
            return
        if not self.device.is_cuda:
            if len(keep) != source.shape[block_dim]:
                source = source.index_select(block_dim, torch.tensor(keep, dtype=torch.long))
            cache.index_copy_(block_dim, torch.tensor(block_ids, dtype=torch.long), source)
            return
        self.flush()
        per_slot = max(1, self.slot_bytes // _block_bytes(cache, block_dim))
        for first in range(0, len(keep), per_slot):
            self._load(key, cache, block_dim, source, keep[first:first + per_slot], block_ids[first:first + per_slot])

    def busy(self, key: str) -> bool:
        """Whether copies for ``key`` may still be running (as of the last ``poll``)."""
        return key in self._pending or any(key in batch.keys for batch in self._batches.values())

    def poll(self) -> set[str]:
        """Issues the copies of frames written so far; the keys whose copies all completed since the
        last call. Never blocks."""
        self.flush()
        completed = set()
        for key, copies in list(self._pending.items()):
            while copies and copies[0][0].query():  # one stream: events complete in order
                copies.pop(0)
            if not copies:
                del self._pending[key]
                completed.add(key)
        return completed

    def fence(self) -> None:
        """Later work on the compute stream waits for every copy issued so far (GPU side only): for
        requests reported before their copies completed (failed ones), whose blocks vLLM may reuse."""
        self.flush()
        if self.device.is_cuda:
            self.device.current_stream().wait_stream(self.device.side_stream(WRITE))
            self.device.current_stream().wait_stream(self.device.side_stream(COPY))

    def _is_pinned(self, source: torch.Tensor) -> bool:
        address = source.data_ptr()
        return (self.receive_ring is not None and self.receive_ring.holds(address)) or \
            any(region.holds(address) for region in self.pinned)

    def flush(self) -> None:
        """Issue the copies of the frames gathered so far (``poll`` does)."""
        for batch in list(self._batches.values()):
            self._flush(batch)

    def _flush(self, batch: "_Batch") -> None:
        """The batch's frames go host-to-device on the copy stream into one of two staging buffers,
        and into their blocks on the write stream: the next batch's copy in overlaps this write."""
        del self._batches[id(batch.cache)]
        compute, copy, write = self.device.current_stream(), self.device.side_stream(COPY), \
            self.device.side_stream(WRITE)
        turn, self._turn = self._turn, 1 - self._turn
        with self.device.use(copy):
            copy.wait_stream(compute)  # the zeroing of new blocks, reads of reused ones
            if self._staging_free[turn] is not None:
                copy.wait_event(self._staging_free[turn])  # the write that last read this buffer
            staging, offset = self._staging_buffer(turn), 0
            for source in batch.sources:
                num_bytes = source.numel() * source.element_size()
                target = staging[offset:offset + num_bytes].view(source.dtype).view(source.shape)
                target.copy_(source, non_blocking=True)
                offset += num_bytes
            on_device_index = self.device.index(batch.block_ids)
            copied = self.device.event()
            copied.record(copy)
        with self.device.use(write):
            write.wait_event(copied)
            shape = (len(batch.block_ids), *batch.cache.shape[1:])
            on_device = staging[:offset].view(batch.cache.dtype).view(shape)
            batch.cache.index_copy_(0, on_device_index, on_device)
            done = self.device.event()
            done.record(write)
        self._staging_free[turn] = done
        self.device.keep_alive(on_device_index, write)
        held = (batch.payloads,)
        for key in batch.keys:
            self._pending.setdefault(key, []).append((done, held))

    def _add(self, key: str, cache: torch.Tensor, source: torch.Tensor, block_ids: Sequence[int],
             payload: memoryview) -> None:
        """Gather a pinned frame into the batch: one host-to-device copy each, and one index and one
        ``index_copy_`` per batch (a frame's own would cost more host time than its copy takes)."""
        num_bytes = source.numel() * source.element_size()
        batch = self._batches.get(id(cache))
        if batch is not None and batch.num_bytes + num_bytes > self.slot_bytes:
            self._flush(batch)
            batch = None
        if batch is None:
            batch = self._batches[id(cache)] = _Batch(cache)
        batch.add(key, source, block_ids, payload, num_bytes)

    def _load(self, key: str, cache: torch.Tensor, block_dim: int, source: torch.Tensor, keep: Sequence[int],
              block_ids: Sequence[int]) -> None:
        """Blocks ``keep`` of a frame outside pinned memory: staged through the pinned allocator and
        copied in on the copy stream, after the compute stream's work and the batches' writes."""
        compute, side = self.device.current_stream(), self.device.side_stream(COPY)
        staged = source if len(keep) == source.shape[block_dim] else \
            source.index_select(block_dim, torch.tensor(list(keep), dtype=torch.long))
        with self.device.use(side):
            side.wait_stream(compute)
            side.wait_stream(self.device.side_stream(WRITE))
            cache.index_copy_(block_dim, self.device.index(block_ids), self.device.upload(staged))
            done = self.device.event()
            done.record(side)
        self._pending.setdefault(key, []).append((done, ()))

    def close(self) -> None:
        """Wait for the copies in flight (shutdown: before the memory they read is given back)."""
        self.flush()
        self.device.drain()

    def _staging_buffer(self, turn: int) -> torch.Tensor:
        while len(self._staging) <= turn:
            self._staging.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device.device))
        return self._staging[turn]


@dataclass(slots=True)
class _Batch:
    """Received frames of one layer, each a run of blocks in pinned memory, copied in together."""
    cache: torch.Tensor
    sources: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    payloads: list[memoryview] = field(default_factory=list)  # held until the copies completed
    keys: set[str] = field(default_factory=set)
    num_bytes: int = 0

    def add(self, key: str, source: torch.Tensor, block_ids: Sequence[int], payload: memoryview,
            num_bytes: int) -> None:
        self.sources.append(source)
        self.block_ids.extend(block_ids)
        self.payloads.append(payload)
        self.keys.add(key)
        self.num_bytes += num_bytes


def _run_of(keep: Sequence[int], block_dim: int) -> bool:
    """Whether ``keep`` is consecutive blocks of a block-major payload (one run of bytes)."""
    return block_dim == 0 and list(keep) == list(range(keep[0], keep[0] + len(keep)))


def _block_bytes(cache: torch.Tensor, block_dim: int) -> int:
    return cache.numel() // cache.shape[block_dim] * cache.element_size()


def _source(cache: torch.Tensor, block_dim: int, payload: memoryview) -> torch.Tensor:
    shape = list(cache.shape)
    shape[block_dim] = len(payload) // _block_bytes(cache, block_dim)
    return torch.frombuffer(payload, dtype=torch.uint8).view(cache.dtype).view(shape)
