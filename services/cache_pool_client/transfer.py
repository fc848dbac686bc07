"""Cross-cluster cache transfers: copy the part of a cached prefix that one cluster's pool lacks
from the other cluster's pool.

The router decides a transfer when bandwidth is abundant and the longest usable prefix of a prompt
sits in the cluster that will not prefill it (``services.scheduling.offload``). Only the missing
part crosses: the target pool is asked first how much of the prefix it holds, then the source pool
is read for the full-attention blocks after that and for the linear-attention states at the
prefix's last block (a state is valid only at its exact position), and the target stores them.
When both pools have a KV transport (``kv_port``), the bytes go pool to pool over it: the target
is told which blocks to expect (a Put with ``kv_transfer_id``) while the source pushes them, so
they never pass through the router; otherwise the router reads and writes them over gRPC.
Transfers run in the background and never fail a request: the prefill may start before the copy
lands, and then recomputes what it does not find.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace

import grpc

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.types import BlockMissingError, KvCacheGroup, LookupQuery

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 4


class CrossClusterCopier:
    """``clients``: cluster name → its pool's client. ``on_copied(source, target, num_blocks,
    num_bytes)`` and ``on_failed(source, target)`` report outcomes (metrics)."""

    def __init__(self, clients: Mapping[str, CachePoolClient], model: str, block_size: int,
                 groups: Sequence[KvCacheGroup], on_copied=None, on_failed=None) -> None:
        self._clients = clients
        self._model = model
        self._block_size = block_size
        self._groups = tuple(groups)
        self._on_copied = on_copied or (lambda *_: None)
        self._on_failed = on_failed or (lambda *_: None)
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self._running: dict[tuple[str, bytes], asyncio.Task] = {}

    def issue(self, request_id: str, transfer, block_hashes: Sequence[bytes]) -> None:
        """Start copying blocks ``[0, transfer.num_tokens)`` of the prompt (called on the event loop;
        returns at once). A copy of the same prefix to the same cluster already running is not repeated."""
        num_blocks = transfer.num_tokens // self._block_size
        if num_blocks <= 0 or transfer.source not in self._clients or transfer.target not in self._clients:
            return
        key = (transfer.target, block_hashes[num_blocks - 1])
        if key in self._running:
            return
        task = asyncio.get_running_loop().create_task(
            self.copy(request_id, transfer.source, transfer.target, tuple(block_hashes[:num_blocks])))
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))

    async def copy(self, request_id: str, source: str, target: str, block_hashes: tuple[bytes, ...]) -> int:
        """Copies what ``target`` lacks of the prefix ``block_hashes``; returns the blocks copied."""
        async with self._slots:
            try:
                num_copied, num_bytes = await self._copy(source, target, block_hashes)
            except (grpc.aio.AioRpcError, BlockMissingError) as exc:
                reason = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else \
                    "a block was evicted while it was read"
                logger.warning("request %s: cache transfer %s -> %s failed: %s", request_id, source, target, reason)
                self._on_failed(source, target)
                return 0
        logger.debug("request %s: cache transfer %s -> %s copied %d blocks (%d bytes)", request_id, source, target,
                     num_copied, num_bytes)
        self._on_copied(source, target, num_copied, num_bytes)
        return num_copied

    async def _copy(self, source: str, target: str, block_hashes: tuple[bytes, ...]) -> tuple[int, int]:
        """Blocks are copied under the key (model and layout) the source holds them under."""
        query = LookupQuery(self._model, self._block_size, block_hashes, self._groups)
        model = (await self._clients[source].lookup(query)).model or self._model
        query = replace(query, model=model)
        held = await self._clients[target].lookup(query)
        if held.num_usable_blocks >= len(block_hashes):
            return 0, 0
        refs = [(g, h) for h in block_hashes[held.num_full_attention_blocks:] for g in query.full_group_ids]
        refs += [(g, block_hashes[-1]) for g in query.linear_group_ids]
        source_client, target_client = self._clients[source], self._clients[target]
        kv_target = await target_client.kv_address()
        if kv_target is not None and await source_client.kv_address() is not None:
            # Pool to pool over the KV transport; the router only makes the two calls.
            transfer_id = f"cache-copy-{uuid.uuid4().hex}"
            stored = asyncio.ensure_future(target_client.put_pushed(model, refs, transfer_id))
            try:
                pushed = await source_client.push(model, refs, kv_target, transfer_id)
                await stored
            finally:
                stored.cancel()
            return pushed.num_blocks_stored, pushed.num_bytes_stored
        blocks = await source_client.get(model, refs)
        await target_client.put(model, blocks)
        return len(blocks), sum(len(b.data) for b in blocks)

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
