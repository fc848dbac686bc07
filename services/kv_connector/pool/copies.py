"""Copies between the paged cache and the cluster's cache pool, whose shared-memory arena this
process maps (``cache_pool_client.arena``).

Stores: the step's blocks are gathered on the compute stream, in order after the forward that wrote
them and before anything that may reuse them, into a device tensor, block-major (row ``k``: block
``k``'s layers back to back). Each block goes to the pool client as one ``DevicePiece`` of that
tensor (``DeviceRows.row``). The client's copy threads tell each piece which arena slots its bytes
go to (``copy_into`` only records them); once every block has its slots, the Put flushes the batch
(``DeviceRows.flush``): on a side stream (``POOL``), after the gather's event (a stream wait, not a
host wait), one ``non_blocking`` device-to-host copy per run that is contiguous both in the gathered
tensor and in the arena (``contiguous_runs``: blocks leased adjacent slots in prompt order make one
run), into the arena registered as pinned memory (``PinnedRegion``, on the pool's I/O thread), and
one wait for them all, on the pool's thread, before the Put commits. No step waits for any of it.
On CPU a block is a numpy view of the gathered copy and the client copies it as any buffer.

Loads: the pool worker hands the arena's bytes to a ``BlockLoader`` (``consumer``) whose pinned
memory includes the arena: host-to-device copies on its side streams, and a load counts as done only
once its copies completed (then its blocks are checked for eviction during the copy).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from services.kv_connector.device.streams import Device

logger = logging.getLogger(__name__)

POOL = 3  # the side stream of device-to-host copies into the pool's arena (0-2: saver and loader)


class DeviceRows:
    """A Put's gathered blocks on the device (``rows``: one row of bytes per block), copied into the
    pool's arena as one batch: ``row(k)`` is block ``k``'s piece; the pieces' ``copy_into`` record
    where their bytes go, and ``flush`` issues and waits for the copies. The client calls ``flush``
    once every block's pieces were given their slots (``arena_client.put``); a Put that fails before
    that issues nothing, so its slots can be given back at once."""

    def __init__(self, rows: torch.Tensor, ready: Any, device: Device) -> None:
        self.rows = rows
        self.data = rows.reshape(-1).view(torch.uint8)
        self.ready = ready
        self.device = device
        self._targets: list[tuple[int, np.ndarray]] = []
        self._lock = threading.Lock()

    def row(self, k: int) -> "DevicePiece":
        size = self.data.numel() // self.rows.shape[0]
        return DevicePiece(self, k * size, size)

    def record(self, start: int, target: np.ndarray) -> None:
        """Bytes ``[start, start + len(target))`` of ``data`` go to ``target`` (host memory) at ``flush``."""
        with self._lock:
            self._targets.append((start, target))

    def flush(self) -> None:
        """On the pool's copy thread: one ``non_blocking`` copy per contiguous run of the recorded
        targets, on the ``POOL`` side stream after the gathers' event; returns once they completed."""
        with self._lock:
            targets, self._targets = self._targets, []
        if not targets:
            return
        self.device.bind_thread()
        stream = self.device.side_stream(POOL)
        stream.wait_event(self.ready)
        with self.device.use(stream):
            for start, target in contiguous_runs(targets):
                torch.from_numpy(target).copy_(self.data[start:start + len(target)], non_blocking=True)
        done = self.device.event()
        done.record(stream)
        done.synchronize()


class DevicePiece:
    """One block's bytes in a ``DeviceRows`` (every layer's share of it), as the pool client's
    ``Pieces`` part: ``copy_into`` records its targets in the batch (``batch.flush`` copies)."""

    __slots__ = ("batch", "start", "nbytes")

    def __init__(self, batch: DeviceRows, start: int, nbytes: int) -> None:
        self.batch = batch
        self.start = start
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def copy_into(self, target: np.ndarray, start: int) -> None:
        """Bytes ``[start, start + len(target))`` of the piece go to ``target`` when the batch flushes."""
        self.batch.record(self.start + start, target)

    def __bytes__(self) -> bytes:
        """For a pool on another host (the bytes go over its transport)."""
        self.batch.ready.synchronize()
        return self.batch.data[self.start:self.start + self.nbytes].cpu().numpy().tobytes()


def contiguous_runs(targets: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    """``(source offset, host target)`` pairs joined where both sides continue the previous pair's
    bytes: the source at the next offset, the target the next bytes of the same 1-D byte array (the
    arena's mapping), so each run is one copy."""
    runs: list[tuple[int, np.ndarray]] = []
    for start, target in sorted(targets, key=lambda pair: pair[0]):
        if runs and _continues(*runs[-1], start, target):
            first, previous = runs[-1]
            runs[-1] = (first, _joined(previous, target))
        else:
            runs.append((start, target))
    return runs


def _continues(start: int, previous: np.ndarray, next_start: int, target: np.ndarray) -> bool:
    base = previous.base
    return (start + len(previous) == next_start and isinstance(base, np.ndarray) and target.base is base
            and base.ndim == 1 and base.itemsize == 1
            and previous.ctypes.data + len(previous) == target.ctypes.data)


def _joined(previous: np.ndarray, target: np.ndarray) -> np.ndarray:
    base = previous.base
    offset = previous.ctypes.data - base.ctypes.data
    return base[offset:offset + len(previous) + len(target)]


class PinnedRegion:
    """Host memory this process did not allocate (the pool's arena), registered with
    ``cudaHostRegister`` on CUDA so copies to and from it are DMAs; nothing to do on CPU. A region
    that cannot be registered stays pageable: copies through it are slower, still correct."""

    def __init__(self, device: Device, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self._device = device
        self.pinned = device.register(address, size)

    def holds(self, address: int) -> bool:
        return self.pinned and self.address <= address < self.address + self.size

    def close(self) -> None:
        if self.pinned:
            self._device.unregister(self.address)
            self.pinned = False

