"""Run one generation on the workers: choose the route, start the prefill hand-off, stream tokens.

Before the first token nothing is lost yet, so failures there are retried: an unreachable decode
worker is replaced by another one, and a failed remote prefill falls back to a local prefill on
the same decode worker. After the first token a failure ends the request (``WorkerFailed``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.config import RouterConfig
from services.worker_api import convert
from services.worker_api.types import GenerateInput, TokenDelta
from services.kv_connector.params import consume
from services.router.admission import PrefillQueues
from services.router.errors import ApiError, bad_request, unavailable
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.workers import WorkerHandle, WorkerPool
from services.scheduling.congestion import FixedThreshold, OffloadThreshold
from services.scheduling.placement import PromptCache, Route

logger = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.CANCELLED}
# A hand-off not yet answered is prefilled locally once its prefill worker leaves this many polls in a
# row unanswered: one missed poll can be a busy moment, two (at least one stats interval plus the
# poll's timeout apart) are a hang or a dead link.
UNANSWERED_POLLS = 2


class WorkerFailed(Exception):
    """A worker failed after it had already streamed tokens (the request cannot be moved)."""


class _PrefillFailed(Exception):
    pass


class _Handoff:
    """One hand-off slot of a prefill worker; released once, by whichever comes first: the decode
    worker's first token, or the end of the prefill call."""

    __slots__ = ("_slots",)

    def __init__(self, slots: asyncio.Semaphore | None) -> None:
        self._slots = slots

    def release(self) -> None:
        if self._slots is not None:
            slots, self._slots = self._slots, None
            slots.release()


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A request's one routing decision, made before admission (which reads its path) and served by
    :meth:`Dispatcher.generate`; only a retry after a failed worker routes again."""

    cache: PromptCache
    block_hashes: list[bytes]
    route: Route | None


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, metrics: RouterMetrics,
                 threshold: OffloadThreshold | float, queues: PrefillQueues | None = None,
                 placement: Placement | None = None) -> None:
        """``threshold``: the offload threshold's owner (a number: fixed there). Without
        ``placement`` nothing is known to be cached: prompts route on their full length."""
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._queues = queues
        self._placement = placement
        self._threshold = FixedThreshold(threshold) if isinstance(threshold, (int, float)) else threshold
        self.on_request: list[Callable[[int], None]] = []

    @property
    def threshold_tokens(self) -> float:
        return self._threshold.threshold_tokens

    async def plan(self, request: GenerateInput) -> Plan:
        """What is cached of the prompt and where the request goes (None: no worker can take it)."""
        cache, block_hashes = await self._prompt_cache(request)
        return Plan(cache, block_hashes, self._route(request.request_id, cache, block_hashes, frozenset()))

    async def generate(self, request: GenerateInput, plan: Plan | None = None) -> AsyncIterator[TokenDelta]:
        """Yields the request's deltas on ``plan``'s route (planned here when not given). Raises
        ApiError before the first delta, WorkerFailed after. Each ``on_request`` callback first gets
        the prompt's length (once per request, not per retry).

        Closing the iterator cancels the gRPC calls, which aborts the request on the workers.
        """
        tried: set[str] = set()
        num_tokens = len(request.prompt_token_ids)
        for callback in self.on_request:
            callback(num_tokens)
        num_committed = num_tokens + request.sampling.max_tokens
        plan = plan or await self.plan(request)
        for attempt in range(self._config.max_attempts):
            route = plan.route if attempt == 0 else \
                self._route(request.request_id, plan.cache, plan.block_hashes, frozenset(tried))
            if route is None:
                break
            tried.add(route.decode)
            decode = self._pool.handle(route.decode)
            decode.num_in_flight += 1
            decode.num_committed_tokens += num_committed
            queued = self._enqueue(route.path, num_tokens)
            acquired = False
            try:
                await decode.streams.acquire()  # a stream below the worker's limit (see WorkerHandle.streams)
                acquired = True
                call, first = await self._start(request, route, decode)
                if first is None:
                    continue
                self._pool.mark_reachable(decode)
                if queued:
                    queued = False
                    self._queues.dequeue(route.path, num_tokens, prefilled=True)
                yield convert.delta_from_proto(first)
                async for message in _rest(call, decode):
                    yield convert.delta_from_proto(message)
                return
            finally:
                if acquired:
                    decode.streams.release()
                decode.num_in_flight -= 1
                decode.num_committed_tokens -= num_committed
                if queued:
                    self._queues.dequeue(route.path, num_tokens, prefilled=False)
        raise unavailable("No worker is available to serve this request; try again later")

    async def _prompt_cache(self, request: GenerateInput) -> tuple[PromptCache, list[bytes]]:
        if self._placement is None:
            return PromptCache(len(request.prompt_token_ids)), []
        return await self._placement.prompt_cache(request.prompt_token_ids)

    def _route(self, request_id: str, cache: PromptCache, block_hashes: list[bytes],
               exclude: frozenset[str]) -> Route | None:
        if self._placement is not None:
            return self._placement.route(request_id, cache, block_hashes, self.threshold_tokens, exclude)
        route = self._pool.route(cache.num_prompt_tokens, self.threshold_tokens, exclude)
        if route is not None:
            logger.debug("request %s: route %s decode=%s prefill=%s incremental_prompt_tokens=%d threshold=%s",
                         request_id, route.path, route.decode, route.prefill, cache.num_prompt_tokens,
                         self.threshold_tokens)
        return route

    def _enqueue(self, path: str, num_tokens: int) -> bool:
        if self._queues is None:
            return False
        self._queues.enqueue(path, num_tokens)
        return True

    async def _start(self, request: GenerateInput, route: Route, decode: WorkerHandle):
        """Returns (call, first message), or (None, None) when the decode worker is unreachable."""
        if route.prefill is not None:
            try:
                return await self._start_with_handoff(request, route, decode)
            except _PrefillFailed:
                self._metrics.prefill_fallbacks.inc()
        self._metrics.routed.labels("local").inc()
        call = decode.decode.Generate(convert.generate_input_to_proto(request), timeout=self._config.request_timeout_s)
        try:
            first = await self._first(call, decode, request.request_id)
        except BaseException:
            call.cancel()
            raise
        return call, first

    async def _start_with_handoff(self, request: GenerateInput, route: Route, decode: WorkerHandle):
        """The decode worker waits for KV that the prefill worker streams to it."""
        prefill = self._pool.handle(route.prefill)
        prefill.num_in_flight += 1  # a hand-off waiting for its turn is the prefill worker's load already
        try:
            handoff = await self._handoff(prefill, request.request_id)
        except BaseException:
            prefill.num_in_flight -= 1
            raise
        try:
            await prefill.streams.acquire()  # released when the prefill call ends (_prefill_done)
        except BaseException:
            prefill.num_in_flight -= 1
            handoff.release()
            raise
        try:
            self._metrics.routed.labels(route.path).inc()
            consumer = dataclasses.replace(request, kv_transfer=consume(request.request_id))
            call = decode.decode.Generate(convert.generate_input_to_proto(consumer),
                                          timeout=self._config.request_timeout_s)
            prefill_call = prefill.prefill.Prefill(
                convert.prefill_request_to_proto(request, decode.kv_address, decode.tp_size),
                timeout=self._config.request_timeout_s)
            prefill_task = asyncio.ensure_future(prefill_call)
        except BaseException:
            prefill.num_in_flight -= 1
            prefill.streams.release()
            handoff.release()
            raise
        prefill_task.add_done_callback(lambda task: self._prefill_done(task, request.request_id, prefill, handoff))
        try:
            first = await self._first(call, decode, request.request_id, prefill_task, prefill)
        except BaseException:
            call.cancel()
            prefill_call.cancel()
            raise
        finally:
            handoff.release()  # the decode worker's reservation is in use now, or gone
        if first is None:
            prefill_call.cancel()
        return call, first

    async def _handoff(self, prefill: WorkerHandle, request_id: str) -> _Handoff:
        """Waits for one of ``prefill``'s hand-off slots (RouterConfig.max_handoffs_per_prefill_worker).
        Raises _PrefillFailed when the worker stops being usable (failed health checks) while this waits."""
        if prefill.handoffs is None:
            return _Handoff(None)
        gauge = self._metrics.handoffs_waiting.labels(prefill.name)
        prefill.num_handoffs_waiting += 1
        gauge.set(prefill.num_handoffs_waiting)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._config.stats_interval_s):
                        await prefill.handoffs.acquire()
                    return _Handoff(prefill.handoffs)
                except TimeoutError:
                    if not self._pool.is_usable(prefill):
                        logger.warning("request %s: prefill worker %s stopped answering while the request waited "
                                       "for it; prefilling locally instead", request_id, prefill.name)
                        raise _PrefillFailed() from None
        finally:
            prefill.num_handoffs_waiting -= 1
            gauge.set(prefill.num_handoffs_waiting)

    def _prefill_done(self, task: asyncio.Future, request_id: str, prefill: WorkerHandle, handoff: _Handoff) -> None:
        prefill.num_in_flight -= 1
        prefill.streams.release()
        handoff.release()
        _log_prefill_outcome(task, request_id, prefill.name)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self._pool.mark_reachable(prefill)
        elif isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._pool.mark_unreachable(prefill)

    async def _first(self, call, handle: WorkerHandle, request_id: str, prefill_task=None,
                     prefill: WorkerHandle | None = None):
        read = asyncio.ensure_future(call.read())
        try:
            async with asyncio.timeout(self._config.first_token_timeout_s):
                if prefill_task is not None:
                    await _wait_prefill_or_first(read, prefill_task, prefill, request_id,
                                                 self._config.stats_interval_s)
                message = await read
            if message is grpc.aio.EOF:
                raise ApiError(500, f"worker {handle.name} ended the request without output", type="server_error")
            return message
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
        finally:
            read.cancel()
        call.cancel()
        self._pool.mark_unreachable(handle)
        self._metrics.worker_retries.inc()
        return None


async def _wait_prefill_or_first(read: asyncio.Future, prefill_task: asyncio.Future, prefill: WorkerHandle,
                                 request_id: str, poll_interval_s: float) -> None:
    """Return once the first token is there or the prefill succeeded; raise _PrefillFailed when the
    prefill failed, or when its worker stopped answering the router's polls (``UNANSWERED_POLLS`` in a
    row: a hung process or a dead link, whose call would only end at its timeout) before either."""
    while True:
        await asyncio.wait({read, prefill_task}, timeout=poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
        if read.done() or (prefill_task.done() and (prefill_task.cancelled() or prefill_task.exception() is None)):
            return
        if prefill_task.done():
            logger.warning("request %s: prefill on %s failed; prefilling locally instead", request_id, prefill.name)
            break
        if prefill.num_unanswered_polls >= UNANSWERED_POLLS:
            logger.warning("request %s: prefill worker %s stopped answering before the request's KV came; "
                           "prefilling locally instead", request_id, prefill.name)
            break
    read.cancel()
    raise _PrefillFailed()


def _log_prefill_outcome(task: asyncio.Future, request_id: str, worker: str) -> None:
    if task.cancelled():
        return
    if (exc := task.exception()) is not None:
        code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
        logger.info("request %s: prefill on %s ended with %s", request_id, worker, code)


async def _rest(call, handle: WorkerHandle):
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise WorkerFailed(f"worker {handle.name} failed mid-request: {exc.code().name}") from None
    finally:
        call.cancel()
