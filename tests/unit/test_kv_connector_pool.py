"""The connector's cache-pool integration, one layer at a time.

The scheduler side (``PoolPlanner``, through ``PrfaasConnectorScheduler``) and the worker side
(``PoolWorker`` over a real ``KVLayout`` of small tensors) run against a fake pool I/O backed by a
plain ``CachePool``; ``PoolIO`` itself against an in-process pool server. Real engines:
tests/e2e/test_cache_pool_reuse.py.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool.pool import CachePool
from services.cache_pool.slots import Arena
from services.cache_pool_client.types import Block, BlockMissingError, GroupKind, KvCacheGroup, LookupResult, Pieces
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.pages import KVLayout, state_block_at
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.params import consume
from services.kv_connector.pool.io import PoolIO, PoolModel
from services.kv_connector.pool.planner import PoolPlanner
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.scheduler import PrfaasConnectorScheduler
from services.kv_connector.snapshot import PoolCounters
from support.sync_recorder import mark_caches, recording_syncs

BLOCK = 4
NUM_BLOCKS = 16
HYBRID = PoolModel("tiny/1", BLOCK, (KvCacheGroup(0, GroupKind.LINEAR_ATTENTION),
                                     KvCacheGroup(1, GroupKind.FULL_ATTENTION)))


def _done(value=None, exc: Exception | None = None) -> Future:
    future = Future()
    future.set_exception(exc) if exc else future.set_result(value)
    return future


class _FakeIO:
    """PoolIO's interface over an in-memory CachePool; lookups are answered when the test says."""

    lookup_timeout_s = 0.05

    def __init__(self) -> None:
        self.pool = CachePool(64 << 20)
        self.lookups: list = []
        self.get_error: Exception | None = None

    def start_lookup(self, query) -> Future:
        future = Future()
        self.lookups.append((query, future))
        return future

    def answer_lookups(self) -> None:
        for query, future in self.lookups:
            future.set_result(self.pool.lookup(query))

    def start_get(self, model, refs) -> Future:
        if self.get_error:
            return _done(exc=self.get_error)
        try:
            return _done(self.pool.get(model, refs))
        except BlockMissingError as exc:
            return _done(exc=exc)

    def start_put(self, model, make_blocks) -> Future:
        return _done(self.pool.put(model, make_blocks()))


# Scheduler side -------------------------------------------------------------------------------

def _request(req_id: str, num_tokens: int, seed: int = 0, kv_transfer_params=None):
    tokens = [(seed * 1000 + i) % 997 for i in range(num_tokens)]
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=num_tokens,
                           kv_transfer_params=kv_transfer_params)


def _step(new=(), cached=(), scheduled=None):
    """``new``: (req_id, block_ids, num_computed); ``cached``: (req_id, new_block_ids, num_computed)."""
    return SimpleNamespace(
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[b for _, b, _ in cached],
                                              num_computed_tokens=[n for _, _, n in cached], resumed_req_ids=set()))


@pytest.fixture
def io():
    return _FakeIO()


@pytest.fixture
def scheduler(io):
    return PrfaasConnectorScheduler(PoolPlanner(io, HYBRID))


def _store_everything(io, tokens: list[int], num_blocks: int) -> None:
    hashes = prompt_block_hashes(tokens, BLOCK)[:num_blocks]
    io.pool.put(HYBRID.model, [Block(g, h, b"x") for h in hashes for g in (0, 1)])


def test_a_request_waits_for_its_lookup_then_loads_what_the_engine_lacks(scheduler, io):
    request = _request("r1", 4 * BLOCK + 2)
    _store_everything(io, request.prompt_token_ids, 3)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    io.answer_lookups()
    assert scheduler.get_num_new_matched_tokens(request, BLOCK) == (2 * BLOCK, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3, 4, 5])),
                                       2 * BLOCK)
    meta = scheduler.build_connector_meta(_step())
    [load] = meta.pool_loads
    assert (load.req_id, load.first_block, load.num_blocks, load.block_ids) == ("r1", 1, 2, ((9,), (1, 2, 3, 4, 5)))
    assert list(load.block_hashes) == prompt_block_hashes(request.prompt_token_ids, BLOCK)[:3]


@pytest.mark.parametrize("num_tokens, stored_blocks, expected_blocks", [
    (4 * BLOCK, 4, 3),       # a whole-prompt hit leaves the last token to compute: one block less
    (4 * BLOCK + 1, 4, 4),   # N-1 tokens are exactly four blocks
    (3 * BLOCK + 2, 1, 1),
])
def test_at_most_n_minus_one_prompt_tokens_are_looked_up(scheduler, io, num_tokens, stored_blocks, expected_blocks):
    request = _request("r1", num_tokens)
    _store_everything(io, request.prompt_token_ids, stored_blocks)
    scheduler.on_new_request(request)
    io.answer_lookups()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (expected_blocks * BLOCK, True)


def test_a_lookup_that_fails_or_times_out_is_a_miss(io):
    clock = [100.0]
    scheduler = PrfaasConnectorScheduler(PoolPlanner(io, HYBRID, clock=lambda: clock[0]))
    failed, slow = _request("r1", 3 * BLOCK), _request("r2", 3 * BLOCK, seed=1)
    scheduler.on_new_request(failed)
    scheduler.on_new_request(slow)
    io.lookups[0][1].set_exception(ConnectionError("pool down"))
    assert scheduler.get_num_new_matched_tokens(failed, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(slow, 0) == (None, False)
    clock[0] += 1.0
    assert scheduler.get_num_new_matched_tokens(slow, 0) == (0, False)


def test_after_a_failed_load_the_request_recomputes_and_stores_again(scheduler, io):
    request = _request("r1", 3 * BLOCK + 1)
    _store_everything(io, request.prompt_token_ids, 3)
    scheduler.on_new_request(request)
    io.answer_lookups()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3, 4])), 3 * BLOCK)
    scheduler.build_connector_meta(_step())
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, failed_recving={"r1"}))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = scheduler.build_connector_meta(_step(new=[("r1", ([9], [1, 2, 3, 4]), 0)], scheduled={"r1": 3 * BLOCK + 1}))
    assert [i for i, _ in meta.pool_stores[0].blocks] == [0, 1, 2]


def test_each_step_stores_the_blocks_it_completed_and_states_on_block_boundaries(scheduler, io):
    request = _request("r1", 3 * BLOCK + 2)
    hashes = prompt_block_hashes(request.prompt_token_ids, BLOCK)
    scheduler.on_new_request(request)
    io.answer_lookups()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    first = scheduler.build_connector_meta(_step(new=[("r1", ([7], [1, 2]), 0)], scheduled={"r1": 6}))
    second = scheduler.build_connector_meta(_step(cached=[("r1", ([], [3, 4]), 6)], scheduled={"r1": 6}))
    third = scheduler.build_connector_meta(_step(cached=[("r1", None, 12)], scheduled={"r1": 2}))
    decode = scheduler.build_connector_meta(_step(cached=[("r1", None, 14)], scheduled={"r1": 1}))
    assert first.pool_stores == [PoolStoreSpec("r1", ((7,), (1, 2)), ((0, hashes[0]),), None, 6)]
    assert second.pool_stores == [PoolStoreSpec("r1", ((7,), (1, 2, 3, 4)), ((1, hashes[1]), (2, hashes[2])),
                                                hashes[2], 12)]
    assert third.pool_stores == decode.pool_stores == []


@pytest.mark.parametrize("num_tokens", [3 * BLOCK, 3 * BLOCK + 1])
def test_consumers_of_a_kv_stream_look_nothing_up_and_store_what_they_received(scheduler, io, num_tokens):
    """Blocks [0, N-1) came over the transport; the first step computes token N-1 and completes them."""
    request = _request("r1", num_tokens, kv_transfer_params=consume("t1").to_extra_args()["kv_transfer_params"])
    hashes = prompt_block_hashes(request.prompt_token_ids, BLOCK)
    scheduler.on_new_request(request)
    assert io.lookups == []
    assert scheduler.get_num_new_matched_tokens(request, 0) == (num_tokens - 1, True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3, 4])),
                                       num_tokens - 1)
    first = scheduler.build_connector_meta(_step(new=[("r1", ([9], [1, 2, 3, 4]), num_tokens - 1)],
                                                 scheduled={"r1": 1}))
    decode = scheduler.build_connector_meta(_step(cached=[("r1", None, num_tokens)], scheduled={"r1": 1}))
    state = hashes[2] if num_tokens % BLOCK == 0 else None
    assert first.pool_stores == [PoolStoreSpec("r1", ((9,), (1, 2, 3, 4)), tuple(enumerate(hashes[:3])), state,
                                               num_tokens)]
    assert decode.pool_stores == [] and first.pool_loads == []


def test_an_aborted_load_is_abandoned_once(scheduler, io):
    request = _request("r1", 3 * BLOCK + 1)
    _store_everything(io, request.prompt_token_ids, 2)
    scheduler.on_new_request(request)
    io.answer_lookups()
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3, 4])), 2 * BLOCK)
    scheduler.build_connector_meta(_step())
    scheduler.request_finished(request)
    assert scheduler.build_connector_meta(_step()).pool_abandoned == ["r1"]
    assert scheduler.build_connector_meta(_step()).pool_abandoned == []


# Worker side ----------------------------------------------------------------------------------

def _layout(fill: bool, state_block_size: int = 64) -> KVLayout:
    """Group 0: a recurrent state (one layer); group 1: full attention (two layers). A state block
    size of ``BLOCK``: vLLM's Mamba ``align`` mode (prefix caching on)."""
    state = SimpleNamespace(block_size=state_block_size)
    attention = SimpleNamespace(block_size=BLOCK, num_kv_heads=2)
    config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=["l0"], kv_cache_spec=state),
        SimpleNamespace(layer_names=["l1", "l2"], kv_cache_spec=attention)])
    generator = torch.Generator().manual_seed(0)
    make = (lambda *shape: torch.randn(*shape, generator=generator).to(torch.bfloat16)) if fill else \
        (lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16))
    caches = {"l0": make(NUM_BLOCKS, 1, 1, 16).view(torch.int8), "l1": make(NUM_BLOCKS, 2, BLOCK, 8),
              "l2": make(2, NUM_BLOCKS, BLOCK, 8)}  # l2: blocks on dim 1, as some layouts have
    return KVLayout(config, caches)


def _worker(io, fill: bool, state_block_size: int = 64, device: Device | None = None) -> PoolWorker:
    worker = PoolWorker(io, HYBRID)
    worker.register_kv_caches(_layout(fill, state_block_size), device or Device("cpu"))
    return worker


@pytest.mark.parametrize("block_ids, num_tokens, expected", [
    ((7,), 3 * BLOCK, 7),                 # prefix caching off: the request's one page, wherever it ends
    ((0, 0, 9), 3 * BLOCK, 9),            # align mode, a step that ended on a block boundary
    ((0, 5, 9), 2 * BLOCK, 5),            # align mode: the state at 2 blocks, not the later running page
    ((0, 0, 11, 12), 3 * BLOCK, 11),      # a load of 3 blocks: where vLLM's first step reads the state
    ((0, 0, 9), 2 * BLOCK + 1, 9),        # not on a block boundary: the live page
    ((0, 0, 9), 2 * BLOCK, 9),            # nothing at that position (freed): the live page
    ((0, 0, 0), 3 * BLOCK, 0),            # no page at all
])
def test_the_state_page_of_a_position(block_ids, num_tokens, expected):
    assert state_block_at(block_ids, num_tokens, BLOCK) == expected


def test_align_mode_states_are_stored_and_loaded_at_their_block_positions(io):
    """Prefix caching on: the source's state after 2 blocks is at position 1 (page 5; page 6 already
    holds a later state); the target loads 2 blocks into a table whose running page (12) is after the
    loaded prefix, so the state goes to position 1 (page 11), which vLLM copies on to page 12."""
    source = _worker(io, fill=True, state_block_size=BLOCK)
    target = _worker(io, fill=False, state_block_size=BLOCK)
    hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
    source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
        "a", ((0, 5, 6), (1, 2, 3)), tuple(enumerate(hashes)), hashes[1], 2 * BLOCK)]))
    source.store()
    target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((0, 11, 12), (4, 8, 9)), hashes, 0)]))
    assert target.finished_loads() == ({"b"}, set())
    src, dst = source.layout.caches["l0"], target.layout.caches["l0"]
    assert torch.equal(dst[11], src[5]) and not dst[12].any()
    assert torch.equal(target.layout.caches["l1"][[4, 8]], source.layout.caches["l1"][[1, 2]])


def test_stored_blocks_load_into_other_block_ids_byte_for_byte(io):
    source, target = _worker(io, fill=True), _worker(io, fill=False)
    hashes = tuple(prompt_block_hashes(list(range(3 * BLOCK)), BLOCK))
    source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
        "a", ((5,), (1, 2, 3)), tuple(enumerate(hashes)), hashes[2], 3 * BLOCK)]))
    source.store()
    assert source.counters().tokens_stored == 3 * BLOCK
    target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((0, 11), (4, 8, 9, 10)), hashes, 1)]))
    assert target.finished_loads() == ({"b"}, set())
    _assert_loaded(source, target)
    assert target.counters().tokens_loaded == 2 * BLOCK


@pytest.mark.parametrize("problem", ["missing", "wrong_size", "rpc_error"])
def test_a_failed_load_is_finished_and_failed(io, problem):
    hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
    if problem == "wrong_size":
        io.pool.put(HYBRID.model, [Block(g, h, b"short") for h in hashes for g in (0, 1)])
    if problem == "rpc_error":
        io.get_error = TimeoutError("deadline exceeded")
    worker = _worker(io, fill=False)
    worker.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((3,), (4, 5)), hashes, 0)]))
    assert worker.finished_loads() == ({"b"}, {"b"})
    assert worker.counters().loads_failed == 1 and worker.counters().tokens_loaded == 0
    assert not worker.layout.caches["l1"].any()


def test_an_abandoned_load_is_released_once_and_not_failed(io):
    worker = _worker(io, fill=False)
    pending = Future()
    io.start_get = lambda model, refs: pending
    hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
    worker.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((3,), (4, 5)), hashes, 0)]))
    assert worker.finished_loads() == (set(), set())
    worker.on_metadata(PrfaasConnectorMetadata(pool_abandoned=["b"]))
    assert worker.finished_loads() == ({"b"}, set())
    worker.on_metadata(PrfaasConnectorMetadata(pool_abandoned=["b"]))
    assert worker.finished_loads() == (set(), set())


def test_a_failed_store_is_counted_and_nothing_else(io):
    worker = _worker(io, fill=True)
    io.start_put = lambda model, make_blocks: _done(exc=ConnectionError("pool down"))
    hashes = prompt_block_hashes(list(range(BLOCK)), BLOCK)
    worker.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec("a", ((5,), (1,)), ((0, hashes[0]),),
                                                                          None, BLOCK)]))
    worker.store()
    assert worker.counters() == PoolCounters(stores_failed=1)


# PoolIO against a real pool server ------------------------------------------------------------

def test_pool_io_round_trip_over_grpc(pool_server):
    running = pool_server(name="pool-local")
    io = PoolIO(f"127.0.0.1:{running.port}", lookup_timeout_s=2.0)
    try:
        hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
        blocks = [Block(g, h, bytes([i]) * 8) for i, h in enumerate(hashes) for g in (0, 1)]
        assert io.start_put(HYBRID.model, lambda: blocks).result(5).num_blocks_stored == 4
        assert io.start_lookup(HYBRID.query(hashes)).result(5) == LookupResult(2, 2, BLOCK, HYBRID.model)
        assert io.start_get(HYBRID.model, [(0, hashes[1])]).result(5) == [blocks[2]]
        with pytest.raises(Exception, match="NOT_FOUND|not stored"):
            io.start_get("other-model", [(0, hashes[1])]).result(5)
    finally:
        io.close()


def test_tp_ranks_keep_their_shares_under_keys_of_their_own_and_a_prefix_needs_every_share(pool_server):
    """At TP 2 each rank stores its share of a block under its own key; the engine's lookup asks for
    both ranks' and counts only the prefix that both hold (one rank's share alone is no hit)."""
    model = PoolModel("tiny/1", BLOCK, HYBRID.groups, tp_size=2)
    assert model.key(0) != model.key(1) and model.key(0).startswith(model.model)
    assert PoolModel("tiny/1", BLOCK, HYBRID.groups).key(0) == "tiny/1"  # one rank: the layout key itself
    running = pool_server(name="pool-local")
    io = PoolIO(f"127.0.0.1:{running.port}", lookup_timeout_s=2.0)
    try:
        hashes = tuple(prompt_block_hashes(list(range(3 * BLOCK)), BLOCK))

        def share(rank: int, count: int) -> list[Block]:
            return [Block(g, h, bytes([rank, i]) * 4) for i, h in enumerate(hashes[:count]) for g in (0, 1)]

        io.start_put(model.key(0), lambda: share(0, 3)).result(5)
        assert io.start_lookup(*model.queries(hashes)).result(5).num_usable_blocks == 0
        io.start_put(model.key(1), lambda: share(1, 2)).result(5)
        assert io.start_lookup(*model.queries(hashes)).result(5).num_usable_blocks == 2
        assert io.start_get(model.key(1), [(1, hashes[1])]).result(5) == [share(1, 2)[3]]
        assert io.start_get(model.key(0), [(1, hashes[1])]).result(5) == [share(0, 3)[3]]
    finally:
        io.close()


def test_blocks_go_through_the_pools_arena_straight_from_and_into_the_kv_tensors(pool_server, tmp_path):
    arena = Arena.create(str(tmp_path), "pool-local", 4 << 20)
    pool = CachePool(4 << 20, arena=arena)
    io = PoolIO(f"127.0.0.1:{pool_server(pool, name='pool-local').port}", lookup_timeout_s=2.0)
    try:
        source, target = _worker(io, fill=True), _worker(io, fill=False)
        hashes = tuple(prompt_block_hashes(list(range(3 * BLOCK)), BLOCK))
        source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
            "a", ((5,), (1, 2, 3)), tuple(enumerate(hashes)), hashes[2], 3 * BLOCK)]))
        source.store()
        _wait(lambda: source.counters().tokens_stored == 3 * BLOCK)
        assert pool.stats.memory_blocks == 4 and pool.stats.arena_slots > 0
        target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((0, 11), (4, 8, 9, 10)), hashes, 1)]))
        target.wait_for_loads(5.0)
        assert target.finished_loads() == ({"b"}, set())
        _assert_loaded(source, target)
    finally:
        io.close()


def test_pool_stores_and_loads_never_synchronize_the_engine_thread(pool_server, tmp_path):
    """The CUDA store and load paths on a CPU stand-in that records what would make the engine thread
    wait for the GPU (tests/support/sync_recorder.py): the gathers and copies in are only enqueued,
    the arena is pinned on the pool's I/O thread, and the stored blocks load back exactly."""
    arena = Arena.create(str(tmp_path), "pool-local", 4 << 20)
    pool = CachePool(4 << 20, arena=arena)
    io = PoolIO(f"127.0.0.1:{pool_server(pool, name='pool-local').port}", lookup_timeout_s=2.0)
    try:
        with recording_syncs() as (device_of, recorder):
            source, target = _worker(io, fill=True, device=device_of("cuda")), \
                _worker(io, fill=False, device=device_of("cuda"))
            for worker in (source, target):
                mark_caches(recorder, worker.layout.caches.values())
            hashes = tuple(prompt_block_hashes(list(range(3 * BLOCK)), BLOCK))
            source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
                "a", ((5,), (1, 2, 3)), tuple(enumerate(hashes)), hashes[2], 3 * BLOCK)]))
            source.store()
            _wait(lambda: source.counters().tokens_stored == 3 * BLOCK)
            target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((0, 11), (4, 8, 9, 10)),
                                                                                hashes, 1)]))
            target.wait_for_loads(5.0)
            assert target.finished_loads() == ({"b"}, set())
            calls = list(recorder.calls)
        assert calls == [], "\n".join(calls)
        assert target._arena is not None and target._arena.address == io._client._arena.address
        _assert_loaded(source, target)
    finally:
        io.close()


def test_pieces_of_device_memory_go_straight_into_the_arena(pool_server, tmp_path):
    """The CUDA store path on the CPU stand-in: each block's pieces copy themselves into the arena's
    slots after their gather's event (``DeviceRows``), with no bytes joined on the way."""
    from services.kv_connector.pool.copies import DeviceRows, PinnedRegion
    from services.kv_connector.device.streams import CpuEvent, Device

    device = Device("cpu")
    arena = Arena.create(str(tmp_path), "pool-local", 4 << 20)
    pool = CachePool(4 << 20, arena=arena)
    io = PoolIO(f"127.0.0.1:{pool_server(pool, name='pool-local').port}", lookup_timeout_s=2.0)
    try:
        hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
        layers = [torch.randn(2, 3, 5, dtype=torch.bfloat16), torch.randn(2, 7, dtype=torch.float32)]
        rows = torch.cat([t.reshape(2, -1).view(torch.uint8) for t in layers], dim=1)
        expected = [rows[k].numpy().tobytes() for k in range(2)]
        batch = DeviceRows(rows, CpuEvent(), device)
        blocks = [Block(1, hashes[k], Pieces((batch.row(k),))) for k in range(2)]
        assert [bytes(b.data) for b in blocks] == expected
        assert io.start_put("tiny/1", lambda: blocks).result(5).num_blocks_stored == 2
        assert pool.stats.arena_slots > 0
        got = io.start_get("tiny/1", [(1, hashes[0]), (1, hashes[1])]).result(5)
        assert [bytes(block.data) for block in got] == expected
        block = got[0]
        assert not PinnedRegion(device, block.data.mapping.address, 1 << 20).holds(block.data.mapping.address)
    finally:
        io.close()


def test_a_load_is_reported_only_once_its_copies_completed(io):
    """On CUDA the copies into the blocks run on side streams: the request stays loading until the
    loader says they are done, and one abandoned meanwhile is released behind a fence."""
    source = _worker(io, fill=True)
    hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
    source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
        "a", ((5,), (1, 2)), tuple(enumerate(hashes)), hashes[1], 2 * BLOCK)]))
    source.store()
    for abandon in (False, True):
        target = _worker(io, fill=False)
        running, fences = {"copies": True}, []
        target._loader.busy = lambda key, running=running: running["copies"]
        target._loader.fence = lambda fences=fences: fences.append(True)
        target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((3,), (4, 5)), hashes, 0)]))
        assert target.finished_loads() == (set(), set())
        if abandon:
            target.on_metadata(PrfaasConnectorMetadata(pool_abandoned=["b"]))
            assert fences and target.finished_loads() == ({"b"}, set())
            assert target.counters().tokens_loaded == 0
            continue
        running["copies"] = False
        assert target.finished_loads() == ({"b"}, set())
        assert target.counters().tokens_loaded == 2 * BLOCK and not fences


def test_a_block_evicted_while_being_copied_fails_the_load(io, tmp_path):
    """Blocks that come as views of the pool's arena are checked after their copies: a slot freed
    (and bumped) meanwhile fails the load."""
    import numpy as np

    from services.cache_pool_client.arena import ArenaBlock, ArenaLayout, ArenaMapping
    from services.cache_pool_client.arena_client import ArenaView

    mapping = ArenaMapping.create(str(tmp_path / "arena"), 1 << 20)
    layout = ArenaLayout.of(mapping.token, mapping.size, 4096)
    next_slot = iter(range(layout.num_slots))

    def evicted(data: bytes) -> ArenaView:
        slots = tuple(next(next_slot) for _ in range(layout.slots_for(len(data))))
        block = ArenaBlock(slots, tuple(mapping.generation(s) for s in slots), len(data), layout.slot_bytes)
        mapping.write(layout, block, [np.frombuffer(data, np.uint8)])
        mapping.bump(slots)  # freed and reused after the Get answered
        return ArenaView(mapping, layout, block)

    source, target = _worker(io, fill=True), _worker(io, fill=False)
    hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
    source.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
        "a", ((5,), (1, 2)), tuple(enumerate(hashes)), hashes[1], 2 * BLOCK)]))
    source.store()
    stored = io.start_get
    io.start_get = lambda model, refs: _done([Block(b.group_id, b.block_hash, evicted(bytes(b.data)))
                                              for b in stored(model, refs).result()])
    target.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("b", ((3,), (4, 5)), hashes, 0)]))
    assert target.finished_loads() == ({"b"}, {"b"})
    assert target.counters().loads_failed == 1


def _assert_loaded(source: PoolWorker, target: PoolWorker) -> None:
    """The source's blocks 2, 3 (and state page 5) are the target's 8, 9 (and 11); block 0 was the
    target engine's own, not loaded."""
    src, dst = source.layout.caches, target.layout.caches
    assert torch.equal(dst["l1"][[8, 9]], src["l1"][[2, 3]]) and torch.equal(dst["l2"][:, [8, 9]], src["l2"][:, [2, 3]])
    assert torch.equal(dst["l0"][11], src["l0"][5])
    assert not dst["l1"][4].any()


def _wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_producer_aborted_mid_prompt_ends_its_transfer_and_a_finished_one_does_not(scheduler):
    """The consumer would hold its receive (and the sender its state) until a timeout otherwise."""
    from services.kv_connector.metadata import SendAbort
    from services.kv_connector.params import produce

    def params(transfer):
        return transfer.to_extra_args()["kv_transfer_params"]

    cut = _request("cut", 4 * BLOCK + 1, kv_transfer_params=params(produce("t-cut", "10.0.0.2:7000", 2)))
    whole = _request("whole", BLOCK + 1, seed=1, kv_transfer_params=params(produce("t-whole", "10.0.0.2:7000")))
    for request in (cut, whole):
        request._all_token_ids = list(request.prompt_token_ids)  # as vLLM's Request has them
        scheduler.on_new_request(request)
    scheduler.build_connector_meta(_step(new=[("cut", [[1, 2, 3, 4]], 0), ("whole", [[5]], 0)],
                                         scheduled={"cut": BLOCK, "whole": BLOCK}))
    scheduler.request_finished(cut)    # aborted after its first chunk of four
    scheduler.request_finished(whole)  # its whole prompt was handed on
    meta = scheduler.build_connector_meta(_step())
    assert meta.aborted_sends == [SendAbort("cut", "t-cut", "10.0.0.2:7000", 2)]
    assert scheduler.build_connector_meta(_step()).aborted_sends == []
