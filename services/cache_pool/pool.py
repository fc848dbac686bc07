"""The unified block pool of one cluster: prefix-cache and transfer-cache blocks, memory then SSD.

Plain Python, not thread-safe (the server serializes calls). Values are immutable, keyed by content
hash. With an arena (``slots.Arena``, the pool's shared memory) every block in memory lives in its
slots: clients on the pool's host write them themselves between ``reserve`` and ``commit``, and read
them through the references ``get`` returns; bytes that come inline are copied in by the pool. The
memory budget is then the arena's slots, counted in whole slots; without an arena, values are bytes
counted exactly. Prefix blocks are evicted least recently used first (``eviction.py`` decides which),
to the SSD tier when there is one; transfer blocks and leased slots are pinned (transfer blocks until
their single read, leases until their commit or their timeout).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from services.cache_pool_client.arena import ArenaBlock, footprint
from services.cache_pool.eviction import admits, lru_victims, prefix_budget_bytes
from services.cache_pool.layouts import LayoutNames
from services.cache_pool.memory import MemoryLru
from services.cache_pool.slots import Arena, Lease, LeaseTable
from services.cache_pool.ssd import SsdTier
from services.cache_pool_client.types import (
    Block, BlockKey, BlockMissingError, LeaseExpiredError, LookupQuery, LookupResult, PoolFullError, PoolStats,
    PutResult, pieces_of,
)
from services.cache_pool.usable import usable_prefix

logger = logging.getLogger(__name__)

LEASE_TIMEOUT_S = 30.0
BlockSpec = tuple[int, bytes, int]  # (group_id, block_hash, size in bytes)


class CachePool:
    def __init__(self, memory_budget_bytes: int, ssd: SsdTier | None = None, arena: Arena | None = None,
                 lease_timeout_s: float = LEASE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_budget_bytes = memory_budget_bytes
        self.ssd = ssd
        self.arena = arena
        self._memory = MemoryLru()
        self._transfers: dict[str, list[Block]] = {}
        self._transfer_bytes = 0
        self.lease_timeout_s = lease_timeout_s
        self._leases = LeaseTable(lease_timeout_s, clock)
        self._counters = PoolStats()
        self._layouts = LayoutNames()

    def contains(self, key: BlockKey) -> bool:
        """Whether a prefix-cache block is stored in any tier (transfer blocks never count)."""
        return key in self._memory or (self.ssd is not None and key in self.ssd)

    @property
    def _membership(self) -> Callable[[BlockKey], bool]:
        """``contains`` at its fastest: without an SSD tier, the memory tier's own test."""
        return self._memory.contains if self.ssd is None else self.contains

    def lookup(self, query: LookupQuery) -> LookupResult:
        """The longest usable prefix of the query's prompt (see ``usable_prefix``); index only. A model
        key without a layout (the router's) is answered for the best of the layouts stored under that
        name; ``result.model`` is the key the answer is for."""
        results = [usable_prefix(replace(query, model=model), self._membership)
                   for model in self._layouts.candidates(query.model)]
        result = max(results, key=lambda r: (r.num_usable_blocks, r.num_full_attention_blocks))
        self._count_lookup(query, result)
        return result

    def put(self, model: str, blocks: Sequence[Block], transfer_id: str = "") -> PutResult:
        """Store blocks given in prompt order (their bytes inline); with ``transfer_id`` as one transfer's."""
        self._layouts.record(model)
        if self.arena is not None and blocks:
            lease = self.reserve(model, [(b.group_id, b.block_hash, len(b.data)) for b in blocks], transfer_id)
            for block, (_, slots) in zip(blocks, lease.entries):
                if slots is not None:
                    self.arena.write(slots, pieces_of(block.data))
            return self.commit(lease.lease_id)
        if transfer_id:
            return self._put_transfer(transfer_id, [Block(b.group_id, b.block_hash, bytes(b.data)) for b in blocks])
        num_blocks = num_bytes = 0
        for block in reversed(blocks):  # the prompt's first block ends most recently used
            if self._put_prefix_block((model, block.group_id, block.block_hash), bytes(block.data)):
                num_blocks += 1
                num_bytes += len(block.data)
        return PutResult(num_blocks, num_bytes)

    def reserve(self, model: str, specs: Sequence[BlockSpec], transfer_id: str = "") -> Lease:
        """Arena slots for a Put, held under a lease until ``commit`` (or its timeout). A prefix block
        already in memory is refreshed instead, and one that cannot fit gets none (entry None: write
        nothing). ``PoolFullError`` when transfer blocks do not fit."""
        self._layouts.record(model)
        arena = self.arena
        if arena is None:
            raise ValueError("this pool has no arena (shared memory): send block bytes inline")
        layout = arena.decide_layout(max(size for *_, size in specs))
        self.expire_leases()
        if transfer_id:
            need = sum(layout.slots_for(size) for *_, size in specs) * layout.slot_bytes
            if self._transfer_bytes + self._leases.footprint + need > layout.capacity_bytes:
                raise PoolFullError(f"transfer {transfer_id}: {need} B do not fit (arena {layout.capacity_bytes} B, "
                                    f"{self._transfer_bytes + self._leases.footprint} B pinned)")
        entries: list[tuple[BlockKey, ArenaBlock | None]] = []
        for group_id, block_hash, size in specs:
            key = (model, group_id, block_hash)
            if not transfer_id and self._memory.get(key) is not None:
                entries.append((key, None))
                continue
            entries.append((key, self._allocate(size)))
            if transfer_id and entries[-1][1] is None:
                for _, slots in entries[:-1]:
                    arena.free(slots)
                raise PoolFullError(f"transfer {transfer_id}: no free slots for a block of {size} B")
        return self._leases.open(transfer_id, entries)

    def commit(self, lease_id: str) -> PutResult:
        """The lease's blocks, written by now, become stored; ``LeaseExpiredError`` when it expired."""
        lease = self._leases.close(lease_id)
        if lease is None:
            raise LeaseExpiredError(lease_id)
        if lease.transfer_id:
            blocks = [Block(key[1], key[2], slots) for key, slots in lease.entries]
            self._transfers.setdefault(lease.transfer_id, []).extend(blocks)
            self._transfer_bytes += sum(footprint(b.data) for b in blocks)
            return PutResult(len(blocks), sum(len(b.data) for b in blocks))
        num_blocks = num_bytes = 0
        for key, slots in reversed(lease.entries):
            if slots is None:
                continue
            if self.ssd is not None:
                self.ssd.discard(key)
            if self._memory.add(key, slots):
                num_blocks += 1
                num_bytes += slots.size
            else:  # a concurrent Put stored the block first
                self.arena.free(slots)
        return PutResult(num_blocks, num_bytes)

    def abort(self, lease_id: str) -> None:
        """Give a lease's slots back unused."""
        if (lease := self._leases.close(lease_id)) is not None:
            self._free_lease(lease)

    def expire_leases(self) -> int:
        """Free the slots of leases past their timeout (a client died or gave up mid-Put)."""
        expired = self._leases.expired()
        for lease in expired:
            logger.warning("cache pool: lease %s expired before its commit; %d block(s) freed",
                           lease.lease_id, len(lease.blocks))
            self._free_lease(lease)
        self._counters.lease_expiries += len(expired)
        return len(expired)

    def get(self, model: str, refs: Iterable[tuple[int, bytes]]) -> list[Block]:
        """Read prefix blocks ``(group_id, block_hash)``, all or nothing (``BlockMissingError``).
        With an arena, blocks in memory come as their slots (``ArenaBlock``; ``data_bytes`` reads them)."""
        keys = [(model, group_id, block_hash) for group_id, block_hash in refs]
        found = {key: self._read(key) for key in reversed(keys)}
        missing = next((key for key in keys if found[key] is None), None)
        if missing is not None:
            raise BlockMissingError(missing)
        return [Block(key[1], key[2], found[key]) for key in keys]

    def data_bytes(self, data) -> bytes:
        """A stored value's bytes (a copy out of the arena for an arena block)."""
        return self.arena.read(data) if isinstance(data, ArenaBlock) else data

    def take_transfer(self, transfer_id: str) -> list[Block]:
        """Return a transfer's blocks (bytes) in put order and free them."""
        blocks = self._transfers.pop(transfer_id, None)
        if blocks is None:
            raise BlockMissingError(transfer_id)
        self._transfer_bytes -= sum(footprint(b.data) for b in blocks)
        taken = [Block(b.group_id, b.block_hash, self.data_bytes(b.data)) for b in blocks]
        for block in blocks:
            self._release(block.data)
        return taken

    @property
    def stats(self) -> PoolStats:
        counters, ssd, arena = self._counters, self.ssd, self.arena
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
            arena_slot_bytes=arena.layout.slot_bytes if arena and arena.layout else 0,
            arena_slots=arena.num_slots if arena else 0,
            arena_free_slots=arena.num_free if arena else 0,
            leased_slots=self._leases.num_slots,
            lease_expiries=counters.lease_expiries,
        )

    @property
    def capacity_bytes(self) -> int:
        """What blocks may hold in memory: the arena's slots, or the budget without one."""
        if self.arena is not None and self.arena.layout is not None:
            return self.arena.layout.capacity_bytes
        return self.memory_budget_bytes

    @property
    def _prefix_budget_bytes(self) -> int:
        return prefix_budget_bytes(self.capacity_bytes, self._transfer_bytes + self._leases.footprint)

    def _allocate(self, size: int) -> ArenaBlock | None:
        """Slots for a block, evicting least recently used prefix blocks to make room; None when it
        cannot fit beside what is pinned."""
        layout = self.arena.layout
        need = layout.slots_for(size) * layout.slot_bytes
        if not admits(need, self._prefix_budget_bytes):
            return None
        room = self._memory.num_bytes + self.arena.free_bytes - need
        self._evict(lru_victims(self._memory.sizes(), self._memory.num_bytes, room))
        return self.arena.allocate(size)

    def _put_prefix_block(self, key: BlockKey, data: bytes) -> bool:
        if not admits(len(data), self._prefix_budget_bytes):
            return False
        if self.ssd is not None:
            self.ssd.discard(key)
        stored = self._memory.add(key, data)
        self._evict(lru_victims(self._memory.sizes(), self._memory.num_bytes, self._prefix_budget_bytes))
        return stored

    def _put_transfer(self, transfer_id: str, blocks: Sequence[Block]) -> PutResult:
        num_bytes = sum(len(b.data) for b in blocks)
        if self._transfer_bytes + num_bytes > self.memory_budget_bytes:
            raise PoolFullError(
                f"transfer {transfer_id}: {num_bytes} B do not fit (budget {self.memory_budget_bytes} B, "
                f"{self._transfer_bytes} B held by transfers)")
        self._transfers.setdefault(transfer_id, []).extend(blocks)
        self._transfer_bytes += num_bytes
        self._evict(lru_victims(self._memory.sizes(), self._memory.num_bytes, self._prefix_budget_bytes))
        return PutResult(len(blocks), num_bytes)

    def _read(self, key: BlockKey):
        data = self._memory.get(key)
        if data is not None or self.ssd is None:
            return data
        data = self.ssd.take(key)
        if data is None:
            return None
        if self.arena is None:
            if admits(len(data), self._prefix_budget_bytes):
                self._memory.add(key, data)
                self._evict(lru_victims(self._memory.sizes(), self._memory.num_bytes, self._prefix_budget_bytes))
            else:
                self.ssd.put(key, data)
            return data
        slots = self._allocate(len(data))
        if slots is None:
            self.ssd.put(key, data)
            return data
        self.arena.write(slots, [data])
        self._memory.add(key, slots)
        return slots

    def _evict(self, keys: list[BlockKey]) -> None:
        for key in keys:
            data = self._memory.pop(key)
            self._counters.memory_evictions += 1
            if self.ssd is not None:
                self._spill(key, data)
            self._release(data)

    def _spill(self, key: BlockKey, data) -> None:
        try:
            self.ssd.put(key, self.data_bytes(data))
        except OSError as exc:  # a full disk: the block is simply gone
            logger.warning("cache pool: block not spilled to SSD: %s", exc)

    def _release(self, data) -> None:
        if isinstance(data, ArenaBlock):
            self.arena.free(data)

    def _free_lease(self, lease: Lease) -> None:
        for slots in lease.blocks:
            self.arena.free(slots)

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
