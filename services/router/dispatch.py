"""Send one generation to a worker, retrying on another one if it fails before the first token."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.config import RouterConfig
from services.engine import convert
from services.engine.types import GenerateInput, TokenDelta
from services.router.errors import ApiError, bad_request, unavailable
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.CANCELLED}


class WorkerFailed(Exception):
    """A worker failed after it had already streamed tokens (the request cannot be moved)."""


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        """Yields the request's deltas. Raises ApiError before the first delta, WorkerFailed after.

        Closing the iterator cancels the gRPC call, which aborts the request on the worker.
        """
        tried: set[str] = set()
        for _ in range(self._config.max_attempts):
            handle = self._pool.pick(frozenset(tried))
            if handle is None:
                break
            tried.add(handle.name)
            call = handle.decode.Generate(convert.generate_input_to_proto(request),
                                          timeout=self._config.request_timeout_s)
            handle.num_in_flight += 1
            try:
                first = await self._first(call, handle, request.request_id)
                if first is None:
                    continue
                yield convert.delta_from_proto(first)
                async for message in _rest(call, handle):
                    yield convert.delta_from_proto(message)
                return
            finally:
                handle.num_in_flight -= 1
                call.cancel()
        raise unavailable("No worker is available to serve this request; try again later")

    async def _first(self, call, handle: WorkerHandle, request_id: str):
        try:
            async with asyncio.timeout(self._config.first_token_timeout_s):
                return await call.read()
        except TimeoutError:
            logger.warning("request %s: worker %s gave no first token in %.0f s", request_id, handle.name,
                           self._config.first_token_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise bad_request(exc.details()) from None
            if exc.code() not in RETRYABLE:
                raise ApiError(500, f"worker error: {exc.details()}", type="server_error") from None
            logger.warning("request %s: worker %s failed before the first token: %s", request_id, handle.name,
                           exc.code().name)
        self._pool.mark_unreachable(handle)
        self._metrics.worker_retries.inc()
        return None


async def _rest(call, handle: WorkerHandle):
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise WorkerFailed(f"worker {handle.name} failed mid-request: {exc.code().name}") from None
