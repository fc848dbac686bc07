"""The connector's one bridge to its cluster's cache pool: a background thread running an asyncio
loop with a ``CachePoolClient``. Hooks call ``start_*`` (never blocks) and get a
``concurrent.futures.Future``; they poll it with ``done()`` on later steps.

``PoolModel`` says what the pool keys of this engine are: the model key with its KV layout's
fingerprint (``layout.spec_fingerprint``: block size, dtype, heads, layers, groups), the tokens per
block and each KV-cache group's kind, derived from vLLM's ``KVCacheConfig`` the same way in the
scheduler and the worker process (``settings.pool_model``). An engine of several TP ranks keeps each
rank's share of a block under a key of that rank (``types.rank_key``): each rank stores and loads its own share, and the
scheduler's lookup asks for every rank's and counts only the prefix that all of them hold.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from services.cache_pool_client.types import (Block, GroupIds, KvCacheGroup, LookupQuery, LookupResult, PutResult,
                                             rank_key)


@dataclass(frozen=True, slots=True)
class PoolModel(GroupIds):
    model: str
    block_size: int
    groups: tuple[KvCacheGroup, ...]
    tp_size: int = 1

    def key(self, rank: int = 0) -> str:
        """The pool key of TP rank ``rank``'s share of this engine's blocks."""
        return rank_key(self.model, rank, self.tp_size)

    def query(self, block_hashes: tuple[bytes, ...], rank: int = 0) -> LookupQuery:
        return LookupQuery(self.key(rank), self.block_size, block_hashes, self.groups)

    def queries(self, block_hashes: tuple[bytes, ...]) -> tuple[LookupQuery, ...]:
        """One query per TP rank: a prefix is usable only where every rank's share of it is stored."""
        return tuple(self.query(block_hashes, rank) for rank in range(self.tp_size))


def failure_text(exc: BaseException) -> str:
    """What a failed pool call says: the gRPC status's details where it has them."""
    if isinstance(exc, grpc.aio.AioRpcError) and exc.details():
        return exc.details()
    return str(exc)


class PoolIO:
    def __init__(self, address: str, lookup_timeout_s: float, transport=None, kv_host: str = "",
                 security=None) -> None:
        """``transport`` (``TransportSettings``) and ``kv_host``: the KV transport path to a pool on
        another host (see ``CachePoolClient``); a pool on this host is reached through shared memory.
        ``security`` (``GrpcSecurity``): the gRPC credentials the pool wants."""
        self.address = address
        self.lookup_timeout_s = lookup_timeout_s
        self._transport = transport
        self._kv_host = kv_host
        self._security = security
        self._on_arena = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="prfaas-cache-pool", daemon=True)
        self._thread.start()
        self._client = self._run(self._new_client()).result()
        self._run(self._connect())

    def start_lookup(self, *queries: LookupQuery) -> "Future[LookupResult]":
        """Several queries (one per TP rank's share): the answer with the fewest usable blocks."""
        return self._run(self._lookup(queries))

    def watch_arena(self, on_arena) -> None:
        """``on_arena(address, size)`` runs on the I/O thread before each Put and Get that goes through
        the pool's shared-memory arena (the connector pins it there, off the engine thread)."""
        self._on_arena = on_arena

    def start_get(self, model: str, refs: list[tuple[int, bytes]]) -> "Future[list[Block]]":
        """Fails (``grpc.aio.AioRpcError`` NOT_FOUND) when any block is gone: the caller recomputes.
        Blocks in the pool's arena come as views, not yet copied: the caller copies them into its
        blocks and then checks each one's ``intact()`` (False: evicted meanwhile, recompute)."""
        return self._run(self._get(model, refs))

    def start_put(self, model: str, make_blocks) -> "Future[PutResult]":
        """``make_blocks()`` runs on the I/O thread; the blocks' data may be ``Pieces`` (views of the
        engine's copied tensors), which the client copies into the pool without joining them."""
        return self._run(self._put(model, make_blocks))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close()).result(timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    async def _new_client(self):
        from services.cache_pool_client.client import CachePoolClient

        return CachePoolClient(self.address, transport=self._transport, kv_host=self._kv_host,
                               security=self._security)

    async def _connect(self) -> None:
        """Open the connection now, not inside the first lookup's deadline (failures are not fatal)."""
        try:
            await self._client.stats()
        except Exception:  # noqa: BLE001 - the pool may start later; lookups then miss until it does
            pass

    async def _lookup(self, queries: tuple[LookupQuery, ...]) -> LookupResult:
        results = await asyncio.gather(*(self._client.lookup(query, timeout_s=self.lookup_timeout_s)
                                         for query in queries))
        return min(results, key=lambda result: result.num_usable_blocks)

    async def _get(self, model: str, refs: list[tuple[int, bytes]]) -> list[Block]:
        await self._announce_arena()
        return await self._client.get_views(model, refs)

    async def _put(self, model: str, make_blocks) -> PutResult:
        await self._announce_arena()
        blocks = make_blocks()
        return await self._client.put(model, blocks) if blocks else PutResult(0, 0)

    async def _announce_arena(self) -> None:
        if self._on_arena is not None and (arena := await self._client.arena()) is not None:
            await asyncio.to_thread(self._on_arena, arena.address, arena.size)

    def _run(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
