"""Crash safety of the cache pool's arena: a client SIGKILLed mid-Put, the pool SIGKILLed mid-Get.

After either, no slot leaks (a dead client's lease expires; a dead pool's arena file is removed when
a pool of its name starts again), no Get returns wrong data, and the pool's accounting equals what
its arena holds (every slot free, leased, or a stored block's).
"""
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc
from support.cache_pool import BLOCK_SIZE, MODEL, hashes, payload, prompt
from support.pool_process import start_pool_process, stop, wait_serving, write_pool_config
from support.ports import free_port

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.types import Block
from services.security import GrpcSecurity

BLOCK_BYTES = 64 << 10
BUDGET_BYTES = 4 << 20
LEASE_TIMEOUT_S = 1.0
SHM_DIR = "/dev/shm"
ROOT = Path(__file__).resolve().parents[2]

STALLING_CLIENT = """
import asyncio, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from services.cache_pool_client.arena import ArenaMapping
from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.types import Block
from support.cache_pool import MODEL, hashes, payload, prompt

write, written = ArenaMapping.write, []
def write_then_stall(self, layout, block, pieces):
    write(self, layout, block, pieces)
    written.append(block)
    if len(written) == 3:  # mid-Put: 3 of 8 blocks copied, none committed
        print("mid-put", flush=True)
        time.sleep(3600)
ArenaMapping.write = write_then_stall

async def main():
    client = CachePoolClient({address!r})
    await client.put(MODEL, [Block(1, h, payload(h, 1, {size})) for h in hashes(prompt(8, seed=99))])
asyncio.run(main())
"""


class Pool:
    """A pool process that can be killed and started again under the same name and port."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self.port, self.metrics_port = free_port(), free_port()
        self.config = write_pool_config(directory, {
            "name": name, "port": self.port, "metrics_port": self.metrics_port,
            "memory_budget_gib": BUDGET_BYTES / 2**30, "lease_timeout_s": LEASE_TIMEOUT_S})
        self.channel = GrpcSecurity().channel(self.address)
        self.stub = pb_grpc.CachePoolStub(self.channel)
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Pool":
        self.process = start_pool_process(self.config, self.name)
        wait_serving(self.channel, self.process)
        return self

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stats(self) -> pb.CachePoolStats:
        return self.stub.GetStats(pb.CachePoolStatsRequest())

    def arena_files(self) -> list[str]:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(f"prfaas-arena-{self.name}-")]

    def close(self) -> None:
        if self.process is not None:
            stop(self.process)
        self.channel.close()


@pytest.fixture
def pools(tmp_path):
    started = []

    def make(name: str) -> Pool:
        pool = Pool(tmp_path, f"{name}-{os.getpid()}")  # a name no other test run's pool has
        started.append(pool)
        return pool.start()

    yield make
    for pool in started:
        pool.close()


def audit(stats: pb.CachePoolStats) -> None:
    """Every slot is free, leased or a stored block's, and the stored bytes are exactly those slots."""
    held = stats.arena_slots - stats.arena_free_slots - stats.leased_slots
    assert stats.arena_slots > 0 and 0 <= held <= stats.arena_slots
    assert stats.memory_bytes == held * stats.arena_slot_bytes


def _blocks(seed: int, count: int = 16) -> list[Block]:
    return [Block(1, h, payload(h, 1, BLOCK_BYTES)) for h in hashes(prompt(count, seed=seed))]


def _refs(blocks: list[Block]) -> list[tuple[int, bytes]]:
    return [(b.group_id, b.block_hash) for b in blocks]


def _usable_blocks(pool: Pool, seed: int, count: int) -> int:
    request = pb.LookupRequest(model=MODEL, block_size=BLOCK_SIZE, block_hashes=hashes(prompt(count, seed=seed)),
                               groups=[pb.KvCacheGroup(group_id=1, kind=pb.GROUP_KIND_FULL_ATTENTION)])
    return pool.stub.Lookup(request).num_usable_blocks


async def _reconnected(client: CachePoolClient, timeout_s: float = 10.0) -> None:
    """Until the client's channel, refused while the pool was down, reaches the pool again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.stats()
            return
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, "the client did not reconnect"
            await asyncio.sleep(0.1)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_killed_mid_put_leaks_no_slot_once_its_lease_expires(pools):
    pool = pools("pool-crash-put")
    kept = _blocks(seed=1)

    async def put_and_read(blocks):
        client = CachePoolClient(pool.address)
        try:
            await client.put(MODEL, blocks)
            return await client.get(MODEL, _refs(blocks))
        finally:
            await client.close()

    asyncio.run(put_and_read(kept))
    code = STALLING_CLIENT.format(root=str(ROOT), tests=str(ROOT / "tests"), address=pool.address, size=BLOCK_BYTES)
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "mid-put"
        assert pool.stats().leased_slots == 8
        audit(pool.stats())
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        client.stdout.close()

    _wait_for(lambda: pool.stats().leased_slots == 0, timeout_s=LEASE_TIMEOUT_S + 5)
    stats = pool.stats()
    assert (stats.lease_expiries, stats.memory_blocks) == (1, 16)
    audit(stats)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{pool.metrics_port}/metrics").read().decode()
    assert "prfaas_cache_pool_lease_expiries_total 1.0" in metrics
    assert 'prfaas_cache_pool_arena_slots{state="leased"} 0.0' in metrics
    assert _usable_blocks(pool, seed=99, count=8) == 0  # the uncommitted blocks were never stored
    assert [b.data for b in asyncio.run(put_and_read(kept))] == [b.data for b in kept]

    for seed in range(2, 2 + 5):  # 80 blocks of a 63-slot arena: every slot, the freed ones too, is reused
        latest = _blocks(seed)
        assert [b.data for b in asyncio.run(put_and_read(latest))] == [b.data for b in latest]
    stats = pool.stats()
    assert stats.arena_free_slots == 0 and stats.leased_slots == 0
    audit(stats)


def test_the_pool_killed_mid_get_returns_no_wrong_data_and_leaks_no_arena(pools):
    pool = pools("pool-crash-get")
    blocks = _blocks(seed=1)
    (old_arena,) = pool.arena_files()

    async def run():
        client = CachePoolClient(pool.address)
        try:
            await client.put(MODEL, blocks)
            views = await client.get_views(MODEL, _refs(blocks))  # the Get answered: slot references
            pool.kill()  # before the client copied a byte
            assert [bytes(b.data) for b in views] == [b.data for b in blocks]
            assert all(b.data.intact() for b in views)  # nothing reused the slots: the copies are right
            with pytest.raises(grpc.aio.AioRpcError):
                await client.get(MODEL, _refs(blocks))  # the pool is gone: a miss, not wrong data

            pool.start()  # a pool of the same name: the killed one's arena goes, a new one comes
            assert pool.arena_files() != [old_arena] and len(pool.arena_files()) == 1
            await _reconnected(client)
            with pytest.raises(grpc.aio.AioRpcError, match="NOT_FOUND"):
                await client.get(MODEL, _refs(blocks))  # the new pool holds nothing yet
            again = _blocks(seed=2)
            await client.put(MODEL, again)  # the client maps the new arena
            assert [b.data for b in await client.get(MODEL, _refs(again))] == [b.data for b in again]
        finally:
            await client.close()

    asyncio.run(run())
    audit(pool.stats())
    assert pool.stats().memory_blocks == 16


def test_gets_racing_a_pool_kill_return_the_right_bytes_or_fail(pools):
    pool = pools("pool-crash-race")
    blocks = _blocks(seed=3)
    outcomes = {"right": 0, "failed": 0}

    async def run():
        client = CachePoolClient(pool.address)
        try:
            await client.put(MODEL, blocks)
            killer = asyncio.get_running_loop().run_in_executor(None, lambda: (time.sleep(0.3), pool.kill()))
            while not killer.done() or outcomes["failed"] == 0:
                try:
                    got = await client.get(MODEL, _refs(blocks))
                except Exception:  # noqa: BLE001 - the pool died under this Get: a miss
                    outcomes["failed"] += 1
                    continue
                assert [b.data for b in got] == [b.data for b in blocks]
                outcomes["right"] += 1
            await killer
        finally:
            await client.close()

    asyncio.run(run())
    assert outcomes["right"] > 0 and outcomes["failed"] > 0
    killed_arena = pool.arena_files()
    pool.start()  # removes the killed pool's arena (nothing else would: it is the tmpfs' memory)
    assert len(pool.arena_files()) == 1 and pool.arena_files() != killed_arena
