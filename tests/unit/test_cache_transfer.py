"""Cross-cluster cache transfers between two real pool services (gRPC on loopback): only what the
target lacks crosses, linear states only at the prefix's end, and failures stay contained."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from support.cache_pool import BLOCK_SIZE, FULL, HYBRID_GROUPS, LINEAR, MODEL, blocks, hashes, prompt, query
from support.ports import refused_address

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool.pool import CachePool
from services.cache_pool_client.transfer import CrossClusterCopier
from services.cache_pool_client.types import layout_key
from services.kv_transport import TransportSettings
from services.scheduling.offload import CacheTransfer
from services.security import KnownPeers


KV_SETTINGS = TransportSettings(secret="pool-secret", recv_idle_timeout_s=5.0)


def _run(pool_server, source_blocks, target_blocks, prefix_blocks, addresses=None, kv=False, stored_as=MODEL):
    """Both pools filled (under the key ``stored_as``), one transfer of the first ``prefix_blocks``
    blocks; returns the pools, the outcome callbacks' records and the bytes the target pool's KV
    listener received. ``kv``: both pools have a KV transport, so bytes go pool to pool."""
    pools = {"prfaas": CachePool(1 << 20), "local": CachePool(1 << 20)}
    options = {"kv_port": 0, "transport": KV_SETTINGS} if kv else {}
    servers = {"local": pool_server(pools["local"], "pool-local", "local", **options)}
    if kv:  # the source pool knows the target as a peer, as cache_pools[] in a config would tell it
        options["peers"] = _peers(servers["local"])
    servers["prfaas"] = pool_server(pools["prfaas"], "pool-prfaas", "prfaas", **options)
    pools["prfaas"].put(stored_as, source_blocks)
    pools["local"].put(stored_as, target_blocks)
    addresses = addresses or {c: f"127.0.0.1:{s.port}" for c, s in servers.items()}
    copied, failed = [], []

    async def main():
        clients = {c: CachePoolClient(a) for c, a in addresses.items()}
        copier = CrossClusterCopier(clients, MODEL, BLOCK_SIZE, HYBRID_GROUPS,
                                    lambda *args: copied.append(args), lambda *args: failed.append(args))
        try:
            copier.issue("r-1", CacheTransfer("prfaas", "local", prefix_blocks * BLOCK_SIZE), PROMPT)
            copier.issue("r-2", CacheTransfer("prfaas", "local", prefix_blocks * BLOCK_SIZE), PROMPT)  # same: skipped
            await asyncio.gather(*copier._running.values())
        finally:
            await copier.close()
            for client in clients.values():
                await client.close()

    asyncio.run(main())
    return pools, copied, failed, servers["local"].servicer.kv_bytes_received


PROMPT = hashes(prompt(8))


@pytest.mark.parametrize("kv", [False, True], ids=["through-router", "pool-to-pool"])
def test_blocks_cross_under_the_engines_layout_key_the_router_does_not_know(pool_server, kv):
    """The router names the model only; the engines' blocks carry their layout in the key."""
    engines_key = layout_key(MODEL, "0123456789abcdef")
    source = blocks(FULL.group_id, PROMPT[:4]) + blocks(LINEAR.group_id, [PROMPT[3]])
    pools, copied, failed, _ = _run(pool_server, source, [], prefix_blocks=4, kv=kv, stored_as=engines_key)
    assert failed == [] and copied == [("prfaas", "local", 5, 500)]
    assert pools["local"].lookup(query(PROMPT[:4], model=engines_key)).num_usable_blocks == 4


@pytest.mark.parametrize("kv", [False, True], ids=["through-router", "pool-to-pool"])
def test_only_the_missing_blocks_and_the_last_state_cross(pool_server, kv):
    source = blocks(FULL.group_id, PROMPT[:6]) + blocks(LINEAR.group_id, [PROMPT[2], PROMPT[5]])
    target = blocks(FULL.group_id, PROMPT[:2]) + blocks(LINEAR.group_id, [PROMPT[1]])
    pools, copied, failed, kv_bytes_received = _run(pool_server, source, target, prefix_blocks=6, kv=kv)
    assert failed == []
    # blocks 2..5 of the attention group and the state at block 5: 5 blocks of 100 bytes
    assert copied == [("prfaas", "local", 5, 500)]
    if kv:
        assert kv_bytes_received == 500  # the bytes came over the target pool's KV listener
    else:
        assert kv_bytes_received == 0
    assert pools["local"].lookup(query(PROMPT)).num_usable_blocks == 6
    assert not pools["local"].contains((MODEL, LINEAR.group_id, PROMPT[2]))  # no state that is not at the end
    assert pools["local"].get(MODEL, [(FULL.group_id, PROMPT[4])]) == blocks(FULL.group_id, [PROMPT[4]])


def test_a_target_that_holds_the_prefix_copies_nothing(pool_server):
    source = blocks(FULL.group_id, PROMPT[:4]) + blocks(LINEAR.group_id, [PROMPT[3]])
    pools, copied, failed, _ = _run(pool_server, source, source, prefix_blocks=4)
    assert (copied, failed) == ([("prfaas", "local", 0, 0)], [])


@pytest.mark.parametrize("kv", [False, True], ids=["through-router", "pool-to-pool"])
def test_a_source_missing_blocks_or_an_unreachable_pool_fails_the_transfer_only(pool_server, kv):
    target = blocks(FULL.group_id, PROMPT[:1])
    source = blocks(FULL.group_id, PROMPT[:3])
    pools, copied, failed, _ = _run(pool_server, source, target, prefix_blocks=3, kv=kv)  # no state
    assert (copied, failed) == ([], [("prfaas", "local")])
    assert pools["local"].lookup(query(PROMPT)).num_full_attention_blocks == 1  # nothing half-copied
    with refused_address() as prfaas, refused_address() as local:
        _, copied, failed, _ = _run(pool_server, [], [], prefix_blocks=3, addresses={"prfaas": prfaas, "local": local})
    assert (copied, failed) == ([], [("prfaas", "local")])


def _peers(*servers) -> KnownPeers:
    return KnownPeers(frozenset(f"127.0.0.1:{s.servicer.kv_port}" for s in servers), "test pools")


def test_a_pool_pushes_only_to_configured_peer_pools(pool_server):
    """A Push naming any other address is PERMISSION_DENIED before a connection is opened, and counted."""
    settings = TransportSettings(secret="pool-secret", recv_idle_timeout_s=1.0)
    source_pool = CachePool(1 << 20)
    source_pool.put(MODEL, blocks(FULL.group_id, PROMPT[:3]))
    target = pool_server(name="pool-b", kv_port=0, transport=settings)
    source = pool_server(source_pool, "pool-a", "prfaas", kv_port=0, transport=settings, peers=_peers(target))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    bait = f"127.0.0.1:{listener.getsockname()[1]}"

    async def main():
        client = CachePoolClient(f"127.0.0.1:{source.port}")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.push(MODEL, [(FULL.group_id, h) for h in PROMPT[:3]], bait, "t-ssrf")
            return error.value
        finally:
            await client.close()

    try:
        error = asyncio.run(main())
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and bait in error.details()
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody dialled the bait
        assert source.servicer.rejections.snapshot() == {"unknown_peer": 1}
    finally:
        listener.close()


def test_pool_to_pool_calls_refuse_bad_requests_and_mismatched_transfers(pool_server):
    settings = TransportSettings(secret="pool-secret", recv_idle_timeout_s=1.0)
    source_pool, target_pool = CachePool(1 << 20), CachePool(1 << 20)
    source_pool.put(MODEL, blocks(FULL.group_id, PROMPT[:3]))
    target = pool_server(target_pool, "pool-b", kv_port=0, transport=settings)
    source = pool_server(source_pool, "pool-a", "prfaas", kv_port=0, transport=settings, peers=_peers(target))
    plain = pool_server(name="pool-c")
    refs = [(FULL.group_id, h) for h in PROMPT[:3]]

    async def main():
        a, b, c = (CachePoolClient(f"127.0.0.1:{s.port}") for s in (source, target, plain))
        try:
            kv_b = await b.kv_address()
            assert kv_b == f"127.0.0.1:{target.servicer.kv_port}" and await c.kv_address() is None
            for call, code in [(a.push(MODEL, refs, "no-port", "t-1"), grpc.StatusCode.INVALID_ARGUMENT),
                               (c.push(MODEL, refs, kv_b, "t-2"), grpc.StatusCode.FAILED_PRECONDITION),
                               (c.put_pushed(MODEL, refs, "t-3"), grpc.StatusCode.FAILED_PRECONDITION),
                               (b.put_pushed(MODEL, refs, "t-never-sent"), grpc.StatusCode.DEADLINE_EXCEEDED)]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                assert error.value.code() == code, error.value.details()
            # Two blocks pushed for a Put of three: refused, nothing stored.
            await a.push(MODEL, refs[:2], kv_b, "t-4")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await b.put_pushed(MODEL, refs, "t-4")
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not target_pool.contains((MODEL, FULL.group_id, PROMPT[0]))
            stored = asyncio.ensure_future(b.put_pushed(MODEL, refs, "t-5"))  # the Put may come first
            await asyncio.sleep(0.2)
            await a.push(MODEL, refs, kv_b, "t-5")
            assert (await stored).num_blocks_stored == 3
            assert target_pool.get(MODEL, refs) == source_pool.get(MODEL, refs)
        finally:
            for client in (a, b, c):
                await client.close()

    asyncio.run(main())
