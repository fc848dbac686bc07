"""What every worker's engine holds in its prefix cache, exactly, as the workers stream it
(``WatchPrefixCache``: vLLM's KV-cache events read inside each worker; a snapshot on connect, deltas
after). Every router keeps its own copy from the same streams, so all routers see the same prefixes
whatever requests each of them sent; staleness is the stream's latency (an engine step's events).

Memory is bounded: at most ``max_blocks_per_worker`` blocks per worker (beyond, new blocks are not
kept: a prefix the router does not know scores as uncached, the neutral score), reported as
``prfaas_router_prefix_index_blocks{worker}`` and ``prfaas_router_prefix_index_bytes``."""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable, Sequence

from services.cache_pool_client.hashing import vllm_block_hashes
from services.router.metrics import RouterMetrics
from services.router.workers import PrefixStreamUnavailable, WorkerHandle, WorkerPool
from services.worker_api.types import PrefixUpdate

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_WORKER = 1 << 18
BYTES_PER_BLOCK = 32 + sys.getsizeof(b"") + 16  # a 32-byte digest, its bytes object, a set slot (about)


class PrefixIndex:
    """Per worker, the chained hashes of the full blocks its engine caches. Pure: no I/O."""

    def __init__(self, metrics: RouterMetrics | None = None,
                 max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self._blocks: dict[str, set[bytes]] = {}
        self._block_sizes: dict[str, int] = {}
        self._metrics = metrics

    def knows(self, worker: str) -> bool:
        return worker in self._blocks

    def apply(self, worker: str, update: PrefixUpdate) -> None:
        blocks = self._blocks.setdefault(worker, set())
        if update.reset:
            blocks.clear()
        if update.block_size:
            self._block_sizes[worker] = update.block_size
        blocks.difference_update(update.removed)
        room = self.max_blocks_per_worker - len(blocks)
        blocks.update(update.stored if len(update.stored) <= room else update.stored[:max(room, 0)])
        self._export(worker)

    def forget(self, worker: str) -> None:
        """The worker's stream ended: nothing is known of it until a new snapshot."""
        self._blocks.pop(worker, None)
        self._export(worker)

    def cached_tokens(self, workers: Iterable[str], token_ids: Sequence[int]) -> dict[str, int]:
        """Leading prompt tokens each known worker holds (workers without a stream are left out)."""
        by_size: dict[int, list[bytes]] = {}
        tokens = {}
        for worker in workers:
            blocks, size = self._blocks.get(worker), self._block_sizes.get(worker, 0)
            if blocks is None:
                continue
            if not size:
                tokens[worker] = 0
                continue
            if size not in by_size:
                by_size[size] = vllm_block_hashes(token_ids, size)
            count = 0
            for block_hash in by_size[size]:
                if block_hash not in blocks:
                    break
                count += 1
            tokens[worker] = count * size
        return tokens

    def _export(self, worker: str) -> None:
        if self._metrics is None:
            return
        self._metrics.prefix_index_blocks.labels(worker).set(len(self._blocks.get(worker, ())))
        self._metrics.prefix_index_bytes.set(sum(map(len, self._blocks.values())) * BYTES_PER_BLOCK)


class PrefixWatch:
    """One stream per worker into ``index``, re-opened (with a new snapshot) after it ends."""

    def __init__(self, pool: WorkerPool, index: PrefixIndex, retry_s: float) -> None:
        self._pool = pool
        self._index = index
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(h)) for h in self._pool.handles]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, handle: WorkerHandle) -> None:
        while True:
            try:
                async for update in self._pool.watch_prefix_cache(handle):
                    self._index.apply(handle.name, update)
            except PrefixStreamUnavailable as exc:
                logger.debug("prefix cache stream of %s: %s", handle.name, exc)
            self._index.forget(handle.name)
            await asyncio.sleep(self._retry_s)
