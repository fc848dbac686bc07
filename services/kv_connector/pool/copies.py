"""Copies between the paged cache and the cluster's cache pool, whose shared-memory arena this
process maps (``cache_pool_client.arena``).

Stores: the step's blocks are gathered on the compute stream, in order after the forward that wrote
them and before anything that may reuse them, into a device tensor, block-major (a block's layers
back to back). Each block goes to the pool client as one ``DevicePiece``, which the client's copy
threads write straight into the arena's slots: after the gather's event, device-to-host copies on a
side stream (``POOL``) into the arena, registered as pinned memory (``PinnedRegion``, on the pool's
I/O thread), so each run is one DMA, one sync per block, and no step waits for them. On CPU a block
is a numpy view of the gathered copy and the client copies it as any buffer.

Loads: the pool worker hands the arena's bytes to a ``BlockLoader`` (``consumer``) whose pinned
memory includes the arena: host-to-device copies on its side streams, and a load counts as done only
once its copies completed (then its blocks are checked for eviction during the copy).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from services.kv_connector.device.streams import Device

logger = logging.getLogger(__name__)

POOL = 3  # the side stream of device-to-host copies into the pool's arena (0-2: saver and loader)


class DevicePiece:
    """A contiguous run of bytes on the device (one block of a Put, every layer's share of it), copied
    out by the pool client's copy threads run by run into arena slots (``copy_into``): each run is
    issued on the ``POOL`` side stream without a wait, after ``ready`` (the gathers' event), and the
    stream is synchronized once, after the block's last run (so once per block, not per slot)."""

    __slots__ = ("data", "ready", "device")

    def __init__(self, data: torch.Tensor, ready: Any, device: Device) -> None:
        self.data = data.reshape(-1).view(torch.uint8)
        self.ready = ready
        self.device = device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __len__(self) -> int:
        return self.data.numel()

    def copy_into(self, target: np.ndarray, start: int) -> None:
        """Bytes ``[start, start + len(target))`` into ``target`` (host memory; pinned: one DMA). The
        client copies a piece's runs in order, on one thread."""
        if start == 0:
            self.device.bind_thread()
            self.ready.synchronize()
        stream = self.device.side_stream(POOL)
        with self.device.use(stream):
            torch.from_numpy(target).copy_(self.data[start:start + len(target)], non_blocking=True)
        if start + len(target) == self.nbytes:
            stream.synchronize()

    def __bytes__(self) -> bytes:
        """For a pool on another host (the bytes go over its transport)."""
        self.ready.synchronize()
        return self.data.cpu().numpy().tobytes()


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

