"""Cache pool store (Put) and load (Get) bandwidth vs a plain memory copy of the same bytes.

The path a worker's connector uses: ``CachePoolClient.put`` / ``get`` to ``prfaas cache-pool`` in its
own process on the same host, so block bytes go through the pool's shared-memory files and gRPC
carries names. Blocks as SmolLM2-135M's on our CPU workers: 128 tokens x 30 layers x K and V x 3 KV
heads x 64 x 2 bytes (bf16) = 2.8 MiB, 64 of them per round (an 8K-token prompt, 180 MiB). Each round
stores blocks not stored before, then reads them back. The baseline copies the same blocks once each
into memory never used before (a fresh anonymous mapping), which is the least a store of new blocks
or a load into new buffers must do; a copy into one reused buffer (much faster on this VM, where
fresh pages are expensive) is printed too, with the ratios against it.
Medians over alternating rounds; the headline is the lower of the two ratios.
Exit status 0 only when it meets the target.

    python bench/cache_bandwidth.py [--rounds 5] [--blocks 64]
"""
from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
import xxhash
from _common import median, verdict
from cache_lookup import start_pool, wait_serving

from services.cache_pool.client import CachePoolClient
from services.cache_pool.types import Block

TOKENS_PER_BLOCK, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES = 128, 30, 3, 64, 2
BLOCK_BYTES = TOKENS_PER_BLOCK * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES
MODEL = "SmolLM2-135M-Instruct/bf16-block128"
TARGET_RATIO = 0.5


def fresh_copy_gbps(blocks: list[Block]) -> float:
    """Copy into memory never touched before, as a store of new blocks must: a fresh anonymous
    mapping (``bytearray`` would sometimes get pages malloc kept from an earlier round)."""
    started = time.perf_counter()
    target = mmap.mmap(-1, len(blocks) * BLOCK_BYTES)
    for i, block in enumerate(blocks):
        target[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] = block.data
    elapsed = time.perf_counter() - started
    target.close()
    return len(blocks) * BLOCK_BYTES / elapsed / 1e9


def reused_copy_gbps(blocks: list[Block]) -> float:
    target = bytearray(BLOCK_BYTES)
    started = time.perf_counter()
    for block in blocks:
        target[:] = block.data
    return len(blocks) * BLOCK_BYTES / (time.perf_counter() - started) / 1e9


def new_blocks(round_id: int, num_blocks: int) -> list[Block]:
    payload = os.urandom(BLOCK_BYTES)
    return [Block(0, xxhash.xxh3_128_digest(f"{round_id}/{i}".encode()), payload[i:] + payload[:i])
            for i in range(num_blocks)]


async def put_get_gbps(client: CachePoolClient, blocks: list[Block]) -> tuple[float, float]:
    num_bytes = len(blocks) * BLOCK_BYTES
    started = time.perf_counter()
    stored = await client.put(MODEL, blocks)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    loaded = await client.get(MODEL, [(b.group_id, b.block_hash) for b in blocks])
    get_s = time.perf_counter() - started
    if stored.num_bytes_stored != num_bytes or [b.data for b in loaded] != [b.data for b in blocks]:
        raise RuntimeError("the pool did not store or return the blocks intact")
    return num_bytes / put_s / 1e9, num_bytes / get_s / 1e9


async def run(rounds: int, num_blocks: int) -> int:
    with tempfile.TemporaryDirectory() as directory:
        process, address = start_pool(Path(directory))
        client = CachePoolClient(address)
        try:
            await wait_serving(client, process)
            await put_get_gbps(client, new_blocks(-1, num_blocks))  # warm-up: connection, the pool's buffers
            fresh, reused, puts, gets = [], [], [], []
            for round_id in range(rounds):
                blocks = new_blocks(round_id, num_blocks)
                fresh.append(fresh_copy_gbps(blocks))
                reused.append(reused_copy_gbps(blocks))
                put_gbps, get_gbps = await put_get_gbps(client, blocks)
                puts.append(put_gbps)
                gets.append(get_gbps)
                print(f"round {round_id + 1}/{rounds}: copy {fresh[-1]:.2f} GB/s (reused buffer {reused[-1]:.2f}), "
                      f"put {put_gbps:.2f} GB/s, get {get_gbps:.2f} GB/s", file=sys.stderr)
        finally:
            await client.close()
            process.terminate()
            process.wait(10)
    put_ratio, get_ratio = median(puts) / median(fresh), median(gets) / median(fresh)
    print(f"(informational) copy into one reused buffer: median {median(reused):.2f} GB/s; "
          f"put {median(puts) / median(reused):.3f}x and get {median(gets) / median(reused):.3f}x of it")
    return verdict("cache pool bandwidth vs memory copy (lower of put, get)", min(put_ratio, get_ratio),
                   TARGET_RATIO, f"put {put_ratio:.3f}x, get {get_ratio:.3f}x: medians put {median(puts):.2f}, "
                   f"get {median(gets):.2f}, copy {median(fresh):.2f} GB/s; {num_blocks} blocks of "
                   f"{BLOCK_BYTES / 2**20:.2f} MiB per round, {rounds} rounds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per round (default 64)")
    args = parser.parse_args()
    return asyncio.run(run(args.rounds, args.blocks))


if __name__ == "__main__":
    sys.exit(main())
