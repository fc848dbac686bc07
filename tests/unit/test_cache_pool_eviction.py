"""The cache pool's eviction policy, from sizes and recency alone (no tier, no files)."""
import pytest

from services.cache_pool.eviction import admits, lru_victims, prefix_budget_bytes


@pytest.mark.parametrize("sizes, budget, victims", [
    ([], 0, []),
    ([("a", 10), ("b", 10)], 20, []),                  # exactly at the budget: nothing leaves
    ([("a", 10), ("b", 10)], 19, ["a"]),                # least recently used first
    ([("a", 5), ("b", 5), ("c", 30)], 30, ["a", "b"]),  # as many as it takes, in recency order
    ([("a", 30), ("b", 5)], 30, ["a"]),                 # one large block frees room for several
    ([("a", 10), ("b", 10)], 0, ["a", "b"]),            # no budget left (transfers pin it all)
    ([("a", 0), ("b", 10)], 5, ["a", "b"]),             # an empty block frees nothing but still goes first
])
def test_lru_victims_are_the_oldest_blocks_that_bring_the_tier_within_budget(sizes, budget, victims):
    assert lru_victims(iter(sizes), sum(size for _, size in sizes), budget) == victims


@pytest.mark.parametrize("num_bytes, budget, admitted", [(10, 10, True), (11, 10, False), (0, 0, True)])
def test_a_block_larger_than_the_budget_is_not_admitted(num_bytes, budget, admitted):
    assert admits(num_bytes, budget) is admitted


def test_pinned_transfer_bytes_shrink_the_prefix_budget():
    assert prefix_budget_bytes(100, 0) == 100
    assert prefix_budget_bytes(100, 60) == 40
