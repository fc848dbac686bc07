"""The SSD tier: spill and reload, its own budget, and every damaged entry read as a miss."""
import os

import pytest
from support.cache_pool import DENSE_GROUPS, MODEL, blocks, hashes, payload, prompt, query

from services.cache_pool.pool import CachePool
from services.cache_pool.ssd import HEADER, SsdTier, encode_key
from services.cache_pool_client.types import BlockMissingError


def _file_size(block_hash: bytes, size: int = 100) -> int:
    return HEADER.size + len(encode_key((MODEL, 0, block_hash))) + size


@pytest.fixture
def spilled(tmp_path):
    """A pool holding 2 of 5 blocks in memory and the 3 oldest (the prompt's head) on SSD."""
    pool = CachePool(2 * 100, SsdTier(tmp_path, 1 << 20))
    prompt_hashes = hashes(prompt(5))
    for h in prompt_hashes:
        pool.put(MODEL, blocks(0, [h]))
    return pool, prompt_hashes


def test_evicted_blocks_spill_to_ssd_and_reload_on_a_hit(spilled):
    pool, prompt_hashes = spilled
    stats = pool.stats
    assert (stats.memory_blocks, stats.ssd_blocks, stats.memory_evictions) == (2, 3, 3)
    assert stats.ssd_bytes == sum(_file_size(h) for h in prompt_hashes[:3])
    assert pool.lookup(query(prompt_hashes, DENSE_GROUPS)).num_usable_blocks == 5
    got = pool.get(MODEL, [(0, h) for h in prompt_hashes])
    assert [b.data for b in got] == [payload(h, 0) for h in prompt_hashes]
    assert pool.stats.memory_bytes <= 200
    assert pool.stats.ssd_read_errors == 0


def _corrupt(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:HEADER.size + 3])


@pytest.mark.parametrize("damage", [_corrupt, _truncate, os.unlink], ids=["corrupt", "truncated", "missing"])
def test_a_damaged_ssd_entry_is_a_miss(spilled, damage):
    pool, prompt_hashes = spilled
    damage(pool.ssd.path_of((MODEL, 0, prompt_hashes[1])))
    with pytest.raises(BlockMissingError):
        pool.get(MODEL, [(0, h) for h in prompt_hashes])
    assert pool.stats.ssd_read_errors == 1
    assert pool.lookup(query(prompt_hashes, DENSE_GROUPS)).num_usable_blocks == 1


def test_a_file_of_another_block_is_a_miss(spilled):
    pool, prompt_hashes = spilled
    first, second = (pool.ssd.path_of((MODEL, 0, h)) for h in prompt_hashes[:2])
    os.replace(second, first)
    with pytest.raises(BlockMissingError):
        pool.get(MODEL, [(0, prompt_hashes[0])])


def test_ssd_tier_keeps_its_own_budget(tmp_path):
    prompt_hashes = hashes(prompt(6))
    budget = 3 * _file_size(prompt_hashes[0])
    pool = CachePool(100, SsdTier(tmp_path, budget))
    for h in prompt_hashes:
        pool.put(MODEL, blocks(0, [h]))
    stats = pool.stats
    assert (stats.ssd_blocks, stats.ssd_bytes, stats.ssd_evictions) == (3, budget, 2)
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) == budget
    assert [pool.contains((MODEL, 0, h)) for h in prompt_hashes] == [False, False, True, True, True, True]


def test_ssd_tier_starts_empty(tmp_path):
    SsdTier(tmp_path, 1 << 20).put((MODEL, 0, b"h"), b"data")
    (tmp_path / "unrelated.txt").write_text("kept")
    tier = SsdTier(tmp_path, 1 << 20)
    assert len(tier) == 0
    assert [f.name for f in tmp_path.iterdir()] == ["unrelated.txt"]
