"""`prfaas cache-pool` as a separate process over real gRPC, and the global index over in-process pools."""
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc
from support.cache_pool import BLOCK_SIZE, FULL, LINEAR, MODEL, hashes, payload, prompt, query
from support.ports import free_port, refused_address

from services.cache_pool.client import CachePoolClient
from services.cache_pool.index import GlobalCacheIndex
from services.cache_pool.pool import CachePool
from services.security import GrpcSecurity
from services.cache_pool.shm import ShmStore, same_host_directory
from services.cache_pool.types import Block
from services.kv_transport import TransportSettings

BUDGET_BYTES = 32 << 20
BLOCK_BYTES = 64 << 10
SHM_DIR = "/dev/shm"  # the pool's default shared-memory directory
KV_SECRET = "pool-kv-secret"
# Python, grpc, protobuf and prometheus_client (~48 MiB RSS, measured at start) are outside the budget;
# on top of them the process may use this much for gRPC message buffers, per-block bookkeeping and
# allocator slack (measured: 9-13 MiB with a 32 MiB budget of 64 KiB blocks).
RSS_OVERHEAD_BYTES = 32 << 20
HYBRID = [pb.KvCacheGroup(group_id=0, kind=pb.GROUP_KIND_LINEAR_ATTENTION),
          pb.KvCacheGroup(group_id=1, kind=pb.GROUP_KIND_FULL_ATTENTION)]


@pytest.fixture
def pool_process(tmp_path):
    port, metrics_port = free_port(), free_port()
    config = {
        "workers": [{"name": "decode-0", "port": free_port()}],
        "cache_pools": [{"name": "pool-local", "cluster": "local", "port": port, "metrics_port": metrics_port,
                         "memory_budget_gib": BUDGET_BYTES / 2**30, "ssd_dir": str(tmp_path / "ssd"),
                         "ssd_budget_gib": (8 << 20) / 2**30, "kv_port": free_port()}],
        "transport": {"secret": KV_SECRET},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "cache-pool", "--config", str(path),
                                "--name", "pool-local"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    channel = GrpcSecurity().channel(f"127.0.0.1:{port}")
    try:
        _wait_serving(channel, process)
        yield process, pb_grpc.CachePoolStub(channel), metrics_port, f"127.0.0.1:{port}"
    finally:
        channel.close()
        if process.poll() is None:
            process.terminate()  # a clean stop removes the pool's shared-memory files
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait(10)
        process.stdout.close()


def _wait_serving(channel, process, timeout_s: float = 30.0) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service="prfaas.v1.CachePool"), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            time.sleep(0.1)
    raise TimeoutError("cache pool did not become SERVING")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _put(stub, group_id, block_hashes, size=BLOCK_BYTES, **kwargs):
    blocks = [pb.CacheBlock(group_id=group_id, block_hash=h, data=payload(h, group_id, size)) for h in block_hashes]
    return stub.Put(pb.PutRequest(model=MODEL, blocks=blocks, **kwargs))


def test_service_process_put_lookup_get_stats_and_memory_bound(pool_process):
    process, stub, metrics_port, _ = pool_process
    stored = hashes(prompt(8, shared=6, seed=1))
    assert _put(stub, 1, stored).num_blocks_stored == 8
    _put(stub, 0, [stored[3], stored[7]])
    answer = stub.Lookup(pb.LookupRequest(model=MODEL, block_size=BLOCK_SIZE, groups=HYBRID,
                                          block_hashes=hashes(prompt(10, shared=6, seed=2))))
    assert (answer.pool, answer.cluster, answer.num_usable_blocks, answer.num_usable_tokens,
            answer.num_full_attention_blocks) == ("pool-local", "local", 4, 4 * BLOCK_SIZE, 6)
    got = stub.Get(pb.GetRequest(model=MODEL, blocks=[pb.CacheBlockRef(group_id=1, block_hash=h) for h in stored[:4]]))
    assert [b.data for b in got.blocks] == [payload(h, 1, BLOCK_BYTES) for h in stored[:4]]

    _put(stub, 1, stored[:2], transfer_id="req-7")
    assert len(stub.Get(pb.GetRequest(model=MODEL, transfer_id="req-7")).blocks) == 2
    _expect_error(grpc.StatusCode.NOT_FOUND, stub.Get, pb.GetRequest(model=MODEL, transfer_id="req-7"))
    _expect_error(grpc.StatusCode.NOT_FOUND, stub.Get, pb.GetRequest(
        model=MODEL, blocks=[pb.CacheBlockRef(group_id=1, block_hash=b"unknown")]))
    _expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Lookup, pb.LookupRequest(model=MODEL, block_size=BLOCK_SIZE))
    _expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put, pb.PutRequest(model="", blocks=[]))

    baseline = _rss_bytes(process.pid)
    for seed in range(2, 2 + 16):   # 16 × 16 MiB of distinct prompts: 8× the memory budget
        for chunk in range(16):
            _put(stub, 1, hashes(prompt(16, seed=seed * 100 + chunk)))
    stats = stub.GetStats(pb.CachePoolStatsRequest())
    assert stats.memory_bytes <= BUDGET_BYTES and stats.memory_bytes == stats.memory_blocks * BLOCK_BYTES
    assert stats.memory_evictions > 0 and stats.ssd_bytes <= stats.ssd_budget_bytes and stats.ssd_evictions > 0
    assert (stats.num_lookups, stats.full_attention_hits, stats.linear_attention_hits) == (1, 4, 1)
    rss = _rss_bytes(process.pid)
    assert rss <= baseline + BUDGET_BYTES + RSS_OVERHEAD_BYTES, f"RSS {baseline >> 20} -> {rss >> 20} MiB"

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    for line in ('prfaas_cache_pool_hits_total{group="linear"} 1.0', 'prfaas_cache_pool_evictions_total{tier="memory"}',
                 "prfaas_cache_pool_lookup_latency_seconds_count 1.0", 'prfaas_cache_pool_stored_bytes{tier="ssd"}'):
        assert line in metrics
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0


def _expect_error(code, call, request):
    with pytest.raises(grpc.RpcError) as error:
        call(request)
    assert error.value.code() == code, error.value.details()


def test_global_index_answers_per_cluster_and_neutral_for_a_dead_pool(pool_server):
    pools = {"prfaas": CachePool(1 << 20), "local": CachePool(1 << 20)}
    servers = {c: pool_server(p, f"pool-{c}", c) for c, p in pools.items()}
    prompt_hashes = hashes(prompt(6))
    for cluster, num_blocks in (("prfaas", 5), ("local", 2)):
        stored = prompt_hashes[:num_blocks]
        pools[cluster].put(MODEL, [_block(FULL.group_id, h) for h in stored] + [_block(LINEAR.group_id, stored[-1])])

    async def lookup(addresses):
        index = GlobalCacheIndex(addresses, timeout_s=2.0)
        try:
            return await index.lookup(query(prompt_hashes))
        finally:
            await index.close()

    with refused_address() as dead:
        answers = asyncio.run(lookup({c: f"127.0.0.1:{s.port}" for c, s in servers.items()} | {"dead": dead}))
    assert {c: a.num_usable_tokens for c, a in answers.items()} == {
        "prfaas": 5 * BLOCK_SIZE, "local": 2 * BLOCK_SIZE, "dead": 0}


def _block(group_id, block_hash):
    return Block(group_id, block_hash, payload(block_hash, group_id))


def _pool_files(pool: str = "pool-local") -> dict[str, int]:
    return {entry.name: entry.stat().st_size for entry in os.scandir(SHM_DIR)
            if entry.name.startswith(f"prfaas-pool-{pool}-") and not entry.name.endswith("-probe")}


def _blocks(seed: int, count: int = 16) -> list[Block]:
    return [Block(1, h, payload(h, 1, BLOCK_BYTES)) for h in hashes(prompt(count, seed=seed))]


def test_a_client_on_the_pools_host_moves_block_bytes_through_shared_memory_within_the_budget(pool_process):
    process, stub, _, address = pool_process
    before = set(os.listdir(SHM_DIR))

    async def run():
        client = CachePoolClient(address)
        try:
            assert await client.shared_memory_dir() == os.path.realpath(SHM_DIR)
            blocks = _blocks(seed=1)
            assert (await client.put(MODEL, blocks)).num_blocks_stored == 16
            files = _pool_files()
            assert len(files) == 16 and sum(files.values()) == 16 * BLOCK_BYTES  # the bytes are the pool's files
            assert not [n for n in os.listdir(SHM_DIR) if n.startswith("prfaas-put-")]  # every file was taken over
            got = await client.get(MODEL, [(b.group_id, b.block_hash) for b in blocks])
            assert [b.data for b in got] == [b.data for b in blocks]
            assert (await client.put(MODEL, blocks)).num_blocks_stored == 0  # refreshed: the new files are freed
            assert len(_pool_files()) == 16

            transfer = _blocks(seed=2, count=3)
            await client.put(MODEL, transfer, transfer_id="req-9")
            assert [b.data for b in await client.take_transfer(MODEL, "req-9")] == [b.data for b in transfer]
            assert len(_pool_files()) == 16  # the transfer's files were read and removed

            baseline = _rss_bytes(process.pid)
            for seed in range(10, 10 + 64):  # 64 × 1 MiB of distinct prompts: twice the memory budget
                await client.put(MODEL, _blocks(seed))
            stats = await client.stats()
            assert stats.memory_evictions > 0 and stats.memory_bytes <= BUDGET_BYTES
            assert sum(_pool_files().values()) == stats.memory_bytes  # the files are the memory tier
            assert _rss_bytes(process.pid) <= baseline + RSS_OVERHEAD_BYTES  # the bytes never entered the process

            inline = CachePoolClient(address, shared_memory=False)
            latest = _blocks(seed=10 + 63)
            assert [b.data for b in await inline.get(MODEL, [(1, b.block_hash) for b in latest])] == \
                [b.data for b in latest]
            await inline.close()
        finally:
            await client.close()

    asyncio.run(run())
    held = stub.GetStats(pb.CachePoolStatsRequest()).memory_blocks
    for name in ("../etc/passwd", "prfaas-put-missing", "prfaas-pool-pool-local-1-x-0"):
        request = pb.PutRequest(model=MODEL, blocks=[pb.CacheBlock(group_id=1, block_hash=b"h" * 16,
                                                                   shm=pb.ShmFile(name=name, size=BLOCK_BYTES))])
        _expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put, request)
    assert stub.GetStats(pb.CachePoolStatsRequest()).memory_blocks == held == BUDGET_BYTES // BLOCK_BYTES
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0
    assert set(os.listdir(SHM_DIR)) - before == set() and not _pool_files()  # blocks and probe removed


def test_block_files_of_a_killed_pool_are_removed_when_a_pool_of_that_name_starts(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"prfaas-pool-pool-x-{int(dead.stdout)}-abcd-0"
    stale.write_bytes(b"old block")
    alive = tmp_path / f"prfaas-pool-pool-x-{os.getpid()}-ef01-0"
    alive.write_bytes(b"a running pool's block")
    store = ShmStore(tmp_path, "pool-x")
    assert not stale.exists() and alive.exists()
    assert same_host_directory(str(tmp_path), store.probe_file, store.probe_token) == str(tmp_path)
    assert same_host_directory(str(tmp_path), store.probe_file, b"another pool's token") is None
    assert same_host_directory("/nonexistent", store.probe_file, store.probe_token) is None
    with pytest.raises(ValueError, match="holds 9 bytes"):
        (tmp_path / "prfaas-put-1").write_bytes(b"123456789")
        store.adopt("prfaas-put-1", 10)
    adopted = store.adopt("prfaas-put-1", 9)
    assert bytes(adopted) == b"123456789" and not (tmp_path / "prfaas-put-1").exists()
    store.close()
    assert not os.path.exists(adopted.path) and alive.exists()


def test_put_files_a_client_never_put_are_removed_once_old(tmp_path):
    """A client killed between writing its block files and its Put leaves them behind; the pool
    removes them at start and then periodically, once they are older than any Put takes."""
    orphan = tmp_path / "prfaas-put-4242-dead-0"
    orphan.write_bytes(b"x" * 4096)
    os.utime(orphan, (time.time() - 600, time.time() - 600))
    fresh = tmp_path / "prfaas-put-4242-live-0"
    fresh.write_bytes(b"y" * 4096)
    other = tmp_path / "unrelated-file"
    other.write_bytes(b"z")
    os.utime(other, (time.time() - 600, time.time() - 600))
    store = ShmStore(tmp_path, "pool-x", orphan_put_age_s=1.0)
    try:
        assert not orphan.exists() and fresh.exists() and other.exists()  # swept at start
        assert store.orphan_puts_removed == 1
        deadline = time.monotonic() + 5
        while fresh.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not fresh.exists() and store.orphan_puts_removed == 2  # swept once it was old enough
        assert other.exists()
    finally:
        store.close()


@pytest.mark.parametrize("kv_host", ["127.0.0.1", ""], ids=["put-and-get", "put-only"])
def test_a_client_without_shared_memory_moves_block_bytes_over_the_kv_transport(pool_process, kv_host):
    """A worker on another host: Puts stream to the pool's KV port; Gets come back pushed to the
    client's own listener when it has an address the pool can reach, else inline."""
    process, stub, _, address = pool_process

    async def run():
        client = CachePoolClient(address, shared_memory=False, transport=TransportSettings(secret=KV_SECRET),
                                 kv_host=kv_host)
        try:
            assert await client.shared_memory_dir() is None and await client.kv_address() is not None
            blocks = _blocks(seed=3)
            assert (await client.put(MODEL, blocks)).num_bytes_stored == 16 * BLOCK_BYTES
            got = await client.get(MODEL, [(b.group_id, b.block_hash) for b in blocks])
            assert [b.data for b in got] == [b.data for b in blocks]
            sender = client._kv.transport if kv_host else client._kv_sender
            sent = sum(peer.bytes_sent for peer in sender.snapshot().peers)
            received = client._kv.transport.snapshot().bytes_received if client._kv is not None else None
            return sent, received
        finally:
            await client.close()

    sent, received = asyncio.run(run())
    assert sent > 16 * BLOCK_BYTES  # the Put's bytes (and frame headers) went over the transport
    assert received == (16 * BLOCK_BYTES if kv_host else None)  # the Get's came back over the client's listener
    assert not _pool_files()  # nothing went through shared memory
