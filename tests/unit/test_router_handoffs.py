"""The router gives a prefill worker at most ``max_handoffs_per_prefill_worker`` hand-offs at once.

Measured on the embedded default past its knee (bench/sim_vs_real.py at 1.5x): every long prompt went
to the PrfaaS prefill worker at once, and the decode worker reserved KV cache for each of them while
~110 waited for their prefill. The reservations (~635 tokens each) filled its 46,592-token cache, so
its short, local requests waited too: mean TTFT 13.6 s for prompts of ~140 tokens, and the system
served 18% less than the simulator predicted. Here real in-process gRPC workers hold every hand-off
until released, and the router must keep the others waiting without holding up local requests.
"""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prfaas.v1 import worker_pb2 as wpb
from prfaas.v1 import worker_pb2_grpc as wpb_grpc

from services.config import parse_config
from services.worker_api.types import GenerateInput, Sampling
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.workers import WorkerPool
from services.scheduling.congestion import FixedThreshold
from services.engine import worker_rpc
from services.engine.serve import CallerGuard
from services.engine.worker_state import Busy, HandoffSlots, RoleState
from services.security import GrpcSecurity, Rejections

MAX_HANDOFFS = 2
NUM_LONG = 6
NUM_SHORT = 3
THRESHOLD = 4   # prompts longer than this many tokens go to the prefill worker


class HeldWorkers(wpb_grpc.DecodeWorkerServicer, wpb_grpc.PrefillWorkerServicer):
    """A decode worker and a prefill worker; hand-offs (both their calls) wait for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.open_prefills = self.max_open_prefills = 0
        self.open_consumers = self.max_open_consumers = 0
        self.local_served = 0

    async def Generate(self, request, context):
        if not request.HasField("kv_source"):
            self.local_served += 1
            yield wpb.GenerateResponse(token_ids=[1], text="local", finish_reason="length")
            return
        self.open_consumers += 1
        self.max_open_consumers = max(self.max_open_consumers, self.open_consumers)
        try:
            await self.release.wait()
            yield wpb.GenerateResponse(token_ids=[2], text="remote", finish_reason="length")
        finally:
            self.open_consumers -= 1

    async def Prefill(self, request, context):
        self.open_prefills += 1
        self.max_open_prefills = max(self.max_open_prefills, self.open_prefills)
        try:
            await self.release.wait()
            return wpb.PrefillResponse(num_prompt_tokens=len(request.prompt_token_ids))
        finally:
            self.open_prefills -= 1


async def _serve(servicer: HeldWorkers, security: GrpcSecurity):
    server = grpc.aio.server(options=security.options)
    wpb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    wpb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    return server, port


async def _scenario(prefill_fails: str = ""):
    """``prefill_fails``: "" (never), "unhealthy" (marked so, as after a failed call or a NOT_SERVING
    answer) or "unanswering" (its polls go unanswered: a hang or a dead link)."""
    security = GrpcSecurity()
    servicer = HeldWorkers()
    decode_server, decode_port = await _serve(servicer, security)
    prefill_server, prefill_port = await _serve(servicer, security)
    config = _config(decode_port, prefill_port, MAX_HANDOFFS)
    metrics = RouterMetrics()
    pool = WorkerPool(config.workers, config.router, metrics, security=security)
    try:
        for handle in pool.handles:
            handle.healthy = True
        dispatcher = Dispatcher(pool, config.router, metrics,
                                Placement(config, pool, metrics, threshold=FixedThreshold(THRESHOLD)))

        async def one(index: int, length: int) -> str:
            request = GenerateInput(f"r{index}", list(range(1, length + 1)), Sampling(max_tokens=1))
            return "".join([delta.text async for delta in dispatcher.generate(request)])

        long = [asyncio.create_task(one(i, 2 * THRESHOLD)) for i in range(NUM_LONG)]
        await asyncio.sleep(0.5)
        short = [asyncio.create_task(one(NUM_LONG + i, 2)) for i in range(NUM_SHORT)]
        short_answers = await asyncio.wait_for(asyncio.gather(*short), timeout=5)
        waiting = metrics.handoffs_waiting.labels("p")._value.get()
        fell_back = 0
        if prefill_fails:
            pool.handle("p").healthy = False
            if prefill_fails == "unanswering":
                pool.handle("p").num_unanswered_polls = 2
            await asyncio.sleep(1.0)  # the waiting hand-offs notice within stats_interval_s
            fell_back = servicer.local_served - NUM_SHORT
        servicer.release.set()
        long_answers = await asyncio.wait_for(asyncio.gather(*long), timeout=10)
        return {"short": short_answers, "long": long_answers, "waiting": waiting,
                "max_open_prefills": servicer.max_open_prefills, "max_open_consumers": servicer.max_open_consumers,
                "fell_back": fell_back, "open_prefills_after": servicer.open_prefills,
                "fallbacks": metrics.prefill_fallbacks._value.get()}
    finally:
        await pool.close()
        await decode_server.stop(0)
        await prefill_server.stop(0)


def test_hand_offs_past_the_limit_wait_at_the_router_and_local_requests_pass_them():
    result = asyncio.run(_scenario())
    assert result["short"] == ["local"] * NUM_SHORT  # served while the hand-offs were held
    assert result["waiting"] == NUM_LONG - MAX_HANDOFFS
    assert result["max_open_prefills"] == MAX_HANDOFFS
    assert result["max_open_consumers"] == MAX_HANDOFFS  # the decode worker reserved KV for no more
    assert result["long"] == ["remote"] * NUM_LONG
    assert result["fallbacks"] == 0


def test_hand_offs_waiting_for_a_prefill_worker_that_stops_answering_are_prefilled_locally():
    result = asyncio.run(_scenario("unhealthy"))
    assert result["fell_back"] == NUM_LONG - MAX_HANDOFFS  # before the held ones were released
    assert result["fallbacks"] == NUM_LONG - MAX_HANDOFFS
    # the two in flight there go on: a worker that answers (even NOT_SERVING, draining) finishes them
    assert sorted(result["long"]) == ["local"] * (NUM_LONG - MAX_HANDOFFS) + ["remote"] * MAX_HANDOFFS


def test_hand_offs_in_flight_on_a_prefill_worker_that_stops_answering_are_prefilled_locally():
    # Measured in the chaos soak: a long prompt in flight on a prefill worker SIGSTOPped for 30 s got its
    # first token after 29.2 s (its call only ends at its timeout), right but as slow as the hang.
    result = asyncio.run(_scenario("unanswering"))
    assert result["fell_back"] == NUM_LONG  # the held ones too, before they were released
    assert result["fallbacks"] == NUM_LONG
    assert result["open_prefills_after"] == 0  # their prefill calls were cancelled
    assert result["long"] == ["local"] * NUM_LONG


class Health(health.aio.HealthServicer):
    """Answers health checks at once, or never while ``hung`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = False

    async def Check(self, request, context):
        while self.hung:
            await asyncio.sleep(0.05)
        return await super().Check(request, context)


class Stats(wpb_grpc.PrefillWorkerServicer):
    async def GetStats(self, request, context):
        return wpb.WorkerStats(worker_name="p")


async def _one_prefill_worker(stats_interval_s: float = 1.0):
    """A prefill worker that answers health checks (``Health``) and stats, and a router's pool of it
    and of a decode worker that is not there."""
    security = GrpcSecurity()
    server = grpc.aio.server(options=security.options)
    checks = Health()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    wpb_grpc.add_PrefillWorkerServicer_to_server(Stats(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    config = parse_config({"model": {"name": "m", "path": "/m"},
                           "router": {"connect_timeout_s": 0.2, "stats_interval_s": stats_interval_s},
                           "workers": [{"name": "p", "service": "prefill_worker", "cluster": "prfaas", "port": port},
                                       {"name": "d", "service": "decode_worker", "port": 1}]})
    return server, checks, WorkerPool(config.workers, config.router, RouterMetrics(), security=security)


def test_polls_a_worker_leaves_unanswered_are_counted_in_a_row():
    async def main():
        server, checks, pool = await _one_prefill_worker()
        handle = pool.handle("p")
        try:
            counts = []
            for hung in (False, True, True, False):
                checks.hung = hung
                await pool.poll_once()
                counts.append((handle.num_unanswered_polls, handle.healthy))
            return counts
        finally:
            checks.hung = False
            await pool.close()
            await server.stop(0)
    assert asyncio.run(main()) == [(0, True), (1, False), (2, False), (0, True)]


def test_a_worker_that_comes_up_is_seen_long_before_the_next_full_poll():
    # Measured in the worker-failure e2e test (stats every 30 s): one decode worker served 3 s after the
    # router's first poll, so the router kept it down for 30 s, and a request that had to move off the
    # other, killed worker found no worker to go on.
    async def main():
        server, checks, pool = await _one_prefill_worker(stats_interval_s=30.0)
        await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        handle = pool.handle("p")
        try:
            await pool.start()
            down_at_start = not handle.healthy
            await checks.set("", health_pb2.HealthCheckResponse.SERVING)
            started = asyncio.get_running_loop().time()
            while not handle.healthy and asyncio.get_running_loop().time() - started < 10:
                await asyncio.sleep(0.05)
            seen_after = asyncio.get_running_loop().time() - started
            # down again, with a request on it: only the full poll may count it as unanswered
            await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await pool.poll_once()
            lease = pool.lease("p")
            checks.hung = True
            await asyncio.sleep(3 * pool.recheck_s)
            unanswered_with_request = handle.num_unanswered_polls
            lease.release()
            await asyncio.sleep(3 * pool.recheck_s)
            return down_at_start, seen_after, unanswered_with_request, handle.num_unanswered_polls
        finally:
            checks.hung = False
            await pool.close()
            await server.stop(0)
    down_at_start, seen_after, unanswered_with_request, unanswered_without = asyncio.run(main())
    assert down_at_start
    assert seen_after < 2.5  # the re-check runs every back-off base (1 s), not every 30 s
    assert unanswered_with_request == 0
    assert unanswered_without >= 2


class DeadKvLink(HeldWorkers):
    """A prefill worker whose KV transfer fails at the sender: its Prefill call ends ABORTED (as
    services/engine/worker_rpc.py answers), while the decode worker would wait for KV forever."""

    async def Prefill(self, request, context):
        await asyncio.sleep(0.2)
        await context.abort(grpc.StatusCode.ABORTED, f"KV transfer to {request.kv_target} failed: no progress")


def test_a_kv_transfer_that_fails_at_the_sender_is_prefilled_locally_at_once():
    async def scenario():
        security = GrpcSecurity()
        servicer = DeadKvLink()
        decode_server, decode_port = await _serve(servicer, security)
        prefill_server, prefill_port = await _serve(servicer, security)
        config = parse_config({
            "model": {"name": "m", "path": "/m"},
            "workers": [{"name": "d", "service": "decode_worker", "role": "both", "port": decode_port, "kv_port": 1},
                        {"name": "p", "service": "prefill_worker", "cluster": "prfaas", "port": prefill_port}]})
        metrics = RouterMetrics()
        pool = WorkerPool(config.workers, config.router, metrics, security=security)
        try:
            for handle in pool.handles:
                handle.healthy = True
            dispatcher = Dispatcher(pool, config.router, metrics,
                                    Placement(config, pool, metrics, threshold=FixedThreshold(THRESHOLD)))
            request = GenerateInput("r-dead-link", list(range(1, 2 * THRESHOLD + 1)), Sampling(max_tokens=1))
            loop = asyncio.get_running_loop()
            started = loop.time()
            text = "".join([d.text async for d in dispatcher.generate(request)])
            return (text, loop.time() - started, metrics.prefill_fallbacks._value.get(), pool.handle("p").healthy,
                    servicer.open_consumers)
        finally:
            await pool.close()
            await decode_server.stop(0)
            await prefill_server.stop(0)

    text, elapsed_s, fallbacks, prefill_worker_healthy, open_consumers = asyncio.run(scenario())
    assert text == "local" and elapsed_s < 2.0 and fallbacks == 1
    assert prefill_worker_healthy  # the link failed, not the worker: it keeps its other hand-offs
    assert open_consumers == 0  # the decode worker's wait for the KV was cancelled


class SlottedWorkers(HeldWorkers):
    """HeldWorkers whose prefill worker enforces its hand-off slots itself, as a real worker does
    (services/engine/worker_state.HandoffSlots through the worker's own ReserveHandoff: one queue for
    every router; RESOURCE_EXHAUSTED for a Prefill when every slot is held), and reports them in its
    stats."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.slots = HandoffSlots(limit)
        self.guard = CallerGuard(kv_targets=None, rejections=Rejections("p"), roles=RoleState("prefill"),
                                 handoffs=self.slots)
        self.num_refused = 0
        self.transfers: set[str] = set()
        self.prefill_order: list[str] = []

    async def ReserveHandoff(self, request, context):
        return await worker_rpc.reserve_handoff(self.guard, request, context)

    async def Generate(self, request, context):
        """A KV transfer id is used once: the real decode worker drops a cancelled transfer's id for good,
        and a second request under it would wait for KV that never comes."""
        if request.HasField("kv_source"):
            if request.kv_source.transfer_id in self.transfers:
                await asyncio.Event().wait()
            self.transfers.add(request.kv_source.transfer_id)
        async for message in super().Generate(request, context):
            yield message

    async def Prefill(self, request, context):
        try:
            with self.slots.held(request.handoff_reservation):
                self.prefill_order.append(request.request_id.split("-busy")[0])
                return await super().Prefill(request, context)
        except Busy as exc:
            self.num_refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def GetStats(self, request, context):
        return wpb.WorkerStats(num_handoffs=self.slots.num_held, max_handoffs=self.slots.limit)


class OlderSlottedWorkers(SlottedWorkers):
    """A worker from before ReserveHandoff: the routers read its slots from its stats."""

    async def ReserveHandoff(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


@pytest.mark.parametrize("workers", [SlottedWorkers, OlderSlottedWorkers], ids=["reserving", "older-worker"])
def test_a_hand_off_limit_holds_across_two_routers_and_nothing_fails(workers):
    """Two routers, each allowed 1 hand-off on the prefill worker, send 3 long prompts each: the worker
    never holds more than 1, the routers wait (none prefilled locally, none failed)."""
    answers, max_open, fallbacks, _ = asyncio.run(_routers(workers(limit=1), release_every_s=0.35))
    assert max_open == 1
    assert answers == ["remote"] * 6 and fallbacks == 0


def test_hand_offs_from_two_routers_get_the_workers_slot_in_the_order_they_asked():
    """One queue at the worker, first come first served whichever router a request came through: the
    worker has 1 slot, each router allows itself 2 (as 2 routers of a 2-slot config would, and more), and
    six requests alternate between the routers 30 ms apart: they prefill in the order they were sent."""
    answers, max_open, fallbacks, order = asyncio.run(_routers(SlottedWorkers(limit=1), release_every_s=0.2,
                                                                   router_limit=2))
    assert answers == ["remote"] * 6 and fallbacks == 0 and max_open == 1
    assert order == [f"r{i}" for i in range(6)]


def test_hand_offs_waiting_at_one_router_longer_than_a_stats_interval_keep_their_order():
    """The router's own slots are first come first served too, however long the wait (here 3.5 stats
    intervals per slot: a wait cancelled at each health check and begun again went to the back)."""
    answers, max_open, fallbacks, order = asyncio.run(_routers(SlottedWorkers(limit=0), release_every_s=0.35,
                                                                   num_routers=1))
    assert answers == ["remote"] * 6 and fallbacks == 0 and max_open == 1
    assert order == [f"r{i}" for i in range(6)]


async def _routers(servicer: SlottedWorkers, release_every_s: float, router_limit: int = 1,
                       num_routers: int = 2):
    """``num_routers`` routers (each allowed ``router_limit`` hand-offs) send six long prompts in turn, 30 ms
    apart; the worker's hand-offs are released one at a time, ``release_every_s`` apart. (answers, the most
    prefills open at once, the prefills the routers did locally, the order the worker started them in)."""
    security = GrpcSecurity()
    decode_server, decode_port = await _serve(servicer, security)
    prefill_server, prefill_port = await _serve(servicer, security)
    config = _config(decode_port, prefill_port, router_limit)
    routers = []
    for _ in range(num_routers):
        metrics = RouterMetrics()
        pool = WorkerPool(config.workers, config.router, metrics, security=security)
        routers.append((pool, metrics, Dispatcher(pool, config.router, metrics,
                                                  Placement(config, pool, metrics,
                                                            threshold=FixedThreshold(THRESHOLD)))))
    try:
        for pool, _, _ in routers:
            await pool.start()

        async def one(dispatcher, index: int) -> str:
            request = GenerateInput(f"r{index}", list(range(1, 2 * THRESHOLD + 1)), Sampling(max_tokens=1))
            return "".join([delta.text async for delta in dispatcher.generate(request)])

        answers = []
        for i in range(6):
            answers.append(asyncio.create_task(one(routers[i % num_routers][2], i)))
            await asyncio.sleep(0.03)
        for _ in range(5):  # release the hand-offs one at a time
            await asyncio.sleep(release_every_s)
            servicer.release.set()
            await asyncio.sleep(0)
            servicer.release.clear()
        servicer.release.set()
        return (await asyncio.wait_for(asyncio.gather(*answers), timeout=10), servicer.max_open_prefills,
                sum(m.prefill_fallbacks._value.get() for _, m, _ in routers), servicer.prefill_order)
    finally:
        for pool, _, _ in routers:
            await pool.close()
        await decode_server.stop(0)
        await prefill_server.stop(0)


class DrainingPrefill(HeldWorkers):
    """A prefill worker that drains for a role flip: it refuses every Prefill (RESOURCE_EXHAUSTED) and says
    so in its stats."""

    def __init__(self) -> None:
        super().__init__()
        self.num_refused = 0

    async def Prefill(self, request, context):
        self.num_refused += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the worker is draining for a role flip")

    async def GetStats(self, request, context):
        return wpb.WorkerStats(role="prefill", draining=True, role_generation=2)


def test_a_hand_off_refused_by_a_draining_worker_is_prefilled_locally_without_spinning():
    async def main():
        security = GrpcSecurity()
        servicer = DrainingPrefill()
        decode_server, decode_port = await _serve(servicer, security)
        prefill_server, prefill_port = await _serve(servicer, security)
        config = _config(decode_port, prefill_port, 0)
        pool, metrics, dispatcher = _healthy_router(config, security)
        try:
            poller = asyncio.create_task(pool._poll_forever())
            request = GenerateInput("r", list(range(1, 2 * THRESHOLD + 1)), Sampling(max_tokens=1))
            answer = await asyncio.wait_for(_collect(dispatcher.generate(request)), timeout=5)
            poller.cancel()
            return answer, servicer.num_refused, metrics.prefill_fallbacks._value.get()
        finally:
            await pool.close()
            await decode_server.stop(0)
            await prefill_server.stop(0)
    answer, refused, fallbacks = asyncio.run(main())
    assert answer == "local" and fallbacks == 1
    assert refused == 1  # it waited for the next poll, which said the worker drains, instead of asking again


def _healthy_router(config, security: GrpcSecurity):
    """A router's pool (every worker marked healthy, no polling), its metrics and its dispatcher."""
    metrics = RouterMetrics()
    pool = WorkerPool(config.workers, config.router, metrics, security=security)
    for handle in pool.handles:
        handle.healthy = True
    return pool, metrics, Dispatcher(pool, config.router, metrics,
                                     Placement(config, pool, metrics, threshold=FixedThreshold(THRESHOLD)))


async def _collect(deltas) -> str:
    return "".join([delta.text async for delta in deltas])


def _config(decode_port: int, prefill_port: int, max_handoffs: int):
    """A decode worker and a PrfaaS prefill worker, polled every 0.1 s."""
    return parse_config({
        "model": {"name": "m", "path": "/m"},
        "router": {"stats_interval_s": 0.1, "max_handoffs_per_prefill_worker": max_handoffs},
        "workers": [{"name": "d", "service": "decode_worker", "role": "both", "port": decode_port, "kv_port": 1},
                    {"name": "p", "service": "prefill_worker", "cluster": "prfaas", "port": prefill_port}]})


class RecordingDecode(HeldWorkers):
    """A decode worker that records the requests whose KV it was asked to take."""

    def __init__(self, release: asyncio.Event) -> None:
        super().__init__()
        self.release = release
        self.consumed: list[str] = []

    async def Generate(self, request, context):
        if request.HasField("kv_source"):
            self.consumed.append(request.request_id)
        async for message in super().Generate(request, context):
            yield message


def test_a_hand_off_whose_decode_worker_drains_while_it_waits_decodes_elsewhere():
    """Two decode workers, a prefill worker with one hand-off slot. r0 holds the slot (decoding on d1);
    r1 waits for it, routed to decode on d2. d2 starts to drain for a role flip: r1 gets the slot and
    decodes on d1, keeping its place, and d2's drain counts no request of this router as in flight."""
    async def main():
        security = GrpcSecurity()
        release = asyncio.Event()
        d1, d2, prefill = RecordingDecode(release), RecordingDecode(release), HeldWorkers()
        prefill.release = release
        servers = [await _serve(servicer, security) for servicer in (d1, d2, prefill)]
        config = parse_config({
            "model": {"name": "m", "path": "/m"},
            "router": {"stats_interval_s": 0.1, "max_handoffs_per_prefill_worker": 1},
            "workers": [{"name": "d1", "service": "decode_worker", "role": "both", "port": servers[0][1],
                         "kv_port": 1},
                        {"name": "d2", "service": "decode_worker", "role": "both", "port": servers[1][1],
                         "kv_port": 2},
                        {"name": "p", "service": "prefill_worker", "cluster": "prfaas", "port": servers[2][1]}]})
        pool, metrics, dispatcher = _healthy_router(config, security)
        try:
            def request(index: int) -> GenerateInput:
                return GenerateInput(f"r{index}", list(range(1, 2 * THRESHOLD + 1)), Sampling(max_tokens=1))

            first = asyncio.create_task(_collect(dispatcher.generate(request(0))))
            await asyncio.sleep(0.2)
            second = asyncio.create_task(_collect(dispatcher.generate(request(1))))
            await asyncio.sleep(0.2)
            donor = pool.handle("d2")
            in_flight_while_waiting = (donor.num_in_flight, donor.num_decodes_awaiting_handoff)
            donor.draining = True  # as the deciding router sets it when the drain starts
            release.set()
            answers = await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
            return answers, d1.consumed, d2.consumed, in_flight_while_waiting, donor.num_in_flight
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)

    answers, on_d1, on_d2, in_flight_while_waiting, in_flight_after = asyncio.run(main())
    assert answers == ["remote", "remote"]
    assert in_flight_while_waiting == (1, 1)  # routed to d2, waiting for the slot: not at the worker yet
    assert on_d1 == ["r0", "r1"] and on_d2 == []
    assert in_flight_after == 0
