"""The host-memory tier: blocks in recency order, each counted by what it takes (``arena.footprint``).

What to evict is ``eviction.py``'s decision; this tier only keeps the order it decides from.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from services.cache_pool_client.arena import footprint
from services.cache_pool_client.types import BlockKey


class MemoryLru:
    def __init__(self) -> None:
        self._blocks: OrderedDict[BlockKey, bytes] = OrderedDict()
        self.num_bytes = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    @property
    def contains(self) -> Callable[[BlockKey], bool]:
        """The membership test itself (the dict's, no Python frame per call), for walks over many keys."""
        return self._blocks.__contains__

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> bytes | None:
        """The block's bytes, marking it most recently used; None when absent."""
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def add(self, key: BlockKey, data: bytes) -> bool:
        """Store as most recently used; False (and only a refresh) when already stored."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return False
        self._blocks[key] = data
        self.num_bytes += footprint(data)
        return True

    def sizes(self) -> Iterator[tuple[BlockKey, int]]:
        """Each stored key with its size in bytes, least recently used first."""
        return ((key, footprint(data)) for key, data in self._blocks.items())

    def pop(self, key: BlockKey) -> bytes:
        data = self._blocks.pop(key)
        self.num_bytes -= footprint(data)
        return data
