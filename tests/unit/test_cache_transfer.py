"""Cross-cluster cache transfers between two real pool services (gRPC on loopback): only what the
target lacks crosses, linear states only at the prefix's end, and failures stay contained."""
from __future__ import annotations

import asyncio

from support.cache_pool import BLOCK_SIZE, FULL, HYBRID_GROUPS, LINEAR, MODEL, blocks, hashes, prompt, query
from support.ports import free_port

from services.cache_pool.client import CachePoolClient
from services.cache_pool.pool import CachePool
from services.cache_pool.server import PoolIdentity, start_pool_server
from services.cache_pool.transfer import CrossClusterCopier
from services.scheduling.offload import CacheTransfer


def _run(source_blocks, target_blocks, prefix_blocks, addresses=None):
    """Both pools filled, one transfer of the first ``prefix_blocks`` blocks; returns the pools, the
    outcome callbacks' records and the copy's result."""
    pools = {"prfaas": CachePool(1 << 20), "local": CachePool(1 << 20)}
    servers = {c: start_pool_server(p, PoolIdentity(f"pool-{c}", c), "127.0.0.1", 0) for c, p in pools.items()}
    pools["prfaas"].put(MODEL, source_blocks)
    pools["local"].put(MODEL, target_blocks)
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

    try:
        asyncio.run(main())
    finally:
        for server in servers.values():
            server.stop(0)
    return pools, copied, failed


PROMPT = hashes(prompt(8))


def test_only_the_missing_blocks_and_the_last_state_cross():
    source = blocks(FULL.group_id, PROMPT[:6]) + blocks(LINEAR.group_id, [PROMPT[2], PROMPT[5]])
    target = blocks(FULL.group_id, PROMPT[:2]) + blocks(LINEAR.group_id, [PROMPT[1]])
    pools, copied, failed = _run(source, target, prefix_blocks=6)
    assert failed == []
    # blocks 2..5 of the attention group and the state at block 5: 5 blocks of 100 bytes
    assert copied == [("prfaas", "local", 5, 500)]
    assert pools["local"].lookup(query(PROMPT)).num_usable_blocks == 6
    assert not pools["local"].contains((MODEL, LINEAR.group_id, PROMPT[2]))  # no state that is not at the end
    assert pools["local"].get(MODEL, [(FULL.group_id, PROMPT[4])]) == blocks(FULL.group_id, [PROMPT[4]])


def test_a_target_that_holds_the_prefix_copies_nothing():
    source = blocks(FULL.group_id, PROMPT[:4]) + blocks(LINEAR.group_id, [PROMPT[3]])
    pools, copied, failed = _run(source, source, prefix_blocks=4)
    assert (copied, failed) == ([("prfaas", "local", 0, 0)], [])


def test_a_source_missing_blocks_or_an_unreachable_pool_fails_the_transfer_only():
    target = blocks(FULL.group_id, PROMPT[:1])
    pools, copied, failed = _run(blocks(FULL.group_id, PROMPT[:3]), target, prefix_blocks=3)  # no state: NOT_FOUND
    assert (copied, failed) == ([], [("prfaas", "local")])
    assert pools["local"].lookup(query(PROMPT)).num_full_attention_blocks == 1  # nothing half-copied
    dead = {"prfaas": f"127.0.0.1:{free_port()}", "local": f"127.0.0.1:{free_port()}"}
    _, copied, failed = _run([], [], prefix_blocks=3, addresses=dead)
    assert (copied, failed) == ([], [("prfaas", "local")])
