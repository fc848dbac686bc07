"""Prefix block hashes chained exactly as vLLM's default prefix caching chains them.

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``prefix_caching_hash_algo="sha256"``) hashes block *i* as
``sha256(pickle((hash of block i-1, tuple(token ids of block i), extra_keys)))``, starting from
``NONE_HASH = sha256(pickle(seed))`` with seed ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``. Only
full blocks are hashed. Computing the same chain here (without importing vLLM) lets the router
and workers look up the hashes an engine computes. Multimodal, LoRA and ``cache_salt`` requests
add ``extra_keys`` in vLLM; they are passed through unchanged here.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of a prompt's first block (vLLM's ``NONE_HASH`` for sha256)."""
    return sha256_pickle(os.getenv("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> bytes:
    return sha256_pickle((parent_hash or none_hash(), tuple(token_ids), extra_keys))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """One chained hash per full block of the prompt; a trailing partial block has none."""
    hashes: list[bytes] = []
    parent = none_hash()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
