"""Domain types of the cache pool; no gRPC here (``server.py`` and ``client.py`` convert)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

# (model, group_id, block_hash): ``model`` names the model and KV layout (``layout_key``), so blocks
# of different models or layouts never match; the hash of block i fingerprints the prompt's tokens
# [0, (i+1)·block_size).
BlockKey = tuple[str, int, bytes]

LAYOUT_MARK = "@layout:"


def layout_key(model: str, fingerprint: str) -> str:
    """The pool key of an engine: its model key and its KV layout's fingerprint."""
    return f"{model}{LAYOUT_MARK}{fingerprint}"


def rank_key(model: str, rank: int, tp_size: int) -> str:
    """The pool key of one TP rank's share of an engine's blocks (its KV heads, its state shares):
    ``model`` (a ``layout_key``) when the engine has one rank, else a key of its own per rank, so the
    shares of one block never meet under one key. It names the same layout to the router."""
    return model if tp_size == 1 else f"{model}/tp{rank}of{tp_size}"


def has_layout(model: str) -> bool:
    """Whether a model key names a layout (an engine's); the router's keys name only the model."""
    return LAYOUT_MARK in model


def model_name(model: str) -> str:
    return model.partition(LAYOUT_MARK)[0]


class GroupKind(enum.Enum):
    FULL_ATTENTION = "full"
    LINEAR_ATTENTION = "linear"


class PoolFullError(Exception):
    """Transfer blocks do not fit in the memory budget even with every prefix block evicted."""


class BlockMissingError(KeyError):
    """A block asked for is not stored (never stored, evicted, or failed its SSD checksum), or was
    evicted while a client copied it out of the arena."""


class LeaseExpiredError(KeyError):
    """A Put's lease on arena slots is unknown or expired: its slots were freed, nothing is stored."""


@dataclass(frozen=True, slots=True)
class KvCacheGroup:
    group_id: int
    kind: GroupKind


def group_ids(groups: tuple[KvCacheGroup, ...], kind: GroupKind) -> tuple[int, ...]:
    """The ids of the groups of one kind, in order."""
    return tuple(g.group_id for g in groups if g.kind is kind)


class GroupIds:
    """The group ids of each kind, for a class with a ``groups`` tuple of ``KvCacheGroup``."""

    __slots__ = ()
    groups: tuple[KvCacheGroup, ...]

    @property
    def full_group_ids(self) -> tuple[int, ...]:
        return group_ids(self.groups, GroupKind.FULL_ATTENTION)

    @property
    def linear_group_ids(self) -> tuple[int, ...]:
        return group_ids(self.groups, GroupKind.LINEAR_ATTENTION)


@dataclass(frozen=True, slots=True)
class LookupQuery(GroupIds):
    model: str
    block_size: int
    block_hashes: tuple[bytes, ...]
    groups: tuple[KvCacheGroup, ...]


@dataclass(frozen=True, slots=True)
class LookupResult:
    num_usable_blocks: int
    num_full_attention_blocks: int
    block_size: int
    model: str = ""  # the key the answer is for (see ``CachePool.lookup``: a model name resolves to one)

    @property
    def num_usable_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class Block:
    group_id: int
    block_hash: bytes
    data: bytes  # also ``Pieces`` (a Put's), or in the arena (``arena.ArenaBlock``, ``client.ArenaView``)


@dataclass(frozen=True, slots=True)
class Pieces:
    """A block's bytes as consecutive buffers (e.g. one per layer), copied piece by piece into the
    pool's slots without ever being joined; ``len`` is their total size, ``bytes()`` joins them. A
    part is a buffer, or an object that copies itself (``nbytes``, ``copy_into``, ``bytes()``: device
    memory, see ``arena.copy_runs``)."""

    parts: tuple

    def __len__(self) -> int:
        return sum(part.nbytes if hasattr(part, "copy_into") else memoryview(part).nbytes for part in self.parts)

    def __bytes__(self) -> bytes:
        return b"".join(bytes(part) if hasattr(part, "copy_into") else memoryview(part).cast("B")
                        for part in self.parts)


def pieces_of(data) -> tuple:
    """A block's bytes as the buffers they come in: a ``Pieces``' parts, else the one buffer."""
    return data.parts if isinstance(data, Pieces) else (data,)


@dataclass(frozen=True, slots=True)
class PutResult:
    num_blocks_stored: int
    num_bytes_stored: int


@dataclass(slots=True)
class PoolStats:
    """Counters and occupancy of one pool; ``memory_bytes`` and ``ssd_bytes`` are exact."""

    memory_budget_bytes: int = 0
    memory_bytes: int = 0
    memory_blocks: int = 0
    ssd_budget_bytes: int = 0
    ssd_bytes: int = 0
    ssd_blocks: int = 0
    transfer_bytes: int = 0
    num_transfers: int = 0
    full_attention_hits: int = 0
    full_attention_misses: int = 0
    linear_attention_hits: int = 0
    linear_attention_misses: int = 0
    memory_evictions: int = 0
    ssd_evictions: int = 0
    ssd_read_errors: int = 0
    arena_slot_bytes: int = 0
    arena_slots: int = 0
    arena_free_slots: int = 0
    leased_slots: int = 0
    lease_expiries: int = 0
