"""The usable-prefix rule: a pure function of a lookup query and a membership test."""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat, takewhile

from services.cache_pool_client.types import BlockKey, LookupQuery, LookupResult

Contains = Callable[[BlockKey], bool]


def usable_prefix(query: LookupQuery, contains: Contains) -> LookupResult:
    """Longest prefix every group can serve.

    Full-attention groups match partially: blocks 0..n-1 must all be stored. Linear-attention
    groups match exactly: their state must be stored at block n-1 itself, so a prefix that ends
    between two stored states falls back to the earlier one. A dense model (no linear groups) uses
    the whole full-attention run.
    """
    num_full = _full_attention_run(query, contains)
    num_usable = _last_linear_state(query, contains, num_full)
    return LookupResult(num_usable, num_full, query.block_size, query.model)


def _full_attention_run(query: LookupQuery, contains: Contains) -> int:
    num_blocks = len(query.block_hashes)
    for group_id in query.full_group_ids:
        num_blocks = _stored_run(query, group_id, contains, num_blocks)
    return num_blocks


def _stored_run(query: LookupQuery, group_id: int, contains: Contains, limit: int) -> int:
    """How many of the first ``limit`` blocks the group has stored in a row. The keys are made and
    tested from C: given a dict's own membership test, the walk makes no Python call per block."""
    keys = zip(repeat(query.model), repeat(group_id), query.block_hashes[:limit])
    return len(list(takewhile(contains, keys)))


def _last_linear_state(query: LookupQuery, contains: Contains, num_blocks: int) -> int:
    group_ids = query.linear_group_ids
    if not group_ids:
        return num_blocks
    for n in range(num_blocks, 0, -1):
        if all(contains((query.model, g, query.block_hashes[n - 1])) for g in group_ids):
            return n
    return 0
