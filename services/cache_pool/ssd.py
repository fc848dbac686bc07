"""The SSD tier: one checksummed file per block under a directory, LRU within its own byte budget.

File layout: a header (magic, version, key length, data length, xxh3-64 of key + data), the key,
the data. A read checks all of it against the key asked for; a missing, short or corrupt file is a
miss (the entry is dropped), never wrong data. The tier starts empty: files of an earlier run are
removed at start.
"""
from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import xxhash

from services.cache_pool.eviction import admits, lru_victims
from services.cache_pool_client.types import BlockKey

logger = logging.getLogger(__name__)

MAGIC = b"PRFB"
VERSION = 1
HEADER = struct.Struct("<4sB3xIQQ")
SUFFIX = ".blk"


def encode_key(key: BlockKey) -> bytes:
    model, group_id, block_hash = key
    model_bytes = model.encode()
    return struct.pack("<HI", len(model_bytes), group_id) + model_bytes + block_hash


def checksum(key_bytes: bytes, data: bytes) -> int:
    digest = xxhash.xxh3_64(key_bytes)
    digest.update(data)
    return digest.intdigest()


class SsdTier:
    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self._file_sizes: OrderedDict[BlockKey, int] = OrderedDict()
        self.num_bytes = 0
        self.num_evictions = 0
        self.num_read_errors = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob(f"*{SUFFIX}"), *self.directory.glob("*.tmp")]:
            stale.unlink(missing_ok=True)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._file_sizes

    def __len__(self) -> int:
        return len(self._file_sizes)

    def path_of(self, key: BlockKey) -> Path:
        return self.directory / f"{xxhash.xxh3_128_hexdigest(encode_key(key))}{SUFFIX}"

    def put(self, key: BlockKey, data: bytes) -> bool:
        """Write the block as most recently used, evicting the oldest files past the budget."""
        key_bytes = encode_key(key)
        size = HEADER.size + len(key_bytes) + len(data)
        if not admits(size, self.budget_bytes):
            return False
        self.discard(key)
        header = HEADER.pack(MAGIC, VERSION, len(key_bytes), len(data), checksum(key_bytes, data))
        path = self.path_of(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(key_bytes)
            f.write(data)
        os.replace(tmp, path)
        self._file_sizes[key] = size
        self.num_bytes += size
        for victim in lru_victims(self._file_sizes.items(), self.num_bytes, self.budget_bytes):
            self._remove(victim)
            self.num_evictions += 1
        return True

    def take(self, key: BlockKey) -> bytes | None:
        """Read, verify and remove the block; None when absent, missing or corrupt."""
        if key not in self._file_sizes:
            return None
        data = self._read_verified(key)
        self._remove(key)
        if data is None:
            self.num_read_errors += 1
        return data

    def discard(self, key: BlockKey) -> None:
        if key in self._file_sizes:
            self._remove(key)

    def _read_verified(self, key: BlockKey) -> bytes | None:
        path = self.path_of(key)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            logger.warning("cache pool SSD: cannot read %s: %s", path, exc)
            return None
        key_bytes = encode_key(key)
        if len(raw) < HEADER.size:
            logger.warning("cache pool SSD: %s is truncated", path)
            return None
        magic, version, key_len, data_len, expected = HEADER.unpack_from(raw)
        body = memoryview(raw)[HEADER.size:]
        if (magic, version, key_len) != (MAGIC, VERSION, len(key_bytes)) or len(body) != key_len + data_len \
                or body[:key_len] != key_bytes:
            logger.warning("cache pool SSD: %s has a bad header or belongs to another block", path)
            return None
        data = bytes(body[key_len:])
        if checksum(key_bytes, data) != expected:
            logger.warning("cache pool SSD: %s failed its checksum", path)
            return None
        return data

    def _remove(self, key: BlockKey) -> None:
        self.num_bytes -= self._file_sizes.pop(key)
        self.path_of(key).unlink(missing_ok=True)
