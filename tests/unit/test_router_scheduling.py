"""The router's scheduling seams: cache-aware placement with metrics, worker back-off, role flips
and decode-load admission, on a real WorkerPool (channels are never dialled here)."""
import asyncio
import logging

import pytest

from services.cache_pool_client.types import LookupResult
from services.config import parse_config
from services.worker_api.types import GenerateInput, Sampling, WorkerStats
from services.router.admission import AdmissionControl, PrefillQueues
from services.router.dispatch import Dispatcher
from services.router.errors import ApiError
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.leadership import Fixed
from services.router.role_control import RoleControl
from services.router.workers import RoleConflict, WorkerPool
from services.scheduling.backoff import BackoffConfig
from services.scheduling.congestion import FixedThreshold
from services.scheduling.roles import binding_stage
from services.scheduling.offload import CacheTransfer
from support.worker_roles import WorkerRoles

BLOCK = 128
WORKERS = [
    {"name": "d", "service": "decode_worker", "role": "both", "port": 50101, "kv_port": 50102},
    {"name": "p1", "service": "prefill_worker", "cluster": "prfaas", "port": 50103},
    {"name": "p2", "service": "prefill_worker", "cluster": "prfaas", "port": 50104},
]
POOLS = [{"name": "lp", "cluster": "local", "port": 50110}, {"name": "pp", "cluster": "prfaas", "port": 50111}]


class FakeIndex:
    def __init__(self, cached_tokens):
        self.cached_tokens = cached_tokens
        self.queries = []

    async def lookup(self, query):
        self.queries.append(query)
        return {c: LookupResult(n // query.block_size, n // query.block_size, query.block_size)
                for c, n in self.cached_tokens.items()}


class RecordingTransfers:
    def __init__(self):
        self.issued = []

    def issue(self, request_id, transfer, block_hashes):
        self.issued.append((request_id, transfer, len(block_hashes)))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def run_with_pool(raw, body, flippable=False):
    async def main():
        config = parse_config(raw)
        metrics, clock = RouterMetrics(), Clock()
        pool = WorkerPool(config.workers, config.router, metrics, BackoffConfig(1.0, 8.0), flippable=flippable,
                          clock=clock)
        for handle in pool.handles:
            handle.healthy = True
        try:
            return await body(config, pool, metrics, clock)
        finally:
            await pool.close()
    return asyncio.run(main())


def _moved_to(threshold_tokens: float, config) -> FixedThreshold:
    """The threshold's owner after a controller moved it from the configured base."""
    owner = FixedThreshold(config.scheduler.offload_threshold_tokens)
    owner.threshold_tokens = threshold_tokens
    return owner


@pytest.mark.parametrize("cached, threshold, path, transfer, reused", [
    ({}, 1024, "prfaas", None, 0),
    ({"local": 4096}, 1024, "local", None, 4096),
    ({"prfaas": 4096}, 1024, "local", CacheTransfer("prfaas", "local", 4096), 4096),      # abundant
    ({"prfaas": 4096}, 2048, "prfaas", None, 4096),                                       # scarce (t > base)
    ({"local": 4096}, float("inf"), "local", None, 4096),                                 # offloading stopped
])
def test_placement_uses_the_cache_pools(cached, threshold, path, transfer, reused, caplog):
    async def body(config, pool, metrics, clock):
        index, transfers = FakeIndex(cached), RecordingTransfers()
        placement = Placement(config, pool, metrics, index, transfers, threshold=_moved_to(threshold, config))
        cache, hashes = await placement.prompt_cache(list(range(5000)))
        assert len(index.queries[0].block_hashes) == 5000 // BLOCK and index.queries[0].model == config.model.name
        with caplog.at_level(logging.DEBUG, logger="services.router.placement"):
            route = placement.route("req-1", cache, hashes)
        assert (route.path, route.transfer, route.num_cached_tokens) == (path, transfer, reused)
        assert value(metrics, "prfaas_scheduler_decisions_total", path=path) == 1
        assert value(metrics, "prfaas_scheduler_offloaded_fraction") == (1.0 if path == "prfaas" else 0.0)
        # The histogram holds the decision's uncached tokens: the prompt's 5000 less those reused.
        uncached = 5000 - reused
        assert value(metrics, "prfaas_scheduler_decision_prompt_tokens_sum", path=path) == uncached
        assert value(metrics, "prfaas_scheduler_decision_prompt_tokens_bucket", path=path, le="64.0") == \
            (1 if uncached <= 64 else 0)
        assert value(metrics, "prfaas_scheduler_cross_cluster_transfers_total", source="prfaas",
                     target="local") == (1 if transfer else 0)
        assert transfers.issued == ([("req-1", transfer, transfer.num_tokens // BLOCK)] if transfer else [])
        line = next(r.getMessage() for r in caplog.records if "req-1: route" in r.getMessage())
        assert f"cached_local={cached.get('local', 0)} cached_prfaas={cached.get('prfaas', 0)}" in line
    run_with_pool({"workers": WORKERS, "cache_pools": POOLS}, body)


def test_without_pools_the_prompt_length_decides_and_prefills_are_cache_affine():
    async def body(config, pool, metrics, clock):
        placement = Placement(config, pool, metrics)
        pool.handle("p1").num_in_flight = 1
        first = placement.route("a", *await placement.prompt_cache(list(range(3000))))
        pool.handle("p2").num_in_flight = 5
        again = placement.route("b", *await placement.prompt_cache(list(range(3000)) + [7] * 100))
        short = placement.route("c", *await placement.prompt_cache(list(range(1000))))
        return first, again, short
    first, again, short = run_with_pool({"workers": WORKERS}, body)
    assert (first.path, first.prefill) == ("prfaas", "p2")
    assert (again.path, again.prefill) == ("prfaas", "p2")    # its prefix is there, despite the load
    assert short.path == "local" and short.num_cached_tokens == 0


def test_a_failing_worker_is_skipped_for_a_growing_backoff():
    async def body(config, pool, metrics, clock):
        decode = pool.handle("d")
        pool.mark_unreachable(decode)
        decode.healthy = True                       # the next poll finds it healthy again...
        skipped = pool.route(10, 1024) is None      # ...but the back-off still holds
        clock.now = 1.0
        back = pool.route(10, 1024) is not None
        pool.mark_unreachable(decode)
        decode.healthy = True
        clock.now = 2.5
        still_skipped = pool.route(10, 1024) is None
        backoff = value(metrics, "prfaas_router_worker_backoff_seconds", worker="d")
        pool.mark_reachable(decode)
        return skipped, back, still_skipped, backoff, pool.route(10, 1024) is not None
    assert run_with_pool({"workers": WORKERS}, body) == (True, True, True, 2.0, True)


PD = [
    {"name": "pd-p", "service": "decode_worker", "role": "prefill", "port": 50121, "kv_port": 50122},
    {"name": "pd-d1", "service": "decode_worker", "role": "decode", "port": 50123, "kv_port": 50124},
    {"name": "pd-d2", "service": "decode_worker", "role": "decode", "port": 50125, "kv_port": 50126},
]
FLIPS = {"enabled": True, "min_dwell_s": 100, "sustain_s": 5, "max_drain_s": 60}


def test_role_control_drains_then_flips_a_decode_worker_to_prefill():
    async def body(config, pool, metrics, clock):
        owner = WorkerRoles(pool)
        control = RoleControl(config, pool, metrics, clock=clock)
        pool.handle("pd-p").stats = WorkerStats(num_waiting_requests=10)
        pool.handle("pd-d1").num_in_flight = 1
        pool.handle("pd-d2").num_in_flight = 2
        await control.on_poll()
        clock.now = 5.0
        await control.on_poll()
        draining = pool.handle("pd-d1").draining, owner.states["pd-d1"].current.draining
        routes = {pool.route(10, 1024).decode for _ in range(3)}
        clock.now = 6.0
        await control.on_poll()                           # still one request in flight
        pool.handle("pd-d1").num_in_flight = 0
        clock.now = 7.0
        await control.on_poll()
        return draining, routes, pool.handle("pd-d1").role, owner.states["pd-d1"].current, pool.route(10, 1024)
    draining, routes, role, at_worker, route = run_with_pool(
        {"workers": PD, "scheduler": {"role_flips": FLIPS}}, body, flippable=True)
    assert draining == (True, True) and routes == {"pd-d2"}
    assert role == "prefill" and (at_worker.role, at_worker.draining, at_worker.generation) == ("prefill", False, 3)
    assert route.path == "pd" and route.decode == "pd-d2" and route.prefill in ("pd-p", "pd-d1")


def test_the_prefill_queue_counts_the_engine_the_workers_hand_off_queue_and_this_routers_waiters():
    """A PD-P worker's prefill queue is not only its engine's: with its hand-off slots full, requests wait in
    the worker's queue (every router's) and at this router for one of its own slots; each part alone makes
    prefill bind (prefill_queue_high 4 by default)."""
    async def body(config, pool, metrics, clock):
        control = RoleControl(config, pool, metrics, clock=clock)
        handle = pool.handle("pd-p")
        queued = []
        for stats, at_router in ((WorkerStats(num_waiting_requests=1), 0),
                                 (WorkerStats(num_waiting_requests=1, num_handoffs_queued=3), 0),
                                 (WorkerStats(num_waiting_requests=1), 3),
                                 (WorkerStats(num_waiting_requests=1, num_handoffs_queued=2), 2)):
            handle.stats, handle.num_handoffs_at_router = stats, at_router
            load = next(w for w in control.snapshot().workers if w.name == "pd-p")
            queued.append((load.num_prefill_queued, binding_stage(control.snapshot(), control.balancer.config)))
        return queued
    assert run_with_pool({"workers": PD, "scheduler": {"role_flips": FLIPS}}, body, flippable=True) == [
        (1, None), (4, "prefill"), (4, "prefill"), (5, "prefill")]


def test_a_drain_does_not_wait_for_requests_that_wait_for_a_hand_off_slot_to_decode_there():
    """Requests routed to decode on a worker that still wait for their prefill worker's slot move to another
    decode worker if it drains (Dispatcher), so its in-flight count for a drain leaves them out; what the
    worker reports as active still counts."""
    async def body(config, pool, metrics, clock):
        control = RoleControl(config, pool, metrics, clock=clock)
        handle = pool.handle("pd-d1")
        counts = []
        for in_flight, awaiting, active in ((3, 0, 0), (3, 2, 0), (3, 3, 0), (3, 3, 2)):
            handle.num_in_flight, handle.num_decodes_awaiting_handoff = in_flight, awaiting
            handle.stats = WorkerStats(num_active_requests=active)
            counts.append(next(w for w in control.snapshot().workers if w.name == "pd-d1").num_in_flight)
        handle.num_in_flight = handle.num_decodes_awaiting_handoff = 0
        return counts
    assert run_with_pool({"workers": PD, "scheduler": {"role_flips": FLIPS}}, body, flippable=True) == [3, 1, 0, 2]


def test_role_flip_metrics():
    async def body(config, pool, metrics, clock):
        WorkerRoles(pool)
        control = RoleControl(config, pool, metrics, clock=clock)
        pool.handle("pd-p").stats = WorkerStats(num_waiting_requests=10)
        for now in (0.0, 5.0, 6.0):
            clock.now = now
            await control.on_poll()
        return metrics
    metrics = run_with_pool({"workers": PD, "scheduler": {"role_flips": FLIPS}}, body, flippable=True)
    assert value(metrics, "prfaas_scheduler_role_flips_total", role="prefill") == 1
    assert value(metrics, "prfaas_scheduler_binding_stage", stage="prefill") == 1
    assert value(metrics, "prfaas_scheduler_role_decider") == 1
    flipped = [w for w in ("pd-d1", "pd-d2") if value(metrics, "prfaas_scheduler_worker_role", worker=w,
                                                      role="prefill") == 1]
    assert len(flipped) == 1


def _two_routers(body):
    """Two routers' pools and role controls (replica 0 decides, replica 1 follows) over one set of
    workers' role states; ``body(pools, controls, owner, clock)``."""
    async def main(config, pool, metrics, clock):
        other = WorkerPool(config.workers, config.router, RouterMetrics(), BackoffConfig(1.0, 8.0), flippable=True,
                           clock=clock)
        for handle in other.handles:
            handle.healthy = True
        try:
            owner = WorkerRoles(pool, other)
            controls = [RoleControl(config, p, p.metrics, clock=clock, leadership=Fixed(i == 0))
                        for i, p in enumerate((pool, other))]
            for p in (pool, other):
                p.handle("pd-p").stats = WorkerStats(num_waiting_requests=10)
            return await body((pool, other), controls, owner, clock)
        finally:
            await other.close()
    return run_with_pool({"workers": PD, "scheduler": {"role_flips": FLIPS}}, main, flippable=True)


def test_a_flip_by_the_deciding_router_is_seen_by_the_other_at_its_next_poll():
    async def body(pools, controls, owner, clock):
        seen = []
        for now in (0.0, 5.0, 6.0):
            clock.now = now
            for pool, control in zip(pools, controls):
                owner.poll(pool)
                await control.on_poll()
            seen.append(tuple(tuple((h.role, h.draining) for h in p.handles) for p in pools))
        return seen, [c.balancer.draining for c in controls]
    seen, draining = _two_routers(body)
    assert seen[0][0] == seen[0][1]  # nothing yet
    # t=5: the decider drains pd-d1 and the follower, polling after it, sees the drain at the worker
    assert ("decode", True) in seen[1][0] and seen[1][1] == seen[1][0]
    # t=6: drained and flipped; both routers agree
    assert seen[2][0] == seen[2][1] and [r for r, _ in seen[2][0]].count("prefill") == 2
    assert draining == [None, None]


def test_a_stale_generation_is_refused_and_nothing_is_overwritten():
    async def body(pools, controls, owner, clock):
        first, second = (p.handle("pd-d1") for p in pools)
        await pools[0].set_role(first, "prefill", True)
        try:
            await pools[1].set_role(second, "decode", False)  # generation 1: stale now
        except RoleConflict as exc:
            return str(exc), owner.states["pd-d1"].current
    message, state = _two_routers(body)
    assert "role generation 1 is stale: the worker is at generation 2" in message
    assert (state.role, state.draining) == ("prefill", True)


def test_a_router_that_does_not_decide_never_changes_a_role():
    async def body(pools, controls, owner, clock):
        for now in (0.0, 5.0, 6.0, 7.0):
            clock.now = now
            owner.poll(pools[1])
            await controls[1].on_poll()
        return [s.current.generation for s in owner.states.values()], controls[1].balancer.binding
    generations, binding = _two_routers(body)
    assert generations == [1, 1, 1] and binding is None


def test_the_decider_ends_a_drain_its_predecessor_left():
    async def body(pools, controls, owner, clock):
        await pools[1].set_role(pools[1].handle("pd-d2"), "decode", True)  # a decider that then stopped
        owner.poll(pools[0])
        clock.now = 0.0
        await controls[0].on_poll()
        return owner.states["pd-d2"].current
    state = _two_routers(body)
    assert (state.role, state.draining, state.generation) == ("decode", False, 3)


def test_workers_without_a_kv_port_do_not_flip():
    workers = [{**PD[0], "kv_port": None}, PD[1]]

    async def body(config, pool, metrics, clock):
        return pool.handle("pd-p").flippable, pool.handle("pd-d1").flippable
    assert run_with_pool({"workers": workers}, body, flippable=True) == (False, True)


def test_admission_rejects_on_predicted_decode_load():
    scheduler = {"admission_control": True, "decode_load_admission": True, "decode_kv_capacity_tokens": 10_000,
                 "decode_kv_limit": 0.9, "retry_after_s": 3}

    async def body(config, pool, metrics, clock):
        queues = PrefillQueues({}, metrics, clock=clock)
        admission = AdmissionControl(config, pool, queues, metrics)
        qos = admission.qos_class(None, None)
        with admission.admitted("ok", qos, pool.route(4000, 1024), 4000, 2000):
            pass
        pool.handle("d").num_committed_tokens = 6000
        with pytest.raises(ApiError) as excinfo:
            with admission.admitted("too-big", qos, pool.route(4000, 1024), 4000, 2000):
                pass
        return excinfo.value, value(metrics, "prfaas_router_rejected_requests_total", reason="decode_load",
                                    qos_class="default")
    error, rejected = run_with_pool({"workers": WORKERS, "scheduler": scheduler}, body)
    assert (error.status, error.code, error.headers, rejected) == (429, "decode_load", {"Retry-After": "3"}, 1)
    assert error.body()["error"]["type"] == "rate_limit_error"


def test_admission_judges_the_path_that_dispatch_will_serve():
    """One routing decision per request: admission reads the prefill queue of the route the
    dispatcher planned with the cache pools, not of a route of its own on the prompt's length."""
    scheduler = {"admission_control": True, "offload_threshold_tokens": 1024,
                 "prefill_tokens_per_s": {"prfaas": 100.0, "local": 1e6},
                 "qos_classes": [{"name": "default", "ttft_slo_ms": 1000}]}

    async def body(config, pool, metrics, clock):
        queues = PrefillQueues(config.scheduler.prefill_tokens_per_s, metrics, clock=clock)
        queues.enqueue("prfaas", 10_000)  # 100 s of PrfaaS prefill queued: that path breaks the SLO
        placement = Placement(config, pool, metrics, FakeIndex({"local": 4096}), RecordingTransfers())
        dispatcher = Dispatcher(pool, config.router, metrics, placement, queues)
        admission = AdmissionControl(config, pool, queues, metrics)
        qos = admission.qos_class(None, None)
        request = GenerateInput("r1", list(range(5000)), Sampling(max_tokens=4))
        plan = await dispatcher.plan(request)
        length_only = pool.route(5000, 1024)
        with admission.admitted("r1", qos, plan.route, 5000, 4):
            pass
        with pytest.raises(ApiError) as excinfo:
            with admission.admitted("r2", qos, length_only, 5000, 4):
                pass
        return length_only.path, plan.route.path, excinfo.value.code, \
            value(metrics, "prfaas_scheduler_decisions_total", path="local")
    length_only, planned, code, decisions = run_with_pool({"workers": WORKERS, "cache_pools": POOLS,
                                                           "scheduler": scheduler}, body)
    # The prompt's length alone says PrfaaS, whose queue would reject it; 4,096 of its tokens are
    # cached locally, so the dispatcher serves it locally, and that is the path admission judged.
    assert (length_only, planned, code, decisions) == ("prfaas", "local", "ttft_slo", 1)
