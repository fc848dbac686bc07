"""The cache pool's eviction policy: which blocks leave a tier, decided from their sizes and recency alone.

Pure: no files, no shared memory, no RPC. The tiers keep their blocks in recency order (``memory.py``,
``ssd.py``) and drop what this module names; ``pool.py`` decides where a block dropped from memory goes
(the SSD tier, or nowhere). Transfer blocks are pinned: they shrink the budget prefix blocks share.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

Key = TypeVar("Key", bound=Hashable)


def admits(num_bytes: int, budget_bytes: int) -> bool:
    """Whether a block of ``num_bytes`` may enter a tier at all (it could never fit otherwise)."""
    return num_bytes <= budget_bytes


def prefix_budget_bytes(memory_budget_bytes: int, pinned_bytes: int) -> int:
    """What prefix blocks may hold of the memory budget while transfer blocks pin ``pinned_bytes``."""
    return memory_budget_bytes - pinned_bytes


def lru_victims(sizes: Iterable[tuple[Key, int]], num_bytes: int, budget_bytes: int) -> list[Key]:
    """The keys to evict, least recently used first, so that what stays fits ``budget_bytes``.

    ``sizes``: each stored key with its size, least recently used first; ``num_bytes``: their sum.
    """
    victims = []
    for key, size in sizes:
        if num_bytes <= budget_bytes:
            break
        victims.append(key)
        num_bytes -= size
    return victims
