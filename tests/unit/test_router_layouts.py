"""Layout negotiation on the router: pair verdicts from announced specs, cached by their bytes, logged
once, exported as gauges, listed in /health, and no prefill routed across an unmappable pair."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from services.config import parse_config
from services.worker_api.types import WorkerStats
from services.kv_connector.layouts import mapping as layout_map
from services.kv_connector.layouts.spec import CPU_AMX, CPU_K_TRANSPOSED, TOKEN_ROWS
from services.router import layouts
from services.router.app import RouterApp
from services.router.layouts import Announcement, LayoutNegotiation, PairVerdict, judge, judge_layouts
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerPool
from support.layouts import gdn_model

BF16 = gdn_model(1).to_bytes()
FP32 = gdn_model(1, dtype="float32").to_bytes()
CPU_16 = gdn_model(1, cache_layout=CPU_K_TRANSPOSED).to_bytes()
AMX_32 = gdn_model(1, block_size=32, cache_layout=CPU_AMX, head_size=64).to_bytes()
WORKERS = [
    {"name": "d", "service": "decode_worker", "role": "both", "port": 50101, "kv_port": 50102},
    {"name": "p1", "service": "prefill_worker", "cluster": "prfaas", "port": 50103},
    {"name": "p2", "service": "prefill_worker", "cluster": "prfaas", "port": 50104},
]


@pytest.mark.parametrize("producer, consumer, verdict, reason", [
    (BF16, BF16, "mappable", ""),
    (FP32, BF16, "unmappable", "different KV dtypes: producer float32, consumer bfloat16"),
    (gdn_model(1, model="other").to_bytes(), BF16, "unmappable", "different models: producer 'other'"),
    (BF16, gdn_model(2).to_bytes(), "unmappable",
     "TP 1 -> 2 needs head slicing, which needs both attention caches in layouts this connector maps"),
    (BF16, gdn_model(1, block_size=32).to_bytes(), "unmappable",
     "block sizes [16, 16, 16, 16] -> [32, 32, 32, 32] need re-blocking, which needs both attention caches in "
     "layouts this connector maps (announced: unknown (none announced) -> unknown (none announced))"),
    (gdn_model(1, cache_layout=TOKEN_ROWS).to_bytes(), gdn_model(2, cache_layout=TOKEN_ROWS).to_bytes(),
     "mappable", ""),
    (gdn_model(1, cache_layout=TOKEN_ROWS).to_bytes(), gdn_model(2, cache_layout=CPU_K_TRANSPOSED).to_bytes(),
     "mappable", ""),  # converted on the consumer
    # vLLM's amx kernel (Intel hosts with AMX) and its vec kernels (other x86 hosts): converted, also at equal
    # TP and block sizes, where pages must not be copied as they are
    (AMX_32, gdn_model(1, block_size=32, cache_layout=CPU_K_TRANSPOSED, head_size=64).to_bytes(), "mappable", ""),
    (AMX_32, gdn_model(2, block_size=64, cache_layout=CPU_K_TRANSPOSED, head_size=64).to_bytes(), "mappable", ""),
    (gdn_model(2, block_size=16, cache_layout=CPU_K_TRANSPOSED, head_size=64).to_bytes(), AMX_32, "mappable", ""),
    (AMX_32, gdn_model(2, block_size=32, cache_layout=CPU_AMX, head_size=64).to_bytes(), "mappable", ""),
    (AMX_32, gdn_model(1, block_size=48, cache_layout=CPU_K_TRANSPOSED, head_size=64).to_bytes(), "mappable", ""),
    (AMX_32, gdn_model(1, block_size=40, cache_layout=CPU_K_TRANSPOSED, head_size=64).to_bytes(), "unmappable",
     "block sizes [32, 32, 32, 32] -> [40, 40, 40, 40] need re-blocking, which needs block sizes that move whole "
     "groups of 16 tokens, not [(32, 40)] (announced: cpu-amx (vLLM's CPU amx kernel) -> cpu-k-transposed "
     "(vLLM's CPU vec and vec16 kernels))"),
    (AMX_32, gdn_model(1, block_size=32, cache_layout="cpu-neon", head_size=64).to_bytes(), "unmappable",
     "the attention caches' layouts differ and need converting, which needs both attention caches in layouts this "
     "connector maps (announced: cpu-amx (vLLM's CPU amx kernel) -> cpu-neon (vLLM's CPU neon kernel, not mapped "
     "here))"),
    (gdn_model(1, cache_layout="cpu-neon").to_bytes(), gdn_model(2, cache_layout="cpu-neon").to_bytes(),
     "unmappable", "TP 1 -> 2 needs head slicing, which needs both attention caches in layouts this connector maps "
     "(announced: cpu-neon (vLLM's CPU neon kernel, not mapped here) -> cpu-neon"),
    (gdn_model(1, cache_layout="cpu-neon").to_bytes(), gdn_model(1, cache_layout="cpu-neon").to_bytes(),
     "mappable", ""),  # one kernel on both sides: pages as they are
    (CPU_16, gdn_model(1, block_size=32, cache_layout=CPU_K_TRANSPOSED).to_bytes(), "mappable", ""),
    (CPU_16, gdn_model(2, cache_layout=CPU_K_TRANSPOSED).to_bytes(), "mappable", ""),
    (gdn_model(2, cache_layout=CPU_K_TRANSPOSED).to_bytes(), CPU_16, "mappable", ""),
    (CPU_16, gdn_model(4, cache_layout=CPU_K_TRANSPOSED).to_bytes(), "mappable", ""),  # replicates KV heads
    (b"", BF16, "unknown", "the prefill worker announces no layout"),
    (BF16, b"", "unknown", "the decode worker announces no layout"),
    (BF16, b'{"version": 99}', "unknown", "the decode worker's layout is unreadable here: layout spec version 99"),
])
def test_judge(producer, consumer, verdict, reason):
    got_verdict, got_reason = judge(Announcement(producer, 3), Announcement(consumer, 3))
    assert got_verdict == verdict and reason in got_reason


@pytest.mark.parametrize("versions, verdict", [((3, 3), "mappable"), ((2, 3), "unmappable"),
                                               ((3, 4), "unmappable"), ((0, 3), "mappable"), ((3, 0), "mappable")])
def test_workers_that_speak_different_kv_protocols_do_not_pair(versions, verdict):
    # A rolling upgrade: the decode worker would refuse the prefill worker's handshake, and wait for
    # KV that never comes until transport.recv_first_frame_timeout_s. 0: an older worker, allowed.
    got_verdict, reason = judge(Announcement(BF16, versions[0]), Announcement(BF16, versions[1]))
    assert got_verdict == verdict
    if verdict == "unmappable":
        assert reason == (f"the prefill worker speaks KV protocol version {versions[0]}, the decode worker "
                          f"{versions[1]} (upgrade both)")


def announced(**specs: bytes) -> dict[str, Announcement]:
    return {name: Announcement(spec, 3) for name, spec in specs.items()}


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_pair_is_mapped_once_per_change_of_either_announcement(monkeypatch):
    calls = []

    def counting(producers, consumers):
        calls.append((producers[0].dtype, consumers[0].dtype))
        return layout_map.plan_mapping(producers, consumers)

    monkeypatch.setattr(layouts, "plan_mapping", counting)
    judge_layouts.cache_clear()
    negotiation = LayoutNegotiation(RouterMetrics())
    for _ in range(3):
        negotiation.update(announced(p1=FP32, p2=FP32, p3=BF16), announced(d1=BF16, d2=BF16))
    assert sorted(calls) == [("bfloat16", "bfloat16"), ("float32", "bfloat16")]
    negotiation.update(announced(p1=BF16), announced(d1=FP32))
    assert len(calls) == 3


def test_an_unmappable_pair_is_logged_once_counted_and_refused(caplog):
    metrics = RouterMetrics()
    negotiation = LayoutNegotiation(metrics)
    with caplog.at_level(logging.INFO, logger="services.router.layouts"):
        for _ in range(3):
            negotiation.update(announced(p1=FP32, p2=BF16), announced(d=BF16))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["KV layouts of prefill worker p1 and decode worker d do not map: different KV dtypes: "
                        "producer float32, consumer bfloat16; no KV goes from one to the other (their prompts "
                        "prefill elsewhere)"]
    assert negotiation.refused("p1") == {"d"} and negotiation.refused("p2") == frozenset()
    assert value(metrics, "prfaas_router_layout_unmappable_pairs") == 1
    assert value(metrics, "prfaas_router_layout_pair_unmappable", prefill="p1", decode="d") == 1
    assert value(metrics, "prfaas_router_layout_pair_unmappable", prefill="p2", decode="d") == 0

    negotiation.update(announced(p2=BF16), announced(d=BF16))  # p1 unreachable: its verdict stands
    assert negotiation.refused("p1") == {"d"}
    negotiation.update(announced(p1=BF16), announced(d=BF16))  # restarted with the decode worker's layout
    assert negotiation.refused("p1") == frozenset()
    assert value(metrics, "prfaas_router_layout_unmappable_pairs") == 0
    assert value(metrics, "prfaas_router_layout_pair_unmappable", prefill="p1", decode="d") == 0
    assert negotiation.pairs == (PairVerdict("p1", "d", "mappable"), PairVerdict("p2", "d", "mappable"))


def test_an_unknown_pair_is_allowed_and_logged_once(caplog):
    negotiation = LayoutNegotiation(RouterMetrics())
    with caplog.at_level(logging.INFO, logger="services.router.layouts"):
        negotiation.update(announced(p1=b""), announced(d=BF16))
        negotiation.update(announced(p1=b""), announced(d=BF16))
    assert len(caplog.records) == 1 and "unknown (the prefill worker announces no layout)" in caplog.text
    assert negotiation.refused("p1") == frozenset()


def run_with_pool(body):
    async def main():
        config = parse_config({"workers": WORKERS})
        metrics = RouterMetrics()
        pool = WorkerPool(config.workers, config.router, metrics)
        for handle in pool.handles:
            handle.healthy = True
        try:
            return await body(pool, metrics)
        finally:
            await pool.close()
    return asyncio.run(main())


@pytest.mark.parametrize("announced, path, prefill", [
    ({"d": BF16, "p1": BF16, "p2": BF16}, "prfaas", "p1"),
    ({"d": BF16, "p1": FP32, "p2": BF16}, "prfaas", "p2"),
    ({"d": BF16, "p1": FP32, "p2": FP32}, "local", None),
    ({"d": BF16, "p1": b"", "p2": FP32}, "prfaas", "p1"),   # unknown: allowed
])
def test_the_pool_routes_no_prefill_across_an_unmappable_pair(announced, path, prefill):
    async def body(pool, metrics):
        for handle in pool.handles:
            handle.stats = WorkerStats(layout_spec=announced[handle.name])
        pool.negotiate_layouts()
        return pool.route(5000, threshold_tokens=1000)
    route = run_with_pool(body)
    assert (route.path, route.decode, route.prefill) == (path, "d", prefill)


def test_the_pool_routes_no_prefill_to_a_worker_of_another_kv_protocol():
    async def body(pool, metrics):
        versions = {"d": 3, "p1": 2, "p2": 3}
        for handle in pool.handles:
            handle.stats = WorkerStats(layout_spec=BF16, kv_protocol_version=versions[handle.name])
        pool.negotiate_layouts()
        routes = [pool.route(5000, threshold_tokens=1000) for _ in range(4)]
        pool.handle("p2").healthy = False
        return routes, pool.route(5000, threshold_tokens=1000)
    routes, alone = run_with_pool(body)
    assert {(r.path, r.prefill) for r in routes} == {("prfaas", "p2")}
    assert alone.path == "local"


def test_health_lists_every_pair_with_its_verdict():
    async def body(pool, metrics):
        for handle in pool.handles:
            handle.stats = WorkerStats(layout_spec=FP32 if handle.name == "p1" else BF16)
        pool.negotiate_layouts()
        app = RouterApp(model_name="m", max_model_len=2048, api_keys=frozenset(), tokenizer=None, pool=pool,
                        dispatcher=None, metrics=metrics)
        return json.loads((await app.health(None)).body)
    health = run_with_pool(body)
    assert health["layouts"] == [
        {"prefill": "p1", "decode": "d", "verdict": "unmappable",
         "reason": "different KV dtypes: producer float32, consumer bfloat16"},
        {"prefill": "p2", "decode": "d", "verdict": "mappable", "reason": ""}]
