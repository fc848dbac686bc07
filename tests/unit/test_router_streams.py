"""The router keeps its request streams to a worker below the worker's gRPC stream limit.

Measured on the embedded default past its knee (bench/sim_vs_real.py at 1.5x): with ~260 requests in
flight on one decode worker, whose limit is 256 streams per connection, the worker refused new
streams (UNAVAILABLE), the router's health check of it failed with them, and 78 requests got a 503.
Here a real in-process gRPC worker with a small limit holds every Generate until released.
"""
import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prfaas.v1 import worker_pb2 as wpb
from prfaas.v1 import worker_pb2_grpc as wpb_grpc

from services.config import parse_config
from services.worker_api.types import GenerateInput, Sampling
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.workers import STREAMS_RESERVED, WorkerPool
from services.scheduling.congestion import FixedThreshold
from services.security import GrpcSecurity

LIMIT = STREAMS_RESERVED + 4      # the worker's max_concurrent_streams
NUM_REQUESTS = 3 * LIMIT


class HeldDecode(wpb_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_open = self.max_open = 0

    async def Generate(self, request, context):
        self.num_open += 1
        self.max_open = max(self.max_open, self.num_open)
        try:
            await self.release.wait()
            yield wpb.GenerateResponse(token_ids=[7], text="x", finish_reason="length")
        finally:
            self.num_open -= 1


async def _scenario():
    security = GrpcSecurity(max_concurrent_streams=LIMIT)
    servicer = HeldDecode()
    server = grpc.aio.server(options=security.options)
    wpb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    config = parse_config({"model": {"name": "m", "path": "/m"}, "workers": [
        {"name": "d", "service": "decode_worker", "role": "both", "port": port}]})
    metrics = RouterMetrics()
    pool = WorkerPool(config.workers, config.router, metrics, security=security)
    try:
        (handle,) = pool.handles
        handle.healthy = True
        dispatcher = Dispatcher(pool, config.router, metrics,
                                Placement(config, pool, metrics, threshold=FixedThreshold(1e9)))

        async def one(index: int) -> str:
            request = GenerateInput(f"r{index}", [1, 2, 3], Sampling(max_tokens=1))
            return "".join([delta.text async for delta in dispatcher.generate(request)])

        requests = [asyncio.create_task(one(i)) for i in range(NUM_REQUESTS)]
        await asyncio.sleep(1.0)
        check = await handle.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        servicer.release.set()
        answers = await asyncio.gather(*requests, return_exceptions=True)
        return answers, servicer.max_open, check.status
    finally:
        await pool.close()
        await server.stop(0)


def test_requests_past_a_workers_stream_limit_wait_for_a_stream_and_health_checks_still_pass():
    answers, max_open, status = asyncio.run(_scenario())
    assert answers == ["x"] * NUM_REQUESTS
    assert max_open == LIMIT - STREAMS_RESERVED
    assert status == health_pb2.HealthCheckResponse.SERVING
