"""Prefix affinity shared and exact: a worker keeps what its engine's prefix cache holds from vLLM's
own KV-cache event types (renamed to the project's chained hashes), streams it over its authenticated
gRPC (snapshot, then deltas), and every router's copy answers a prompt's cached prefix per worker."""
import asyncio

import grpc
import pytest
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from services.cache_pool_client.hashing import vllm_block_hashes
from services.config import parse_config
from services.decode_worker.server import DecodeWorkerServicer
from services.engine.prefix_events import PrefixCacheIndex
from services.engine.serve import CallerGuard
from services.router.metrics import RouterMetrics
from services.router.prefix_index import PrefixIndex, PrefixWatch
from services.router.workers import WorkerPool
from services.security import GrpcSecurity, Rejections
from services.worker_api.types import PrefixUpdate

SIZE = 4
PROMPT = list(range(100, 112))  # three full blocks


def stored(engine_hashes, parent, tokens):
    return BlockStored(block_hashes=engine_hashes, parent_block_hash=parent, token_ids=tokens, block_size=SIZE,
                       lora_id=None, medium="CPU", lora_name=None)


def test_stored_blocks_get_the_routers_chain_whatever_the_engine_hashes_are():
    index = PrefixCacheIndex()
    index.apply([stored([b"e1", b"e2"], None, PROMPT[:8]), stored([b"e3"], b"e2", PROMPT[8:12]),
                 stored([b"x9"], b"unknown-parent", [1, 2, 3, 4])])   # a parent never seen: skipped
    _, snapshot = index.subscribe()
    assert set(snapshot[0].stored) == set(vllm_block_hashes(PROMPT, SIZE)) and snapshot[0].reset
    index.apply([BlockRemoved(block_hashes=[b"e3"], medium="CPU")])
    assert index.num_blocks == 2
    index.apply([AllBlocksCleared()])
    assert index.num_blocks == 0


def test_a_subscriber_gets_the_snapshot_then_the_deltas_and_falls_out_when_too_slow(monkeypatch):
    index = PrefixCacheIndex()
    index.apply([stored([b"e1"], None, PROMPT[:4])])
    subscriber, snapshot = index.subscribe()
    index.apply([stored([b"e2"], b"e1", PROMPT[4:8]), BlockRemoved(block_hashes=[b"e1"], medium="CPU")])
    deltas = [subscriber.updates.get_nowait() for _ in range(2)]
    hashes = vllm_block_hashes(PROMPT, SIZE)
    assert [u.stored for u in snapshot] == [(hashes[0],)]
    assert deltas == [PrefixUpdate(block_size=SIZE, stored=(hashes[1],)), PrefixUpdate(block_size=SIZE,
                                                                                      removed=(hashes[0],))]
    monkeypatch.setattr(subscriber.updates, "_maxsize", 1)
    index.apply([stored([b"e3"], b"e2", PROMPT[8:12]), BlockRemoved(block_hashes=[b"e3"], medium="CPU")])
    assert subscriber.overflowed


@pytest.mark.parametrize("updates, expected", [
    ([PrefixUpdate(True, SIZE, tuple(vllm_block_hashes(PROMPT, SIZE)[:2]))], {"w": 8}),
    ([PrefixUpdate(True, SIZE, tuple(vllm_block_hashes(PROMPT, SIZE)[1:]))], {"w": 0}),  # not a prefix
    ([PrefixUpdate(True, SIZE, tuple(vllm_block_hashes(PROMPT, SIZE))),
      PrefixUpdate(False, SIZE, (), tuple(vllm_block_hashes(PROMPT, SIZE)[1:2]))], {"w": 4}),
    ([], {}),                                                                             # no stream: unknown
])
def test_a_routers_copy_answers_the_cached_prefix_per_worker(updates, expected):
    index = PrefixIndex()
    for update in updates:
        index.apply("w", update)
    assert index.cached_tokens(["w"], PROMPT + [1]) == expected


def test_a_routers_copy_is_bounded_and_reported():
    metrics = RouterMetrics()
    index = PrefixIndex(metrics, max_blocks_per_worker=2)
    index.apply("w", PrefixUpdate(True, SIZE, tuple(vllm_block_hashes(PROMPT, SIZE))))
    assert metrics.prefix_index_blocks.labels("w")._value.get() == 2
    assert metrics.prefix_index_bytes._value.get() > 0


def test_two_routers_get_the_same_prefixes_over_the_workers_authenticated_stream():
    token = "t0ken"

    async def main():
        security = GrpcSecurity(token=token, accepted_tokens=(token,))
        rejections = Rejections("w")
        cache = PrefixCacheIndex()
        cache.apply([stored([b"e1"], None, PROMPT[:4])])
        guard = CallerGuard(kv_targets=None, rejections=rejections, prefix_cache=cache)
        server = grpc.aio.server(options=security.options, interceptors=security.aio_interceptors(rejections))
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(None, None, guard), server)
        port = security.add_port(server, "127.0.0.1:0")
        await server.start()
        config = parse_config({"model": {"name": "m", "path": "/m"},
                               "workers": [{"name": "w", "service": "decode_worker", "port": port}]})
        routers = []
        try:
            for _ in range(2):
                pool = WorkerPool(config.workers, config.router, RouterMetrics(), security=security)
                index = PrefixIndex()
                watch = PrefixWatch(pool, index, retry_s=0.1)
                watch.start()
                routers.append((pool, index, watch))
            await asyncio.sleep(0.3)  # the snapshots
            cache.apply([stored([b"e2", b"e3"], b"e1", PROMPT[4:12])])
            await asyncio.sleep(0.3)  # the deltas
            seen = [index.cached_tokens(["w"], PROMPT) for _, index, _ in routers]
            async with GrpcSecurity().aio_channel(f"127.0.0.1:{port}") as channel:  # no token
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in pb_grpc.DecodeWorkerStub(channel).WatchPrefixCache(pb.WatchPrefixCacheRequest()):
                        pass
            return seen, refused.value.code()
        finally:
            for pool, _, watch in routers:
                await watch.close()
                await pool.close()
            await server.stop(0)
    seen, refused = asyncio.run(main())
    assert seen == [{"w": 12}, {"w": 12}]
    assert refused == grpc.StatusCode.UNAUTHENTICATED


def test_the_worker_reads_what_vllms_own_publisher_sends_on_its_ipc_socket(tmp_path):
    """vLLM's ZMQ publisher, made by vLLM's factory from the config the worker gives its engine
    (services/engine/args.py), and the worker's reader (follow_engine_events), in one process."""
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    from services.config import parse_config as parse
    from services.engine.args import engine_args
    from services.engine.prefix_events import follow_engine_events

    endpoint = f"ipc://{tmp_path}/kv-events"
    config = parse({"model": {"name": "m", "path": str(tmp_path)}, "workers": [{"name": "w", "port": 1}]})
    args = engine_args(config.model, config.engine, kv_events_endpoint=endpoint)
    publisher = EventPublisherFactory.create(args.kv_events_config)

    async def main():
        index = PrefixCacheIndex()
        reader = asyncio.create_task(follow_engine_events(index, endpoint))
        try:
            for _ in range(50):  # the subscription takes a moment to reach the publisher
                publisher.publish(KVEventBatch(ts=0.0, events=[stored([b"e1", b"e2"], None, PROMPT[:8])]))
                await asyncio.sleep(0.05)
                if index.num_blocks:
                    break
            _, snapshot = index.subscribe()
            return snapshot[0].stored
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
    try:
        assert set(asyncio.run(main())) == set(vllm_block_hashes(PROMPT, SIZE)[:2])
    finally:
        publisher.shutdown()
