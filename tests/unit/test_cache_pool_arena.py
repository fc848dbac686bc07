"""The cache pool's shared-memory arena in one process: slots, generations, leases and accounting."""
import os
import subprocess
import sys

import pytest
from support.cache_pool import MODEL, hashes, payload, prompt

from services.cache_pool_client.arena import ArenaMapping
from services.cache_pool_client.arena_client import ArenaView
from services.cache_pool.pool import CachePool
from services.cache_pool.slots import MIN_SLOT_BYTES, Arena
from services.cache_pool.ssd import SsdTier
from services.cache_pool_client.types import Block, LeaseExpiredError, Pieces, PoolFullError

SLOT = MIN_SLOT_BYTES
ARENA_BYTES = 16 * SLOT + 8192  # header + generation table + 16 slots


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def arena_pool(tmp_path, clock):
    arena = Arena.create(str(tmp_path), "pool-t", ARENA_BYTES)
    pool = CachePool(ARENA_BYTES, SsdTier(tmp_path / "ssd", 64 * SLOT), arena, lease_timeout_s=10.0, clock=clock)
    yield pool
    arena.close()


def _blocks(seed: int, count: int, size: int = SLOT) -> list[Block]:
    return [Block(1, h, payload(h, 1, size)) for h in hashes(prompt(count, seed=seed))]


def _view(pool: CachePool, block: Block) -> ArenaView:
    return ArenaView(pool.arena.mapping, pool.arena.layout, block.data)


def audit(pool: CachePool) -> None:
    """The pool's accounting equals what the arena holds: every slot is free, leased or a stored block's."""
    stats = pool.stats
    held = stats.arena_slots - stats.arena_free_slots - stats.leased_slots
    assert stats.memory_bytes == held * stats.arena_slot_bytes
    assert held * stats.arena_slot_bytes <= stats.arena_slots * stats.arena_slot_bytes <= stats.memory_budget_bytes


def test_the_first_put_fixes_the_slot_size_and_blocks_fill_whole_slots(arena_pool):
    assert arena_pool.stats.arena_slots == 0  # no layout before the first Put
    assert arena_pool.put(MODEL, _blocks(1, 4)).num_blocks_stored == 4
    stats = arena_pool.stats
    assert (stats.arena_slot_bytes, stats.arena_slots, stats.arena_free_slots) == (SLOT, 16, 12)
    big, small = Block(0, b"big", payload(b"big", 0, 2 * SLOT + 5)), Block(0, b"small", b"x" * 10)
    arena_pool.put(MODEL, [big, small])
    assert arena_pool.stats.arena_free_slots == 12 - 3 - 1
    got = arena_pool.get(MODEL, [(0, b"big"), (0, b"small")])
    assert [arena_pool.data_bytes(b.data) for b in got] == [big.data, small.data]
    audit(arena_pool)


def test_a_configured_slot_size_is_kept(tmp_path):
    arena = Arena.create(str(tmp_path), "pool-s", ARENA_BYTES, slot_bytes=6000)
    try:
        pool = CachePool(ARENA_BYTES, arena=arena)
        pool.put(MODEL, [Block(0, b"h", b"y" * (100 << 10))])
        assert (pool.stats.arena_slot_bytes, pool.stats.arena_slots - pool.stats.arena_free_slots) == (8192, 13)
    finally:
        arena.close()


def test_pieces_are_copied_into_slots_unjoined(arena_pool):
    parts = (b"a" * 1000, memoryview(b"b" * 3000), bytearray(b"c" * 500))
    arena_pool.put(MODEL, [Block(0, b"h", Pieces(parts))])
    (block,) = arena_pool.get(MODEL, [(0, b"h")])
    assert arena_pool.data_bytes(block.data) == b"".join(bytes(p) for p in parts) == bytes(_view(arena_pool, block))


def test_a_slot_reused_after_eviction_is_never_read_as_the_old_block(arena_pool):
    first = _blocks(1, 16)
    arena_pool.put(MODEL, first)
    (old,) = arena_pool.get(MODEL, [(1, first[-1].block_hash)])  # the Get a client answers from
    view = _view(arena_pool, old)
    assert bytes(view) == first[-1].data and view.intact()
    arena_pool.put(MODEL, _blocks(2, 16))  # evicts every block of the first prompt; slots reused
    copied = bytes(view)
    assert copied != first[-1].data  # the slot now holds another block ...
    assert not view.intact()  # ... and the reader sees that it must not use what it copied
    audit(arena_pool)


def test_a_lease_never_committed_frees_its_slots_after_the_timeout(arena_pool, clock):
    arena_pool.put(MODEL, _blocks(1, 4))
    lease = arena_pool.reserve(MODEL, [(1, h, SLOT) for h in hashes(prompt(3, seed=2))])
    assert arena_pool.stats.leased_slots == 3 and arena_pool.stats.arena_free_slots == 9
    audit(arena_pool)
    clock.now += 5
    assert arena_pool.expire_leases() == 0
    clock.now += 6
    assert arena_pool.expire_leases() == 1
    stats = arena_pool.stats
    assert (stats.leased_slots, stats.arena_free_slots, stats.lease_expiries, stats.memory_blocks) == (0, 12, 1, 4)
    with pytest.raises(LeaseExpiredError):
        arena_pool.commit(lease.lease_id)
    assert not any(arena_pool.contains((MODEL, 1, h)) for h in hashes(prompt(3, seed=2)))
    audit(arena_pool)


def test_a_commit_after_the_deadline_stores_nothing(arena_pool, clock):
    lease = arena_pool.reserve(MODEL, [(1, b"late", SLOT)])
    clock.now += 11
    with pytest.raises(LeaseExpiredError):
        arena_pool.commit(lease.lease_id)
    arena_pool.expire_leases()
    assert arena_pool.stats.arena_free_slots == 16 and not arena_pool.contains((MODEL, 1, b"late"))


def test_reserving_a_stored_block_refreshes_it_and_leases_nothing(arena_pool):
    stored = _blocks(1, 2)
    arena_pool.put(MODEL, stored)
    lease = arena_pool.reserve(MODEL, [(1, b.block_hash, SLOT) for b in stored] + [(1, b"new", SLOT)])
    assert [slots is None for _, slots in lease.entries] == [True, True, False]
    assert arena_pool.commit(lease.lease_id).num_blocks_stored == 1
    audit(arena_pool)


def test_leased_and_transfer_slots_are_pinned(arena_pool):
    arena_pool.put(MODEL, _blocks(1, 8))
    transfer = _blocks(3, 6)
    arena_pool.put(MODEL, transfer, transfer_id="t")
    lease = arena_pool.reserve(MODEL, [(1, b"pinned", SLOT)] * 6)
    with pytest.raises(PoolFullError):
        arena_pool.put(MODEL, _blocks(4, 5), transfer_id="u")
    assert arena_pool.put(MODEL, _blocks(5, 8)).num_blocks_stored == 4  # only what is not pinned
    assert [b.data for b in arena_pool.take_transfer("t")] == [b.data for b in transfer]
    arena_pool.abort(lease.lease_id)
    assert arena_pool.stats.arena_free_slots == 16 - 4 and arena_pool.stats.memory_blocks == 4
    audit(arena_pool)


def test_evicted_blocks_spill_to_ssd_and_come_back_into_slots(arena_pool):
    first = _blocks(1, 16)
    arena_pool.put(MODEL, first)
    arena_pool.put(MODEL, _blocks(2, 8))
    assert arena_pool.stats.ssd_blocks == 8
    got = arena_pool.get(MODEL, [(1, b.block_hash) for b in first])
    assert [arena_pool.data_bytes(b.data) for b in got] == [b.data for b in first]
    assert arena_pool.stats.memory_blocks == 16
    audit(arena_pool)


def test_a_client_maps_the_arena_only_with_its_token(tmp_path):
    arena = Arena.create(str(tmp_path), "pool-m", ARENA_BYTES)
    try:
        mapping = arena.mapping
        assert ArenaMapping.open(mapping.path, mapping.size, mapping.token) is not None
        assert ArenaMapping.open(mapping.path, mapping.size, b"x" * 16) is None
        assert ArenaMapping.open(mapping.path, mapping.size + 4096, mapping.token) is None
        assert ArenaMapping.open(str(tmp_path / "missing"), mapping.size, mapping.token) is None
    finally:
        arena.close()
    assert not os.path.exists(mapping.path)


def test_the_arena_of_a_killed_pool_is_removed_when_a_pool_of_that_name_starts(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"prfaas-arena-pool-x-{int(dead.stdout)}-abcd"
    stale.write_bytes(b"old arena")
    alive = tmp_path / f"prfaas-arena-pool-x-{os.getppid()}-ef01"
    alive.write_bytes(b"a running pool's arena")
    arena = Arena.create(str(tmp_path), "pool-x", ARENA_BYTES)
    assert not stale.exists() and alive.exists() and os.path.exists(arena.mapping.path)
    arena.close()


def test_no_room_on_the_tmpfs_means_no_arena(tmp_path):
    from services.cache_pool.slots import open_arena

    assert open_arena(str(tmp_path / "missing-dir"), "pool-y", ARENA_BYTES) is None
    assert open_arena(None, "pool-y", ARENA_BYTES) is None
