"""Pool keys carry the engine's KV layout: engines whose blocks differ (block size, dtype, heads,
layers) share a pool without ever reading each other's entries; the router, which knows only the
model's name, still finds what the engines stored."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool.pool import CachePool
from services.cache_pool_client.types import Block, GroupKind, KvCacheGroup, LookupQuery, layout_key, model_name
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.pool.io import PoolIO
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.settings import pool_model

NUM_BLOCKS = 8
BLOCK = 4
DENSE = (KvCacheGroup(0, GroupKind.FULL_ATTENTION),)


def _config(block_size: int = BLOCK, dtype: torch.dtype = torch.bfloat16, num_kv_heads: int = 2,
            layers: tuple[str, ...] = ("l1", "l2")):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=4, dtype=dtype)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[SimpleNamespace(layer_names=list(layers),
                                                                                   kv_cache_spec=spec)])


@pytest.mark.parametrize("other, same", [
    ({}, True),
    ({"block_size": 2 * BLOCK}, False),
    ({"dtype": torch.float16}, False),
    ({"num_kv_heads": 4}, False),
    ({"layers": ("l1",)}, False),
])
def test_the_pool_key_names_the_model_and_its_kv_layout(other, same):
    ours, theirs = pool_model("tiny", _config()), pool_model("tiny", _config(**other))
    assert (ours.model == theirs.model) is same
    assert model_name(ours.model) == model_name(theirs.model) == "tiny"


def _worker(io, dtype: torch.dtype, seed: int) -> PoolWorker:
    config = _config(dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 8, generator=generator).to(dtype) for name in ("l1", "l2")}
    worker = PoolWorker(io, pool_model("tiny", config))
    worker.register_kv_caches(KVLayout(config, caches), Device("cpu"))
    return worker


def _store(worker: PoolWorker, hashes: tuple[bytes, ...]) -> None:
    worker.on_metadata(PrfaasConnectorMetadata(pool_stores=[PoolStoreSpec(
        "store", ((1, 2),), tuple(enumerate(hashes)), None, len(hashes) * BLOCK)]))
    worker.store()
    _wait(lambda: worker.counters().tokens_stored + worker.counters().stores_failed > 0)


def _load(worker: PoolWorker, hashes: tuple[bytes, ...]) -> bool:
    """Loads the prompt's blocks into ids 5 and 6 (zeroed first); True when the load succeeded."""
    for tensor in worker.layout.caches.values():
        tensor[5:7] = 0
    worker.on_metadata(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec("load", ((5, 6),), hashes, 0)]))
    finished = set()
    while not finished:
        done, failed = worker.finished_loads()
        finished = done | failed
        time.sleep(0.01)
    return not failed


def test_workers_with_different_layouts_never_share_entries_in_one_pool(pool_server):
    pool = CachePool(1 << 20)
    io = PoolIO(f"127.0.0.1:{pool_server(pool, name='pool-local').port}", lookup_timeout_s=2.0)
    try:
        bf16, fp16 = _worker(io, torch.bfloat16, seed=0), _worker(io, torch.float16, seed=1)
        hashes = tuple(prompt_block_hashes(list(range(2 * BLOCK)), BLOCK))
        _store(bf16, hashes)
        # same model, same prompt, same block bytes per block: only the layout differs
        assert io.start_lookup(fp16.model.query(hashes)).result(5).num_usable_blocks == 0
        assert io.start_lookup(bf16.model.query(hashes)).result(5).num_usable_blocks == 2
        assert not _load(fp16, hashes)
        _store(fp16, hashes)
        assert pool.stats.memory_blocks == 4  # two entries per layout, none shared
        for worker in (bf16, fp16):
            assert _load(worker, hashes)
            for tensor in worker.layout.caches.values():
                assert torch.equal(tensor[5:7], tensor[1:3])  # its own bytes, never the other's
    finally:
        io.close()


def _query(model: str, hashes) -> LookupQuery:
    return LookupQuery(model, BLOCK, tuple(hashes), DENSE)


@pytest.mark.parametrize("stored, asked, expected_blocks, expected_model", [
    ({"a": 3}, "tiny", 3, "a"),                   # the router's bare name finds the one layout
    ({"a": 1, "b": 3}, "tiny", 3, "b"),           # several: the best one, named
    ({"a": 3}, "a", 3, "a"),                      # an engine's key matches itself
    ({"a": 3}, "b", 0, "b"),                      # ... and never another layout
    ({}, "tiny", 0, "tiny"),
])
def test_a_lookup_under_the_bare_model_name_resolves_to_a_stored_layout(stored, asked, expected_blocks,
                                                                           expected_model):
    pool = CachePool(1 << 20)
    hashes = prompt_block_hashes(list(range(4 * BLOCK)), BLOCK)
    key = {"tiny": "tiny", "a": layout_key("tiny", "a"), "b": layout_key("tiny", "b")}
    for layout, num_blocks in stored.items():
        pool.put(key[layout], [Block(0, h, b"x") for h in hashes[:num_blocks]])
    result = pool.lookup(_query(key[asked], hashes))
    assert (result.num_usable_blocks, result.model) == (expected_blocks, key[expected_model])


def _wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
