"""Cache lookup latency of a 128K-token prompt: block hashing plus the global index's query.

What the router does per request when cache pools are configured: ``prompt_block_hashes`` of the
prompt's tokens, then ``GlobalCacheIndex.lookup`` against a real cache pool (``prfaas cache-pool`` in
its own process, gRPC over loopback) that holds the first half of the prompt's blocks, so the pool
walks 512 stored blocks before the first miss. Blocks carry 64 bytes each: a lookup reads only the
index, never block data. Latency percentiles over many lookups of the same prompt; each line also
splits the p50 into hashing and query. Measured at the block size our workers' vLLM engines use on
CPU (128, vLLM's CPU default), with the default ``xxh3`` hashing; informational lines before the
headline: the same with ``vllm-sha256`` hashing (the baseline, vLLM's own chain), and at block size
16 (vLLM's GPU default). Exit status 0 only when the p50 at block size 128 is under the target.

    python bench/cache_lookup.py [--iterations 400]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
import yaml
from _common import ROOT, free_port, verdict

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool_client.index import GlobalCacheIndex
from services.cache_pool_client.types import Block, GroupKind, KvCacheGroup, LookupQuery

NUM_TOKENS = 128 * 1024
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 128, 16
TARGET_P50_MS = 2.0
MODEL = "bench-model/layout-1"
GROUPS = (KvCacheGroup(0, GroupKind.FULL_ATTENTION),)
BLOCK_BYTES = 64
PUT_BATCH = 1024


def start_pool(directory: Path) -> tuple[subprocess.Popen, str]:
    """``prfaas cache-pool`` from a one-pool config; returns it and its address once it serves."""
    port = free_port()
    config = {"workers": [{"name": "decode-0", "port": free_port()}],
              "cache_pools": [{"name": "pool-bench", "cluster": "local", "port": port, "memory_budget_gib": 1.0}]}
    path = directory / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "cache-pool", "--config", str(path),
                                "--name", "pool-bench", "--log-level", "warning"], cwd=ROOT)
    return process, f"127.0.0.1:{port}"


async def wait_serving(client: CachePoolClient, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the cache pool exited at start")
        try:
            await client.stats()
            return
        except Exception:  # noqa: BLE001 (not listening yet)
            await asyncio.sleep(0.2)
    raise TimeoutError("the cache pool did not start")


async def store_prefix(client: CachePoolClient, block_hashes: list[bytes]) -> None:
    for start in range(0, len(block_hashes), PUT_BATCH):
        chunk = block_hashes[start:start + PUT_BATCH]
        await client.put(MODEL, [Block(0, h, h * (BLOCK_BYTES // len(h))) for h in chunk])


async def measure(index: GlobalCacheIndex, client: CachePoolClient, tokens: list[int], block_size: int,
                  algorithm: str, iterations: int) -> tuple[list[float], list[float]]:
    """Stores the first half of the prompt's blocks, then times hashing + lookup; (totals, hashing) in ms."""
    block_hashes = prompt_block_hashes(tokens, block_size, algorithm)
    num_stored = len(block_hashes) // 2
    await store_prefix(client, block_hashes[:num_stored])
    totals, hashing = [], []
    for i in range(iterations + iterations // 10):
        started = time.perf_counter()
        block_hashes = prompt_block_hashes(tokens, block_size, algorithm)
        hashed = time.perf_counter()
        results = await index.lookup(LookupQuery(MODEL, block_size, tuple(block_hashes), GROUPS))
        finished = time.perf_counter()
        if results["local"].num_usable_blocks != num_stored:
            raise RuntimeError(f"lookup found {results['local'].num_usable_blocks} blocks, expected {num_stored}")
        if i >= iterations // 10:  # the first tenth warms up
            totals.append((finished - started) * 1e3)
            hashing.append((hashed - started) * 1e3)
    return totals, hashing


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def describe(totals: list[float], hashing: list[float]) -> str:
    p50_hash = statistics.median(hashing)
    return (f"p50 {statistics.median(totals):.3f} ms (hashing {p50_hash:.3f} + query "
            f"{statistics.median(totals) - p50_hash:.3f}), p99 {percentile(totals, 99):.3f} ms")


async def run(iterations: int) -> int:
    tokens = [random.Random(7).randrange(1, 150_000) for _ in range(NUM_TOKENS)]
    with tempfile.TemporaryDirectory() as directory:
        process, address = start_pool(Path(directory))
        client, index = CachePoolClient(address), GlobalCacheIndex({"local": address}, timeout_s=1.0)
        try:
            await wait_serving(client, process)
            runs = {}
            for block_size, algorithm in ((CPU_BLOCK_SIZE, "vllm-sha256"), (GPU_BLOCK_SIZE, "xxh3"),
                                          (CPU_BLOCK_SIZE, "xxh3")):
                runs[block_size, algorithm] = await measure(index, client, tokens, block_size, algorithm, iterations)
                print(f"block size {block_size}, {algorithm}: {describe(*runs[block_size, algorithm])}",
                      file=sys.stderr)
        finally:
            await client.close()
            await index.close()
            process.terminate()
            process.wait(10)
    for block_size, algorithm in ((CPU_BLOCK_SIZE, "vllm-sha256"), (GPU_BLOCK_SIZE, "xxh3")):
        print(f"(informational) block size {block_size} ({NUM_TOKENS // block_size} blocks), {algorithm} hashing: "
              f"{describe(*runs[block_size, algorithm])}")
    totals, hashing = runs[CPU_BLOCK_SIZE, "xxh3"]
    baseline = f"vllm-sha256 hashing p50 {statistics.median(runs[CPU_BLOCK_SIZE, 'vllm-sha256'][0]):.3f} ms"
    return verdict("cache lookup p50 latency, 128K-token prompt [ms]", statistics.median(totals), TARGET_P50_MS,
                   f"block size {CPU_BLOCK_SIZE}, xxh3 hashing: {describe(totals, hashing)}, "
                   f"{len(totals)} lookups, half the prompt stored", higher_is_better=False, baseline=baseline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=400, help="measured lookups per configuration")
    args = parser.parse_args()
    return asyncio.run(run(args.iterations))


if __name__ == "__main__":
    sys.exit(main())
