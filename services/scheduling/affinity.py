"""Which prefill worker probably still holds a prompt's prefix in its engine's prefix cache.

The cache-pool index answers per cluster; inside a cluster the engines' own prefix caches differ.
:class:`PrefixAffinity` remembers the chained block hashes of the prompts each worker prefilled
(bounded LRU per worker) and tells how many leading blocks of a new prompt each worker has seen.
It is an estimate (engines evict on their own), used only to order candidates; a worker it knows
nothing about scores 0, a neutral score. Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixAffinity:
    def __init__(self, max_blocks_per_worker: int = 65536) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, worker: str, block_hashes: Sequence[bytes]) -> None:
        """Called when ``worker`` was chosen to prefill a prompt with these block hashes."""
        seen = self._seen.setdefault(worker, OrderedDict())
        for block_hash in block_hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > self.max_blocks_per_worker:
            seen.popitem(last=False)

    def num_cached_blocks(self, worker: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the prompt the worker has prefilled before (chained hashes: a prefix)."""
        seen = self._seen.get(worker)
        if not seen:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in seen:
                break
            count += 1
        return count

    def cached_tokens(self, workers: Iterable[str], block_hashes: Sequence[bytes], block_size: int) -> dict[str, int]:
        return {w: self.num_cached_blocks(w, block_hashes) * block_size for w in workers}

    def forget(self, worker: str) -> None:
        """The worker restarted or changed role: its engine's prefix cache is gone or unused."""
        self._seen.pop(worker, None)
