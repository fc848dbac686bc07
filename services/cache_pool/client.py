"""Async client of one cache pool (grpc.aio); callers see domain types only.

Put and Get move block bytes in messages of about ``MESSAGE_BYTES`` each, one after another: a
prompt's blocks can be far larger than gRPC's message limit, and small messages keep the buffers of
both ends reused instead of freshly mapped for every call (fresh pages cost more than the copy).
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from services.cache_pool import convert
from services.cache_pool.server import GRPC_OPTIONS
from services.cache_pool.types import Block, LookupQuery, LookupResult, PoolStats, PutResult

MESSAGE_BYTES = 16 << 20


class CachePoolClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.CachePoolStub(self._channel)

    async def lookup(self, query: LookupQuery, timeout_s: float | None = None) -> LookupResult:
        response = await self._stub.Lookup(convert.lookup_query_to_proto(query), timeout=timeout_s)
        return convert.lookup_result_from_proto(response, query.block_size)

    async def put(self, model: str, blocks: list[Block], transfer_id: str = "") -> PutResult:
        """Stores ``blocks`` in prompt order, in Puts of about ``MESSAGE_BYTES`` each."""
        num_blocks = num_bytes = 0
        for batch in _batches(blocks):
            request = pb.PutRequest(model=model, transfer_id=transfer_id)
            convert.add_blocks(request.blocks, batch)
            response = await self._stub.Put(request)
            num_blocks += response.num_blocks_stored
            num_bytes += response.num_bytes_stored
        return PutResult(num_blocks, num_bytes)

    async def get(self, model: str, refs: Sequence[tuple[int, bytes]]) -> list[Block]:
        """Raises ``grpc.aio.AioRpcError`` NOT_FOUND when any block is missing (treat as a miss).
        Gets about ``MESSAGE_BYTES`` at a time, sized from the blocks of the first (one block)."""
        blocks: list[Block] = []
        while len(blocks) < len(refs):
            count = max(1, MESSAGE_BYTES // max(1, len(blocks[-1].data))) if blocks else 1
            batch = refs[len(blocks):len(blocks) + count]
            request = pb.GetRequest(model=model, blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in batch])
            blocks += _blocks((await self._stub.Get(request)).blocks)
        return blocks

    async def take_transfer(self, model: str, transfer_id: str) -> list[Block]:
        return _blocks((await self._stub.Get(pb.GetRequest(model=model, transfer_id=transfer_id))).blocks)

    async def stats(self) -> PoolStats:
        response = await self._stub.GetStats(pb.CachePoolStatsRequest())
        return PoolStats(**{name: getattr(response, name) for name in PoolStats.__slots__})

    async def close(self) -> None:
        await self._channel.close()


def _blocks(messages) -> list[Block]:
    return [Block(m.group_id, m.block_hash, m.data) for m in messages]


def _batches(blocks: list[Block]) -> list[list[Block]]:
    """Consecutive runs of blocks of about ``MESSAGE_BYTES`` (at least one block each)."""
    batches: list[list[Block]] = [[]]
    num_bytes = 0
    for block in blocks:
        if batches[-1] and num_bytes + len(block.data) > MESSAGE_BYTES:
            batches.append([])
            num_bytes = 0
        batches[-1].append(block)
        num_bytes += len(block.data)
    return batches
