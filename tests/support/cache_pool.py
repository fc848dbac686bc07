"""Factories for cache pool tests: prompts, their chained block hashes, blocks and lookup queries."""
from __future__ import annotations

from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool_client.types import Block, GroupKind, KvCacheGroup, LookupQuery

MODEL = "tiny-qwen3-next/layout-1"
BLOCK_SIZE = 4
FULL = KvCacheGroup(3, GroupKind.FULL_ATTENTION)
LINEAR = KvCacheGroup(0, GroupKind.LINEAR_ATTENTION)
DENSE_GROUPS = (KvCacheGroup(0, GroupKind.FULL_ATTENTION),)
HYBRID_GROUPS = (LINEAR, FULL)


def prompt(num_blocks: int, shared: int = 0, seed: int = 1) -> list[int]:
    """Tokens of ``num_blocks`` full blocks; the first ``shared`` blocks are the same for every seed."""
    common = [1000 + i for i in range(shared * BLOCK_SIZE)]
    own = [seed * 10_000 + i for i in range((num_blocks - shared) * BLOCK_SIZE)]
    return common + own


def hashes(tokens: list[int]) -> list[bytes]:
    return prompt_block_hashes(tokens, BLOCK_SIZE)


def payload(block_hash: bytes, group_id: int, size: int = 100) -> bytes:
    """Deterministic block bytes that differ per block and group."""
    pattern = block_hash + group_id.to_bytes(4, "little")
    return (pattern * (size // len(pattern) + 1))[:size]


def blocks(group_id: int, block_hashes: list[bytes], size: int = 100) -> list[Block]:
    return [Block(group_id, h, payload(h, group_id, size)) for h in block_hashes]


def query(block_hashes: list[bytes], groups=HYBRID_GROUPS, model: str = MODEL) -> LookupQuery:
    return LookupQuery(model, BLOCK_SIZE, tuple(block_hashes), tuple(groups))
