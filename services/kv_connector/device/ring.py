"""A ring of pinned host slots: where the producer's device-to-host copies land before the transport
sends them, and where received KV waits for its host-to-device copy.

Allocated once, at its exact size: on CUDA a plain uint8 tensor registered with ``cudaHostRegister``
(PyTorch's pinned allocator would round it up to a power of two and keep freed blocks cached). A
slot goes back to the ring with the event of the last copy that touches it and is handed out again
only once that event completed, so no copy ever reads or writes a slot in use. A full ring makes
the caller wait (``num_waits`` counts how often); it never allocates.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from services.kv_connector.device import DEFAULT_RING_BYTES, DEFAULT_SLOT_BYTES
from services.kv_connector.device.streams import Device

logger = logging.getLogger(__name__)

EVENT_POLL_S = 0.0002  # how often a waiter looks again at slots whose last copy is still running


@dataclass(eq=False, slots=True)
class Slot:
    index: int
    memory: torch.Tensor  # uint8, the slot's whole size
    done: Any = None      # the event after the last copy that touches it (None: nothing pending)

    def view(self, num_bytes: int) -> memoryview:
        """The first ``num_bytes`` as a memoryview over the pinned memory itself (no copy)."""
        return memoryview(self.memory[:num_bytes].numpy())


class HostRing:
    def __init__(self, device: Device, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 num_slots: int = DEFAULT_RING_BYTES // DEFAULT_SLOT_BYTES) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"a host ring needs slots (got {num_slots} of {slot_bytes} bytes)")
        self.slot_bytes = slot_bytes
        self.num_waits = 0
        self._device = device
        self._memory = torch.empty(slot_bytes * num_slots, dtype=torch.uint8)
        self._pinned = device.register(self._memory.data_ptr(), self._memory.numel())
        self._slots = [Slot(i, self._memory[i * slot_bytes:(i + 1) * slot_bytes]) for i in range(num_slots)]
        self._free: deque[Slot] = deque(self._slots)
        self._cond = threading.Condition()
        self._closed = False

    @property
    def num_bytes(self) -> int:
        return self._memory.numel()

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self) -> Slot:
        """A slot whose last copy completed; waits while there is none (any thread)."""
        with self._cond:
            waited = False
            while (slot := self._ready()) is None:
                if self._closed:
                    raise RuntimeError("the host ring is closed")
                if not waited:
                    self.num_waits += 1
                    waited = True
                self._cond.wait(EVENT_POLL_S if self._free else None)
            self._free.remove(slot)
            return slot

    def lease(self, num_bytes: int) -> memoryview | None:
        """A slot's first ``num_bytes`` as a memoryview that gives the slot back once neither it nor
        any view of it is referenced (received frames: whoever copies them in holds the frame until
        its copy completed); None when the bytes do not fit a slot or none is free (never waits)."""
        if num_bytes > self.slot_bytes:
            return None
        with self._cond:
            slot = self._ready()
            if slot is None:
                return None
            self._free.remove(slot)
        array = slot.memory[:num_bytes].numpy()
        weakref.finalize(array, self.release, slot)
        return memoryview(array)

    def holds(self, address: int) -> bool:
        """Whether ``address`` lies in the ring's memory (pinned on CUDA)."""
        start = self._memory.data_ptr()
        return start <= address < start + self._memory.numel()

    def release(self, slot: Slot, done: Any = None) -> None:
        """Give ``slot`` back; it is handed out again only after ``done`` (an event) completed."""
        with self._cond:
            slot.done = done
            self._free.appendleft(slot)  # reused first: a CPU engine touches only the slots it needs
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._pinned:
            self._device.unregister(self._memory.data_ptr())
            self._pinned = False

    def _ready(self) -> Slot | None:
        for slot in self._free:
            if slot.done is None or slot.done.query():
                slot.done = None
                return slot
        return None

