"""Cache pool store (Put) and load (Get) bandwidth vs torch copying the same blocks in memory.

The path a worker's connector uses: ``CachePoolClient.put`` / ``read_into`` to ``prfaas cache-pool``
in its own process on the same host, so block bytes go through the pool's shared-memory arena (a
Put copies them from a tensor into leased slots and commits, a Get copies them out of the slots into
a tensor and checks the slots' generations) and gRPC carries only slot references. Blocks as
SmolLM2-135M's on our CPU workers: 128 tokens x 30 layers x K and V x 3 KV heads x 64 x 2 bytes
(bf16) = 2.8 MiB, 64 of them per round (an 8K-token prompt, 180 MiB); the arena's slots are one
block each (the slot size is the first Put's block size). Each round stores blocks not stored
before, from one pre-allocated, already-touched tensor, then loads them back into another. The
baseline copies the same blocks between those two tensors with torch (``copy_``, block by block),
the best of three copies each round.
Medians over alternating rounds; the headline (last line) gives both ratios, and its figure is the
lower one. Exit status 0 only when it meets the target. A copy into freshly mapped pages (what a
store into new memory pays, and what the pool's former one-file-per-block design paid) is printed
as a secondary line.

    python bench/cache_bandwidth.py [--rounds 5] [--blocks 64]
"""
from __future__ import annotations

import argparse
import asyncio
import mmap
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
import torch
import xxhash
import yaml
from _common import ROOT, free_port, median, verdict
from cache_lookup import wait_serving

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.types import Block, Pieces

TOKENS_PER_BLOCK, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES = 128, 30, 3, 64, 2
BLOCK_BYTES = TOKENS_PER_BLOCK * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES
MODEL = "SmolLM2-135M-Instruct/bf16-block128"
ARENA_GIB = 0.5  # room for two rounds of 64 blocks; older rounds are evicted
TARGET_RATIO = 0.5
BASELINE_TRIES = 3  # torch copies per round; the baseline is the fastest


def start_pool(directory: Path) -> tuple[subprocess.Popen, str]:
    """``prfaas cache-pool`` with its arena in /dev/shm; returns it and its address."""
    port = free_port()
    config = {"workers": [{"name": "decode-0", "port": free_port()}],
              "cache_pools": [{"name": "pool-bandwidth", "cluster": "local", "port": port,
                               "memory_budget_gib": ARENA_GIB, "shared_memory_dir": "/dev/shm"}]}
    path = directory / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "cache-pool", "--config", str(path),
                                "--name", "pool-bandwidth", "--log-level", "warning"], cwd=ROOT)
    return process, f"127.0.0.1:{port}"


def touched(num_blocks: int, fill: int | None = None) -> torch.Tensor:
    """A pre-allocated tensor of ``num_blocks`` blocks, every page written once."""
    tensor = torch.empty((num_blocks, BLOCK_BYTES), dtype=torch.uint8)
    if fill is None:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    else:
        tensor.fill_(fill)
    return tensor


def torch_copy_gbps(source: torch.Tensor, target: torch.Tensor, tries: int = BASELINE_TRIES) -> float:
    """The best of ``tries`` copies of every block: the memory's limit, not a copy that another
    process (or a descheduled copy thread) happened to slow down."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        for i in range(len(source)):
            target[i].copy_(source[i])
        best = min(best, time.perf_counter() - started)
    return source.numel() / best / 1e9


def fresh_copy_gbps(source: torch.Tensor) -> float:
    """Copy into memory never touched before (a fresh anonymous mapping)."""
    started = time.perf_counter()
    buffer = mmap.mmap(-1, source.numel())
    target = torch.frombuffer(buffer, dtype=torch.uint8).view(source.shape)
    for i in range(len(source)):
        target[i].copy_(source[i])
    elapsed = time.perf_counter() - started
    del target
    buffer.close()
    return source.numel() / elapsed / 1e9


async def put_get_gbps(client: CachePoolClient, round_id: int, source: torch.Tensor,
                       target: torch.Tensor) -> tuple[float, float]:
    hashes = [xxhash.xxh3_128_digest(f"{round_id}/{i}".encode()) for i in range(len(source))]
    blocks = [Block(0, h, Pieces((source[i].numpy(),))) for i, h in enumerate(hashes)]
    refs = [(0, h) for h in hashes]
    target.fill_(0)
    started = time.perf_counter()
    stored = await client.put(MODEL, blocks)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    await client.read_into(MODEL, refs, [[target[i].numpy()] for i in range(len(target))])
    get_s = time.perf_counter() - started
    if stored.num_bytes_stored != source.numel() or not torch.equal(source, target):
        raise RuntimeError("the pool did not store or return the blocks intact")
    return source.numel() / put_s / 1e9, source.numel() / get_s / 1e9


async def run(rounds: int, num_blocks: int) -> int:
    source, target = touched(num_blocks), touched(num_blocks, fill=1)
    with tempfile.TemporaryDirectory() as directory:
        process, address = start_pool(Path(directory))
        client = CachePoolClient(address)
        try:
            await wait_serving(client, process)
            if await client.arena() is None:
                raise SystemExit("the pool offers no shared-memory arena here (is /dev/shm large enough?)")
            await put_get_gbps(client, -1, source, target)  # warm-up: connection, the slot size
            copies, fresh, puts, gets = [], [], [], []
            for round_id in range(rounds):
                copies.append(torch_copy_gbps(source, target))
                fresh.append(fresh_copy_gbps(source))
                put_gbps, get_gbps = await put_get_gbps(client, round_id, source, target)
                puts.append(put_gbps)
                gets.append(get_gbps)
                print(f"round {round_id + 1}/{rounds}: torch copy {copies[-1]:.2f} GB/s (into fresh pages "
                      f"{fresh[-1]:.2f}), put {put_gbps:.2f} GB/s, get {get_gbps:.2f} GB/s", file=sys.stderr)
        finally:
            await client.close()
            process.terminate()
            process.wait(10)
    copy = median(copies)
    put_ratio, get_ratio = median(puts) / copy, median(gets) / copy
    print(f"(secondary) torch copy into freshly mapped pages: median {median(fresh):.2f} GB/s; "
          f"put {median(puts) / median(fresh):.3f}x and get {median(gets) / median(fresh):.3f}x of it")
    return verdict("cache pool bandwidth vs torch copy between touched tensors (lower of put, get)",
                   min(put_ratio, get_ratio), TARGET_RATIO,
                   f"put {put_ratio:.3f}x, get {get_ratio:.3f}x: medians put {median(puts):.2f}, get "
                   f"{median(gets):.2f}, torch copy {copy:.2f} GB/s; {num_blocks} blocks of "
                   f"{BLOCK_BYTES / 2**20:.2f} MiB per round, {rounds} rounds",
                   baseline=f"torch copy {copy:.2f} GB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per round (default 64)")
    args = parser.parse_args()
    return asyncio.run(run(args.rounds, args.blocks))


if __name__ == "__main__":
    sys.exit(main())
