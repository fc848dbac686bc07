"""Chained prefix block hashes: the keys of the cache pools.

The hash of block *i* fingerprints the prompt's tokens [0, (i+1)·block_size), so equal hashes mean
equal prefixes; only full blocks are hashed (a trailing partial block has none). The router (lookup)
and the workers' connector (put and get) both call ``prompt_block_hashes``, so the keys only have to
agree between them, not with the engine's own prefix cache. Two algorithms:

- ``xxh3`` (the default): one streaming xxh3-128 over a namespace (``b"prfaas-pool-v1"`` and the
  block size) followed by the token ids as little-endian uint32, digested at every block boundary.
  Each digest covers everything before it, which is the chain. ~0.9 ms for a 128K-token prompt at
  128 tokens per block on a 2-core EPYC, about 0.7 of it turning the token list into bytes (reading
  each Python int, ~5 ns a token); the 1024 updates and digests take the rest. xxh3 is not built to resist
  crafted collisions (as vLLM's own ``xxhash`` prefix caching option); a deployment whose tenants
  must not be able to poison each other's prefixes uses ``vllm-sha256``.
- ``vllm-sha256``: exactly vLLM's default prefix caching chain (``vllm/v1/core/kv_cache_utils.py``,
  ``prefix_caching_hash_algo="sha256"``): block *i* is ``sha256(pickle((hash of block i-1,
  tuple(token ids of block i), extra_keys)))`` from ``NONE_HASH = sha256(pickle(seed))``, seed
  ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``. ~3-4x slower (a pickle and a sha256 per block).
"""
from __future__ import annotations

import array
import hashlib
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import numpy
import xxhash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
XXH3_NAMESPACE = b"prfaas-pool-v1"
ALGORITHMS = ("xxh3", "vllm-sha256")
DEFAULT_ALGORITHM = "xxh3"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, algorithm: str = DEFAULT_ALGORITHM) -> list[bytes]:
    """One chained hash per full block of the prompt; a trailing partial block has none."""
    if algorithm == "xxh3":
        return xxh3_block_hashes(token_ids, block_size)
    if algorithm == "vllm-sha256":
        return vllm_block_hashes(token_ids, block_size)
    raise ValueError(f"hash algorithm {algorithm!r} is not allowed (allowed: {', '.join(ALGORITHMS)})")


def xxh3_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Token ids must be in [0, 2**32) (``OverflowError`` otherwise). One conversion of the whole
    prompt, then the blocks as rows of a numpy view, each fed to the hasher and digested without a
    Python-level call per block (``map`` drives ``update``)."""
    tokens = array.array("I", token_ids)
    num_blocks = len(tokens) // block_size
    rows = numpy.frombuffer(tokens, numpy.uint32, num_blocks * block_size).reshape(num_blocks, block_size)
    if sys.byteorder == "big":
        rows = rows.byteswap()
    hasher = xxhash.xxh3_128(XXH3_NAMESPACE + block_size.to_bytes(4, "little"))
    digest = hasher.digest
    return [digest() for _ in map(hasher.update, rows)]


def vllm_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    parent = none_hash()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of a prompt's first block in ``vllm-sha256`` (vLLM's ``NONE_HASH`` for sha256)."""
    return sha256_pickle(os.getenv("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """One block of the ``vllm-sha256`` chain. Multimodal, LoRA and ``cache_salt`` requests add
    ``extra_keys`` in vLLM; they are passed through unchanged here."""
    return sha256_pickle((parent_hash or none_hash(), tuple(token_ids), extra_keys))
