"""The pool's device-to-host copies (``kv_connector.pool.copies``) through the pool client's own write
path (``arena_client._write``) on CPU tensors: one copy per run that is contiguous both in the gathered
blocks and in the arena, one wait per batch, nothing issued when the write fails, bytes as written."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from prfaas.v1 import cache_pool_pb2 as pb

from services.cache_pool_client.arena import ArenaBlock, ArenaLayout, ArenaMapping
from services.cache_pool_client.arena_client import _write
from services.cache_pool_client.types import Block, Pieces
from services.kv_connector.device.streams import CpuEvent, CpuStream, Device
from services.kv_connector.pool.copies import DeviceRows

ROW = 3 * 4096  # one block of every layer
SLOT = 4096


class _CountingStream(CpuStream):
    def __init__(self) -> None:
        self.num_event_waits = 0

    def wait_event(self, event) -> None:
        self.num_event_waits += 1


class _CountingEvent(CpuEvent):
    def __init__(self, device: "_CountingDevice") -> None:
        self._device = device

    def synchronize(self) -> None:
        self._device.num_waits += 1


class _CountingDevice(Device):
    """The CPU facade, counting the host waits of the copies and their streams' event waits."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.num_waits = 0
        self.stream = _CountingStream()

    def _new_side_stream(self):
        return self.stream

    def event(self):
        return _CountingEvent(self)


@pytest.fixture
def arena(tmp_path):
    mapping = ArenaMapping.create(str(tmp_path / "arena"), 1 << 20)
    yield mapping, ArenaLayout.of(mapping.token, mapping.size, SLOT)
    mapping.close()


@pytest.fixture
def copies(monkeypatch):
    """The host-side ``copy_`` calls made while the test runs."""
    calls = []
    original = torch.Tensor.copy_

    def copy_(self, source, non_blocking=False):
        calls.append((self.numel(), non_blocking))
        return original(self, source, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return calls


def _refs(slots_per_block):
    return [pb.ArenaRef(slots=slots, generations=[0] * len(slots), size=ROW) for slots in slots_per_block]


@pytest.mark.parametrize("slots_per_block, num_runs", [
    ([(0, 1, 2), (3, 4, 5), (6, 7, 8)], 1),          # adjacent slots in prompt order: one run
    ([(0, 1, 2), (3, 4, 5), (9, 10, 11)], 2),        # a gap in the arena
    ([(6, 7, 8), (0, 1, 2), (3, 4, 5)], 2),          # block 0 after block 2 in the arena: not one run
    ([(2, 1, 0)], 3),                                 # a block's slots in reverse
    ([(0, 1, 2), (20, 21, 22), (3, 4, 5), (23, 24, 25)], 4),
    ([(0, 1, 5), (6, 7, 8)], 2),                      # runs join across blocks, split inside one
])
def test_one_copy_per_contiguous_run_and_one_wait_per_batch(arena, copies, slots_per_block, num_runs):
    mapping, layout = arena
    rows = torch.randint(0, 256, (len(slots_per_block), ROW), dtype=torch.uint8)
    device = _CountingDevice()
    batch = DeviceRows(rows, CpuEvent(), device)
    blocks = [Block(1, bytes([k]), Pieces((batch.row(k),))) for k in range(len(slots_per_block))]
    refs = _refs(slots_per_block)
    copies.clear()
    _write(mapping, layout, blocks, refs, time.monotonic() + 5)
    assert len(copies) == num_runs and all(non_blocking for _, non_blocking in copies)
    assert sum(n for n, _ in copies) == rows.numel()
    assert device.num_waits == 1 and device.stream.num_event_waits == 1
    for k, ref in enumerate(refs):
        block = ArenaBlock(tuple(ref.slots), tuple(ref.generations), ROW, SLOT)
        assert mapping.read(layout, block) == rows[k].numpy().tobytes()


def test_blocks_without_slots_are_not_copied_and_the_rest_still_are(arena, copies):
    """A block the pool already holds gets no slots: its piece records nothing, the batch flushes the others."""
    mapping, layout = arena
    rows = torch.randint(0, 256, (2, ROW), dtype=torch.uint8)
    batch = DeviceRows(rows, CpuEvent(), _CountingDevice())
    blocks = [Block(1, bytes([k]), Pieces((batch.row(k),))) for k in range(2)]
    copies.clear()
    _write(mapping, layout, blocks, [pb.ArenaRef(), *_refs([(4, 5, 6)])], time.monotonic() + 5)
    assert [n for n, _ in copies] == [ROW]
    assert mapping.read(layout, ArenaBlock((4, 5, 6), (0, 0, 0), ROW, SLOT)) == rows[1].numpy().tobytes()


def test_a_write_that_fails_issues_no_copy(arena, copies):
    """Past the lease's deadline the write stops before any copy is issued, so the Put may abort at once."""
    mapping, layout = arena
    rows = torch.randint(0, 256, (2, ROW), dtype=torch.uint8)
    device = _CountingDevice()
    batch = DeviceRows(rows, CpuEvent(), device)
    blocks = [Block(1, bytes([k]), Pieces((batch.row(k),))) for k in range(2)]
    copies.clear()
    with pytest.raises(TimeoutError):
        _write(mapping, layout, blocks, _refs([(0, 1, 2), (3, 4, 5)]), time.monotonic() - 1)
    assert copies == [] and device.num_waits == 0
    assert not np.frombuffer(mapping.read(layout, ArenaBlock((0, 1, 2, 3, 4, 5), (0,) * 6, 2 * ROW, SLOT)),
                             np.uint8).any()
