"""A client's side of the pool's arena (see ``arena.py``): Put as Reserve, copy, Commit; Get as slot
references that the caller copies out of and then checks.

A Put copies each block's pieces (``Pieces``: e.g. one per layer, straight from the engine's
tensors) into the slots the pool leased, in a worker thread, and commits; it aborts the lease when
the copy fails, and stops copying once half the lease's time is gone (after its timeout the pool
reuses the slots).
A Get's blocks come as ``ArenaView``s: zero-copy views whose ``intact()`` the caller checks after
copying; ``False`` means the block was evicted meanwhile, a miss.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from prfaas.v1 import cache_pool_pb2 as pb

from services.cache_pool_client import convert
from services.cache_pool_client.arena import ArenaBlock, ArenaLayout, ArenaMapping, as_array, copy_each, copy_runs
from services.cache_pool_client.types import Block, BlockMissingError, PutResult, pieces_of

LEASE_MARGIN = 0.5  # stop copying once half the lease is gone: the rest is the commit's


class ArenaMoved(Exception):
    """The pool answered with another arena than the one mapped here (it restarted): map it again."""


@dataclass(frozen=True, slots=True)
class ArenaView:
    """A block's bytes in the pool's arena, as a Get returned them: copy them out, then check ``intact``."""

    mapping: ArenaMapping
    layout: ArenaLayout
    block: ArenaBlock

    def __len__(self) -> int:
        return self.block.size

    def __bytes__(self) -> bytes:
        return self.mapping.read(self.layout, self.block)

    def view(self, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) of the block: a view when they lie in one slot, else a joined copy."""
        parts, offset = [], 0
        for run in self.mapping.runs(self.layout, self.block):
            lo, hi = max(start, offset), min(stop, offset + len(run))
            if lo < hi:
                parts.append(run[lo - offset:hi - offset])
            offset += len(run)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def copy_into(self, targets: Sequence) -> None:
        """Copy the block into ``targets`` (buffers whose sizes add up to the block's)."""
        copy_runs(self.mapping.runs(self.layout, self.block), [as_array(t) for t in targets])

    def intact(self) -> bool:
        """Whether the copy just made is the block's (no slot of it was freed since the Get)."""
        return self.mapping.intact(self.block)


def intact(data) -> bool:
    """A Get's block data is intact: always, unless it is an arena view whose slots were freed."""
    return data.intact() if isinstance(data, ArenaView) else True


async def put(stub, mapping: ArenaMapping, model: str, blocks: Sequence[Block], transfer_id: str) -> PutResult:
    started = time.monotonic()
    reserved = await stub.Reserve(pb.ReserveRequest(
        model=model, transfer_id=transfer_id,
        blocks=[pb.BlockSpace(group_id=b.group_id, block_hash=b.block_hash, size=len(b.data)) for b in blocks]))
    try:
        layout = _layout(mapping, reserved.layout)
        deadline = started + reserved.lease_timeout_s * LEASE_MARGIN
        await asyncio.to_thread(_write, mapping, layout, blocks, reserved.blocks, deadline)
    except Exception:  # the copy did not happen or stopped: give the slots back now
        await _abort(stub, reserved.lease_id)
        raise
    # Cancelled mid-copy: the copying thread may still be writing, so the slots must not be reused
    # yet; nothing is committed and the lease's timeout frees them.
    response = await stub.Commit(pb.CommitRequest(lease_id=reserved.lease_id))
    return PutResult(response.num_blocks_stored, response.num_bytes_stored)


async def get_views(stub, mapping: ArenaMapping, model: str, refs: Sequence[tuple[int, bytes]]) -> list[Block]:
    """The blocks as ``ArenaView``s (inline ones as bytes); the caller checks ``intact`` after copying."""
    response = await stub.Get(pb.GetRequest(
        model=model, arena=True, blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs]))
    layout = _layout(mapping, response.layout) if response.HasField("layout") else None
    blocks = []
    for m in response.blocks:
        if m.HasField("arena"):
            data = ArenaView(mapping, layout, convert.arena_block(m.arena, layout.slot_bytes))
        else:
            data = m.data
        blocks.append(Block(m.group_id, m.block_hash, data))
    return blocks


def read(blocks: list[Block]) -> list[Block]:
    """The blocks' bytes, copied out of the arena and checked (``BlockMissingError``: one was evicted)."""
    copied = [Block(b.group_id, b.block_hash, bytes(b.data)) for b in blocks]
    check(blocks)
    return copied


def read_into(blocks: list[Block], targets: Sequence[Sequence]) -> None:
    """Copy each block into its target buffers, then check (``BlockMissingError``: one was evicted)."""
    def copy(block: Block, target: Sequence) -> None:
        if isinstance(block.data, ArenaView):
            block.data.copy_into(target)
        else:
            copy_runs([as_array(block.data)], [as_array(t) for t in target])

    copy_each(copy, zip(blocks, targets, strict=True))
    check(blocks)


def check(blocks: list[Block]) -> None:
    for block in blocks:
        if not intact(block.data):
            raise BlockMissingError((block.group_id, block.block_hash))


async def _abort(stub, lease_id: str) -> None:
    try:
        await stub.Commit(pb.CommitRequest(lease_id=lease_id, abort=True))
    except grpc.aio.AioRpcError:
        pass  # the pool is gone or the lease expired: its slots are freed either way


def _write(mapping: ArenaMapping, layout: ArenaLayout, blocks: Sequence[Block], refs, deadline: float) -> None:
    def write(block: Block, ref: pb.ArenaRef) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError("the Put's copy outlasted its lease; aborted")
        mapping.write(layout, convert.arena_block(ref, layout.slot_bytes), pieces_of(block.data))

    copy_each(write, [(b, ref) for b, ref in zip(blocks, refs, strict=True) if ref.slots])  # no slots: nothing to write
    for batch in _deferred(blocks):
        batch.flush()


def _deferred(blocks: Sequence[Block]) -> list:
    """The batches of pieces that only record their targets in ``copy_into`` (device memory,
    ``kv_connector.pool.copies``): each copies them all in one ``flush``, which returns once the bytes
    are in place. Not reached when a write failed, so nothing is in flight when the Put aborts."""
    batches = {id(part.batch): part.batch for block in blocks for part in pieces_of(block.data)
               if hasattr(part, "batch")}
    return list(batches.values())


def _layout(mapping: ArenaMapping, message: pb.ArenaLayout) -> ArenaLayout:
    if message.token != mapping.token:
        raise ArenaMoved()
    num_slots = (mapping.size - message.slots_offset) // max(1, message.slot_bytes)
    return ArenaLayout(message.token, message.slot_bytes, message.slots_offset, num_slots)
