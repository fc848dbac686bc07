"""The cache pool core: prefix matching, the hybrid usable-prefix rule, LRU bytes, transfer blocks."""
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from support.cache_pool import (
    BLOCK_SIZE, DENSE_GROUPS, FULL, HYBRID_GROUPS, LINEAR, MODEL, blocks, hashes, payload, prompt, query,
)

from services.cache_pool_client.hashing import (
    ALGORITHMS, XXH3_NAMESPACE, hash_block_tokens, none_hash, prompt_block_hashes,
)
from services.cache_pool.pool import CachePool
from services.cache_pool_client.types import Block, BlockMissingError, PoolFullError
from services.cache_pool.usable import usable_prefix


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hashes_chain_over_the_whole_prefix(algorithm):
    a = prompt_block_hashes(prompt(4, shared=2, seed=1), BLOCK_SIZE, algorithm)
    b = prompt_block_hashes(prompt(4, shared=2, seed=2), BLOCK_SIZE, algorithm)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert len(set(a)) == 4
    assert len(prompt_block_hashes(list(range(2 * BLOCK_SIZE + 3)), BLOCK_SIZE, algorithm)) == 2
    assert prompt_block_hashes(list(range(BLOCK_SIZE - 1)), BLOCK_SIZE, algorithm) == []


def test_xxh3_hash_of_block_i_is_the_hash_of_the_prefix_up_to_its_end():
    tokens = prompt(3)
    expected = [xxhash.xxh3_128_digest(XXH3_NAMESPACE + BLOCK_SIZE.to_bytes(4, "little")
                                       + b"".join(t.to_bytes(4, "little") for t in tokens[:(i + 1) * BLOCK_SIZE]))
                for i in range(3)]
    assert hashes(tokens) == expected
    assert prompt_block_hashes(tokens, 2 * BLOCK_SIZE)[0] != expected[1]  # the block size is part of the key
    assert prompt_block_hashes(tuple(tokens), BLOCK_SIZE) == expected


def reference_xxh3_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The definition, one block at a time: the one-shot xxh3-128 of the namespace and every token before
    the block's end."""
    head = XXH3_NAMESPACE + block_size.to_bytes(4, "little")
    return [xxhash.xxh3_128_digest(head + b"".join(t.to_bytes(4, "little") for t in tokens[:end]))
            for end in range(block_size, len(tokens) + 1, block_size)]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, 70))
def test_xxh3_hashes_equal_the_one_shot_definition(tokens, block_size):
    assert prompt_block_hashes(tokens, block_size) == reference_xxh3_hashes(tokens, block_size)


def test_hash_algorithm_and_token_range_are_checked():
    with pytest.raises(ValueError, match="allowed: xxh3, vllm-sha256"):
        prompt_block_hashes(prompt(1), BLOCK_SIZE, "md5")
    with pytest.raises(OverflowError):
        prompt_block_hashes([-1] * BLOCK_SIZE, BLOCK_SIZE)


def test_vllm_sha256_hashes_equal_vllms_default_block_hashes():
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    tokens = prompt(5)
    parent, expected = None, []
    for start in range(0, len(tokens), BLOCK_SIZE):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start:start + BLOCK_SIZE])
        expected.append(bytes(parent))
    assert kv_cache_utils.NONE_HASH == none_hash()
    assert prompt_block_hashes(tokens, BLOCK_SIZE, "vllm-sha256") == expected
    assert expected[0] == hash_block_tokens(None, tokens[:BLOCK_SIZE])


def test_dense_prefix_match_is_partial():
    pool = CachePool(1 << 20)
    stored = hashes(prompt(6, shared=4, seed=1))
    pool.put(MODEL, blocks(0, stored))
    result = pool.lookup(query(hashes(prompt(8, shared=4, seed=2)), DENSE_GROUPS))
    assert (result.num_usable_blocks, result.num_usable_tokens) == (4, 4 * BLOCK_SIZE)
    assert pool.lookup(query(stored, DENSE_GROUPS, model="other-model")).num_usable_blocks == 0


def _contains(full: set[int], linear: set[int], prompt_hashes: list[bytes]):
    keys = {(MODEL, FULL.group_id, prompt_hashes[i]) for i in full}
    keys |= {(MODEL, LINEAR.group_id, prompt_hashes[i]) for i in linear}
    return keys.__contains__


@pytest.mark.parametrize("full_blocks, linear_states, groups, expected", [
    ({0, 1, 2, 3, 4, 5}, set(), (FULL,), (6, 6)),                  # dense: the whole run
    ({0, 1, 3}, set(), (FULL,), (2, 2)),                            # a hole ends the run
    ({0, 1, 2, 3, 4, 5, 6, 7}, {3, 7}, HYBRID_GROUPS, (8, 8)),     # state at the run's end
    ({0, 1, 2, 3, 4, 5}, {3, 7}, HYBRID_GROUPS, (4, 6)),            # ends between states: fall back to 3
    ({0, 1, 2, 3, 4, 5}, set(), HYBRID_GROUPS, (0, 6)),             # no state: nothing usable
    ({0, 1}, {5}, HYBRID_GROUPS, (0, 2)),                            # state past the run is useless
    (set(), {0, 1, 2}, (LINEAR,), (3, 8)),                           # linear-only model
])
def test_usable_prefix(full_blocks, linear_states, groups, expected):
    prompt_hashes = hashes(prompt(8))
    result = usable_prefix(query(prompt_hashes, groups), _contains(full_blocks, linear_states, prompt_hashes))
    assert (result.num_usable_blocks, result.num_full_attention_blocks) == expected


def test_hybrid_prefix_between_two_stored_states_uses_the_earlier_one():
    pool = CachePool(1 << 20)
    stored = hashes(prompt(8, shared=6, seed=1))
    pool.put(MODEL, blocks(FULL.group_id, stored))
    pool.put(MODEL, blocks(LINEAR.group_id, [stored[3], stored[7]]))
    result = pool.lookup(query(hashes(prompt(10, shared=6, seed=2))))
    assert (result.num_usable_blocks, result.num_full_attention_blocks) == (4, 6)
    refs = [(FULL.group_id, h) for h in stored[:4]] + [(LINEAR.group_id, stored[3])]
    assert [b.data for b in pool.get(MODEL, refs)] == [payload(h, g) for g, h in refs]
    stats = pool.stats
    assert (stats.full_attention_hits, stats.full_attention_misses) == (4, 6)
    assert (stats.linear_attention_hits, stats.linear_attention_misses) == (1, 0)


def test_lru_stays_within_the_budget_counting_bytes_exactly():
    sizes = [100, 250, 75, 300, 125, 50, 200]
    budget = 600
    pool = CachePool(budget)
    prompt_hashes = hashes(prompt(len(sizes)))
    for h, size in zip(prompt_hashes, sizes):
        pool.put(MODEL, [Block(0, h, payload(h, 0, size))])
        assert pool.stats.memory_bytes <= budget
    # 100+250+75+300 > 600 evicts 100 and 250; adding 125, 50, 200 then evicts 75 and 300.
    kept = [h for h in prompt_hashes if pool.contains((MODEL, 0, h))]
    assert kept == prompt_hashes[4:]
    assert (pool.stats.memory_bytes, pool.stats.memory_blocks, pool.stats.memory_evictions) == (375, 3, 4)


def test_lru_evicts_a_prompts_tail_first_and_get_refreshes():
    pool = CachePool(4 * 100)
    first = hashes(prompt(6, seed=1))
    pool.put(MODEL, blocks(0, first))
    assert [pool.contains((MODEL, 0, h)) for h in first] == [True] * 4 + [False] * 2
    pool.get(MODEL, [(0, first[3])])
    pool.put(MODEL, blocks(0, hashes(prompt(3, seed=2))))
    assert [pool.contains((MODEL, 0, h)) for h in first[:4]] == [False, False, False, True]
    assert pool.stats.memory_evictions == 2 + 3


def test_putting_a_stored_block_again_counts_it_once():
    pool = CachePool(1 << 20)
    stored = blocks(0, hashes(prompt(3)))
    assert pool.put(MODEL, stored).num_blocks_stored == 3
    assert pool.put(MODEL, stored).num_blocks_stored == 0
    assert pool.stats.memory_bytes == 300


def test_a_block_larger_than_the_budget_is_not_stored():
    pool = CachePool(50)
    assert pool.put(MODEL, blocks(0, hashes(prompt(1)))).num_blocks_stored == 0
    assert pool.stats.memory_bytes == 0


def test_missing_blocks_fail_the_whole_get():
    pool = CachePool(1 << 20)
    stored = hashes(prompt(3))
    pool.put(MODEL, blocks(0, stored[:2]))
    with pytest.raises(BlockMissingError) as missing:
        pool.get(MODEL, [(0, h) for h in stored])
    assert missing.value.args[0] == (MODEL, 0, stored[2])


def test_transfer_blocks_never_serve_lookups_and_are_freed_after_their_read():
    pool = CachePool(1 << 20)
    tail = hashes(prompt(3))
    pool.put(MODEL, blocks(FULL.group_id, tail), transfer_id="req-1")
    assert pool.lookup(query(tail, (FULL,))).num_usable_blocks == 0
    with pytest.raises(BlockMissingError):
        pool.get(MODEL, [(FULL.group_id, tail[0])])
    assert pool.stats.transfer_bytes == 300
    assert [b.block_hash for b in pool.take_transfer("req-1")] == tail
    assert (pool.stats.transfer_bytes, pool.stats.memory_bytes, pool.stats.num_transfers) == (0, 0, 0)
    with pytest.raises(BlockMissingError):
        pool.take_transfer("req-1")


def test_transfer_blocks_evict_prefix_blocks_and_never_exceed_the_budget():
    pool = CachePool(500)
    pool.put(MODEL, blocks(0, hashes(prompt(5, seed=1))))
    pool.put(MODEL, blocks(0, hashes(prompt(3, seed=2))), transfer_id="t")
    assert (pool.stats.memory_bytes, pool.stats.transfer_bytes) == (500, 300)
    with pytest.raises(PoolFullError):
        pool.put(MODEL, blocks(0, hashes(prompt(3, seed=3))), transfer_id="u")
    assert pool.stats.memory_bytes == 500
