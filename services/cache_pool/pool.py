"""The unified block pool of one cluster: prefix-cache and transfer-cache blocks, memory then SSD.

Plain Python, not thread-safe (the server serializes calls). Values are immutable bytes, or files of
the shared-memory directory (``shm.ShmBlockData``, freed here whenever the pool drops them), keyed
by content hash; the memory budget counts every stored byte of block data exactly (prefix blocks and
transfer blocks together). Prefix blocks are evicted least recently used first (``eviction.py``
decides which), to the SSD tier when there is one; transfer blocks are pinned until their single read.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from services.cache_pool.eviction import admits, lru_victims, prefix_budget_bytes
from services.cache_pool.memory import MemoryLru
from services.cache_pool.shm import release
from services.cache_pool.ssd import SsdTier
from services.cache_pool.types import (
    Block, BlockKey, BlockMissingError, LookupQuery, LookupResult, PoolFullError, PoolStats, PutResult,
)
from services.cache_pool.usable import usable_prefix

logger = logging.getLogger(__name__)


class CachePool:
    def __init__(self, memory_budget_bytes: int, ssd: SsdTier | None = None) -> None:
        self.memory_budget_bytes = memory_budget_bytes
        self.ssd = ssd
        self._memory = MemoryLru()
        self._transfers: dict[str, list[Block]] = {}
        self._transfer_bytes = 0
        self._counters = PoolStats()

    def contains(self, key: BlockKey) -> bool:
        """Whether a prefix-cache block is stored in any tier (transfer blocks never count)."""
        return key in self._memory or (self.ssd is not None and key in self.ssd)

    def lookup(self, query: LookupQuery) -> LookupResult:
        """The longest usable prefix of the query's prompt (see ``usable_prefix``); index only."""
        result = usable_prefix(query, self.contains)
        self._count_lookup(query, result)
        return result

    def put(self, model: str, blocks: Sequence[Block], transfer_id: str = "") -> PutResult:
        """Store blocks given in prompt order; with ``transfer_id`` as one transfer's blocks."""
        if transfer_id:
            return self._put_transfer(transfer_id, blocks)
        num_blocks = num_bytes = 0
        for block in reversed(blocks):  # the prompt's first block ends most recently used
            if self._put_prefix_block((model, block.group_id, block.block_hash), block.data):
                num_blocks += 1
                num_bytes += len(block.data)
        return PutResult(num_blocks, num_bytes)

    def get(self, model: str, refs: Iterable[tuple[int, bytes]]) -> list[Block]:
        """Read prefix blocks ``(group_id, block_hash)``, all or nothing (``BlockMissingError``)."""
        keys = [(model, group_id, block_hash) for group_id, block_hash in refs]
        found = {key: self._read(key) for key in reversed(keys)}
        missing = next((key for key in keys if found[key] is None), None)
        if missing is not None:
            raise BlockMissingError(missing)
        return [Block(key[1], key[2], found[key]) for key in keys]

    def take_transfer(self, transfer_id: str) -> list[Block]:
        """Return a transfer's blocks in put order and free them."""
        blocks = self._transfers.pop(transfer_id, None)
        if blocks is None:
            raise BlockMissingError(transfer_id)
        self._transfer_bytes -= sum(len(b.data) for b in blocks)
        return blocks

    @property
    def stats(self) -> PoolStats:
        counters = self._counters
        ssd = self.ssd
        return PoolStats(
            memory_budget_bytes=self.memory_budget_bytes,
            memory_bytes=self._memory.num_bytes + self._transfer_bytes,
            memory_blocks=len(self._memory) + sum(len(b) for b in self._transfers.values()),
            ssd_budget_bytes=ssd.budget_bytes if ssd else 0,
            ssd_bytes=ssd.num_bytes if ssd else 0,
            ssd_blocks=len(ssd) if ssd else 0,
            transfer_bytes=self._transfer_bytes,
            num_transfers=len(self._transfers),
            full_attention_hits=counters.full_attention_hits,
            full_attention_misses=counters.full_attention_misses,
            linear_attention_hits=counters.linear_attention_hits,
            linear_attention_misses=counters.linear_attention_misses,
            memory_evictions=counters.memory_evictions,
            ssd_evictions=ssd.num_evictions if ssd else 0,
            ssd_read_errors=ssd.num_read_errors if ssd else 0,
        )

    @property
    def _prefix_budget_bytes(self) -> int:
        return prefix_budget_bytes(self.memory_budget_bytes, self._transfer_bytes)

    def _put_prefix_block(self, key: BlockKey, data) -> bool:
        if not admits(len(data), self._prefix_budget_bytes):
            release(data)
            return False
        if self.ssd is not None:
            self.ssd.discard(key)
        stored = self._memory.add(key, data)
        if not stored:
            release(data)  # the stored copy was refreshed instead
        self._evict_over_budget()
        return stored

    def _put_transfer(self, transfer_id: str, blocks: Sequence[Block]) -> PutResult:
        num_bytes = sum(len(b.data) for b in blocks)
        if self._transfer_bytes + num_bytes > self.memory_budget_bytes:
            raise PoolFullError(
                f"transfer {transfer_id}: {num_bytes} B do not fit (budget {self.memory_budget_bytes} B, "
                f"{self._transfer_bytes} B held by transfers)")
        self._transfers.setdefault(transfer_id, []).extend(blocks)
        self._transfer_bytes += num_bytes
        self._evict_over_budget()
        return PutResult(len(blocks), num_bytes)

    def _read(self, key: BlockKey) -> bytes | None:
        data = self._memory.get(key)
        if data is not None or self.ssd is None:
            return data
        data = self.ssd.take(key)
        if data is None:
            return None
        if admits(len(data), self._prefix_budget_bytes):
            self._memory.add(key, data)
            self._evict_over_budget()
        else:
            self.ssd.put(key, data)
        return data

    def _evict_over_budget(self) -> None:
        for key in lru_victims(self._memory.sizes(), self._memory.num_bytes, self._prefix_budget_bytes):
            data = self._memory.pop(key)
            self._counters.memory_evictions += 1
            if self.ssd is not None:
                self._spill(key, data)
            release(data)

    def _spill(self, key: BlockKey, data) -> None:
        try:
            self.ssd.put(key, bytes(data))
        except OSError as exc:  # a vanished block file or a full disk: the block is simply gone
            logger.warning("cache pool: block not spilled to SSD: %s", exc)

    def _count_lookup(self, query: LookupQuery, result: LookupResult) -> None:
        counters = self._counters
        if query.full_group_ids:
            counters.full_attention_hits += result.num_usable_blocks
            counters.full_attention_misses += len(query.block_hashes) - result.num_usable_blocks
        if query.linear_group_ids and query.block_hashes:
            if result.num_usable_blocks:
                counters.linear_attention_hits += 1
            else:
                counters.linear_attention_misses += 1
