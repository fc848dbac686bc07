"""The pool's side of the arena: which slots are free, and leases on slots handed out for a Put.

Slot size: ``slot_bytes`` when configured (``arena_slot_kib``), else the largest block of the first
Put (at least ``MIN_SLOT_BYTES``), rounded up to 4 KiB. An engine's full-attention blocks all have one
size, so each then fills exactly one slot; a block of another size (a recurrent state, another model)
takes as many slots as it needs, the last one partly. The layout is fixed from then on.

Freed slots go to the back of a FIFO free list, so a slot is reused as late as possible: a client
that stalls past its lease (see ``LeaseTable``) and writes late most likely writes into a slot that
is still free.
"""
from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cache_pool_client.arena import (PAGE, ArenaBlock, ArenaLayout, ArenaMapping, arena_name,
                                             remove_stale_arenas)
from services.cache_pool_client.types import BlockKey

logger = logging.getLogger(__name__)

MIN_SLOT_BYTES = 64 << 10


class Arena:
    def __init__(self, mapping: ArenaMapping, slot_bytes: int | None = None) -> None:
        self.mapping = mapping
        self.layout: ArenaLayout | None = None
        self._free: deque[int] = deque()
        if slot_bytes:
            self._lay_out(slot_bytes)

    @classmethod
    def create(cls, directory: str, pool_name: str, size: int, slot_bytes: int | None = None) -> "Arena":
        """A new arena file of ``size`` bytes in ``directory`` (a tmpfs), after removing the arenas of
        killed pools of this name."""
        directory = os.path.realpath(directory)
        remove_stale_arenas(directory, pool_name)
        return cls(ArenaMapping.create(os.path.join(directory, arena_name(pool_name)), size), slot_bytes)

    def decide_layout(self, block_bytes: int) -> ArenaLayout:
        """The layout, fixed by the first call (see the module's docstring)."""
        if self.layout is None:
            self._lay_out(max(MIN_SLOT_BYTES, block_bytes))
        return self.layout

    def _lay_out(self, slot_bytes: int) -> None:
        self.layout = ArenaLayout.of(self.mapping.token, self.mapping.size, -(-slot_bytes // PAGE) * PAGE)
        self._free.extend(range(self.layout.num_slots))

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots if self.layout else 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_bytes(self) -> int:
        return self.num_free * self.layout.slot_bytes if self.layout else 0

    def allocate(self, size: int) -> ArenaBlock | None:
        """Slots for ``size`` bytes from the free list; None when too few are free."""
        layout = self.layout
        count = layout.slots_for(size)
        if count > len(self._free):
            return None
        slots = tuple(self._free.popleft() for _ in range(count))
        return ArenaBlock(slots, tuple(self.mapping.generation(s) for s in slots), size, layout.slot_bytes)

    def free(self, block: ArenaBlock) -> None:
        self.mapping.bump(block.slots)
        self._free.extend(block.slots)

    def write(self, block: ArenaBlock, pieces) -> None:
        self.mapping.write(self.layout, block, pieces)

    def read(self, block: ArenaBlock) -> bytes:
        return self.mapping.read(self.layout, block)

    def close(self) -> None:
        """Unmap and remove the file (clients' mappings stay valid until they drop them)."""
        self.mapping.close()
        try:
            os.unlink(self.mapping.path)
        except FileNotFoundError:
            pass


def open_arena(directory: str | None, pool_name: str, size: int, slot_bytes: int | None = None) -> Arena | None:
    """The pool's arena in ``directory``, or None (block bytes then go inline) when there is none
    configured or the tmpfs has no room for it."""
    if not directory:
        return None
    try:
        return Arena.create(directory, pool_name, size, slot_bytes)
    except OSError as exc:
        logger.warning("cache pool %s: no shared-memory arena of %d B in %s (%s); same-host clients send block "
                       "bytes inline", pool_name, size, directory, exc)
        return None


@dataclass(slots=True)
class Lease:
    """Slots handed to a client for one Put: ``entries`` (key, block; None: nothing to write)."""

    lease_id: str
    expires_at: float
    transfer_id: str
    entries: list[tuple[BlockKey, ArenaBlock | None]] = field(default_factory=list)

    @property
    def blocks(self) -> list[ArenaBlock]:
        return [block for _, block in self.entries if block is not None]


class LeaseTable:
    """Open leases; one not committed within ``timeout_s`` expires and its slots are freed.

    The timeout must exceed any Put's copy by far (a Put of hundreds of MiB copies in well under a
    second): a client still writing after its lease expired could write into reused slots."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def open(self, transfer_id: str, entries: list[tuple[BlockKey, ArenaBlock | None]]) -> Lease:
        lease = Lease(f"lease-{next(self._ids)}-{os.urandom(4).hex()}", self._clock() + self.timeout_s,
                      transfer_id, entries)
        self._leases[lease.lease_id] = lease
        return lease

    def close(self, lease_id: str) -> Lease | None:
        """The lease, now closed; None when unknown or expired (its slots are already free)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.expires_at < self._clock():
            self._leases[lease_id] = lease  # expire() frees it with the others
            return None
        return lease

    def expired(self) -> list[Lease]:
        """Remove and return the leases past their deadline."""
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at < now]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    @property
    def footprint(self) -> int:
        return sum(block.footprint for lease in self._leases.values() for block in lease.blocks)

    @property
    def num_slots(self) -> int:
        return sum(len(block.slots) for lease in self._leases.values() for block in lease.blocks)
