"""`prfaas cache-pool` as a separate process over real gRPC, and the global index over in-process pools."""
import asyncio
import os
import signal
import urllib.request

import grpc
import pytest
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc
from support.cache_pool import BLOCK_SIZE, FULL, LINEAR, MODEL, hashes, payload, prompt, query
from support.pool_process import start_pool_process, stop, wait_serving, write_pool_config
from support.ports import free_port, refused_address

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.index import GlobalCacheIndex
from services.cache_pool.pool import CachePool
from services.security import GrpcSecurity
from services.cache_pool_client.types import Block
from services.kv_transport import TransportSettings

BUDGET_BYTES = 32 << 20
BLOCK_BYTES = 64 << 10
SHM_DIR = "/dev/shm"  # the pool's default directory for its shared-memory arena
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
    path = write_pool_config(tmp_path, {
        "name": "pool-local", "cluster": "local", "port": port, "metrics_port": metrics_port,
        "memory_budget_gib": BUDGET_BYTES / 2**30, "ssd_dir": str(tmp_path / "ssd"),
        "ssd_budget_gib": (8 << 20) / 2**30, "kv_port": free_port()}, transport={"secret": KV_SECRET})
    process = start_pool_process(path, "pool-local")
    channel = GrpcSecurity().channel(f"127.0.0.1:{port}")
    try:
        wait_serving(channel, process)
        yield process, pb_grpc.CachePoolStub(channel), metrics_port, f"127.0.0.1:{port}"
    finally:
        channel.close()
        stop(process)


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


def _blocks(seed: int, count: int = 16) -> list[Block]:
    return [Block(1, h, payload(h, 1, BLOCK_BYTES)) for h in hashes(prompt(count, seed=seed))]


def test_a_client_on_the_pools_host_moves_block_bytes_through_the_arena_within_the_budget(pool_process):
    process, stub, _, address = pool_process

    async def run():
        client = CachePoolClient(address)
        try:
            arena = await client.arena()
            assert os.path.dirname(arena.path) == os.path.realpath(SHM_DIR)
            assert os.path.basename(arena.path).startswith(f"prfaas-arena-pool-local-{process.pid}-")
            assert arena.size == os.path.getsize(arena.path) == BUDGET_BYTES  # the whole budget, from the start
            blocks = _blocks(seed=1)
            assert (await client.put(MODEL, blocks)).num_blocks_stored == 16
            stats = await client.stats()
            assert (stats.arena_slot_bytes, stats.memory_bytes) == (BLOCK_BYTES, 16 * BLOCK_BYTES)
            got = await client.get(MODEL, [(b.group_id, b.block_hash) for b in blocks])
            assert [b.data for b in got] == [b.data for b in blocks]
            targets = [[bytearray(BLOCK_BYTES // 2), bytearray(BLOCK_BYTES // 2)] for _ in blocks]
            await client.read_into(MODEL, [(b.group_id, b.block_hash) for b in blocks], targets)
            assert [bytes(a + b) for a, b in targets] == [b.data for b in blocks]
            assert (await client.put(MODEL, blocks)).num_blocks_stored == 0  # refreshed, nothing copied

            transfer = _blocks(seed=2, count=3)
            await client.put(MODEL, transfer, transfer_id="req-9")
            assert [b.data for b in await client.take_transfer(MODEL, "req-9")] == [b.data for b in transfer]

            baseline = _rss_bytes(process.pid)
            for seed in range(10, 10 + 64):  # 64 × 1 MiB of distinct prompts: twice the memory budget
                await client.put(MODEL, _blocks(seed))
            stats = await client.stats()
            assert stats.memory_evictions > 0 and stats.memory_bytes <= BUDGET_BYTES
            held = stats.arena_slots - stats.arena_free_slots - stats.leased_slots
            assert stats.memory_bytes == held * stats.arena_slot_bytes  # the accounting is the arena's
            assert _rss_bytes(process.pid) <= baseline + RSS_OVERHEAD_BYTES  # the bytes never entered the process

            inline = CachePoolClient(address, shared_memory=False)
            latest = _blocks(seed=10 + 63)
            assert [b.data for b in await inline.get(MODEL, [(1, b.block_hash) for b in latest])] == \
                [b.data for b in latest]
            await inline.close()
            return arena.path
        finally:
            await client.close()

    arena_path = asyncio.run(run())
    held = stub.GetStats(pb.CachePoolStatsRequest()).memory_blocks
    request = pb.PutRequest(model=MODEL, blocks=[pb.CacheBlock(group_id=1, block_hash=b"h" * 16,
                                                               shm=pb.ShmFile(name="prfaas-put-1", size=BLOCK_BYTES))])
    _expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put, request)  # the former block files: refused
    _expect_error(grpc.StatusCode.FAILED_PRECONDITION, stub.Commit, pb.CommitRequest(lease_id="lease-unknown"))
    assert stub.GetStats(pb.CachePoolStatsRequest()).memory_blocks == held
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0
    assert not os.path.exists(arena_path)  # a clean stop removes the arena


@pytest.mark.parametrize("kv_host", ["127.0.0.1", ""], ids=["put-and-get", "put-only"])
def test_a_client_without_shared_memory_moves_block_bytes_over_the_kv_transport(pool_process, kv_host):
    """A worker on another host: Puts stream to the pool's KV port; Gets come back pushed to the
    client's own listener when it has an address the pool can reach, else inline."""
    process, stub, _, address = pool_process

    async def run():
        client = CachePoolClient(address, shared_memory=False, transport=TransportSettings(secret=KV_SECRET),
                                 kv_host=kv_host)
        try:
            assert await client.arena() is None and await client.kv_address() is not None
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
    assert stub.GetStats(pb.CachePoolStatsRequest()).leased_slots == 0  # no arena Put was made
