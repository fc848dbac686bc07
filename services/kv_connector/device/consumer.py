"""The consumer half: copies received blocks into the paged cache without the engine thread waiting
for the GPU.

``write`` runs on the engine thread between forwards. On CUDA the received bytes go into a pinned
ring slot; on the side stream, after everything enqueued so far on the compute stream (the zeroing
of new blocks, reads of reused ones), a ``non_blocking`` copy moves them into a GPU staging buffer
and ``index_copy_`` puts them in their blocks; a done event closes each copy. A request counts as
received only once all its copies' events completed (``poll``, which never blocks). On CPU the
blocks are written in place at once, exactly as ``KVLayout.write_some`` writes them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device


class BlockLoader:
    def __init__(self, device: Device, ring: HostRing) -> None:
        self.device = device
        self.ring = ring
        self._staging: torch.Tensor | None = None
        self._pending: dict[str, list[tuple[Any, torch.Tensor]]] = {}  # key -> (done event, index kept alive)

    def write(self, key: str, cache: torch.Tensor, block_dim: int, payload: memoryview, keep: Sequence[int],
              block_ids: Sequence[int]) -> None:
        """Copy blocks ``keep`` of ``payload`` (blocks along ``block_dim``, as the producer gathered
        them) into ``block_ids`` (one per kept block) of ``cache``, for the request ``key``."""
        source = _source(cache, block_dim, payload)
        if not self.device.is_cuda:
            if len(keep) != source.shape[block_dim]:
                source = source.index_select(block_dim, torch.tensor(keep, dtype=torch.long))
            cache.index_copy_(block_dim, torch.tensor(block_ids, dtype=torch.long), source)
            return
        per_slot = max(1, self.ring.slot_bytes // _block_bytes(cache, block_dim))
        for first in range(0, len(keep), per_slot):
            self._load(key, cache, block_dim, source, keep[first:first + per_slot], block_ids[first:first + per_slot])

    def busy(self, key: str) -> bool:
        """Whether copies for ``key`` may still be running (as of the last ``poll``)."""
        return key in self._pending

    def poll(self) -> set[str]:
        """The keys whose copies all completed since the last call; never blocks."""
        completed = set()
        for key, copies in list(self._pending.items()):
            while copies and copies[0][0].query():  # one stream: events complete in order
                copies.pop(0)
            if not copies:
                del self._pending[key]
                completed.add(key)
        return completed

    def _load(self, key: str, cache: torch.Tensor, block_dim: int, source: torch.Tensor, keep: Sequence[int],
              block_ids: Sequence[int]) -> None:
        compute, side = self.device.current_stream(), self.device.side_stream()
        shape = list(cache.shape)
        shape[block_dim] = len(keep)
        num_bytes = _block_bytes(cache, block_dim) * len(keep)
        slot = self.ring.acquire()
        try:
            staged = slot.memory[:num_bytes].view(cache.dtype).view(shape)
            torch.index_select(source, block_dim, torch.tensor(keep, dtype=torch.long), out=staged)
            index = torch.tensor(block_ids, dtype=torch.long).pin_memory()
            with self.device.use(side):
                side.wait_stream(compute)
                on_device = self._staging_buffer()[:num_bytes].view(cache.dtype).view(shape)
                on_device.copy_(staged, non_blocking=True)
                cache.index_copy_(block_dim, index.to(self.device.device, non_blocking=True), on_device)
                done = self.device.event()
                done.record(side)
        except BaseException:
            self.ring.release(slot)
            raise
        self.ring.release(slot, done)
        self._pending.setdefault(key, []).append((done, index))

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.ring.slot_bytes, dtype=torch.uint8, device=self.device.device)
        return self._staging


def _block_bytes(cache: torch.Tensor, block_dim: int) -> int:
    return cache.numel() // cache.shape[block_dim] * cache.element_size()


def _source(cache: torch.Tensor, block_dim: int, payload: memoryview) -> torch.Tensor:
    shape = list(cache.shape)
    shape[block_dim] = len(payload) // _block_bytes(cache, block_dim)
    return torch.frombuffer(payload, dtype=torch.uint8).view(cache.dtype).view(shape)
