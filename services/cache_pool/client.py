"""Async client of one cache pool (grpc.aio); callers see domain types only."""
from __future__ import annotations

import grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from services.cache_pool import convert
from services.cache_pool.server import GRPC_OPTIONS
from services.cache_pool.types import Block, LookupQuery, LookupResult, PoolStats, PutResult


class CachePoolClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.CachePoolStub(self._channel)

    async def lookup(self, query: LookupQuery, timeout_s: float | None = None) -> LookupResult:
        response = await self._stub.Lookup(convert.lookup_query_to_proto(query), timeout=timeout_s)
        return convert.lookup_result_from_proto(response, query.block_size)

    async def put(self, model: str, blocks: list[Block], transfer_id: str = "") -> PutResult:
        response = await self._stub.Put(pb.PutRequest(model=model, blocks=convert.blocks_to_proto(blocks),
                                                       transfer_id=transfer_id))
        return PutResult(response.num_blocks_stored, response.num_bytes_stored)

    async def get(self, model: str, refs: list[tuple[int, bytes]]) -> list[Block]:
        """Raises ``grpc.aio.AioRpcError`` NOT_FOUND when any block is missing (treat as a miss)."""
        request = pb.GetRequest(model=model, blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs])
        return _blocks((await self._stub.Get(request)).blocks)

    async def take_transfer(self, model: str, transfer_id: str) -> list[Block]:
        return _blocks((await self._stub.Get(pb.GetRequest(model=model, transfer_id=transfer_id))).blocks)

    async def stats(self) -> PoolStats:
        response = await self._stub.GetStats(pb.CachePoolStatsRequest())
        return PoolStats(**{name: getattr(response, name) for name in PoolStats.__slots__})

    async def close(self) -> None:
        await self._channel.close()


def _blocks(messages) -> list[Block]:
    return [Block(m.group_id, m.block_hash, m.data) for m in messages]
