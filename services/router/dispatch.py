"""Run one generation on the workers: choose the route, start the prefill hand-off, stream tokens.

Before the first token nothing is lost yet, so failures there are retried: an unreachable decode
worker is replaced by another one, and a failed remote prefill falls back to a local prefill on
the same decode worker. After the first token, a decode worker's failure moves the request to another
worker with the tokens generated so far (``continuation``), and the client's stream goes on.

The workers' state and their calls belong to ``workers.WorkerPool`` (leases, deadlines, the retry
rule, gRPC's errors); the routing decision to ``placement.Placement``. This module sequences them
and raises domain errors, which the HTTP layer turns into responses.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

from services.config import RouterConfig
from services.kv_connector.params import consume
from services.router.admission import PrefillQueues
from services.router.continuation import Continuation, Detokenize, StopScan
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.worker_api.resume import resume_problem
from services.router.workers import (GenerateCall, Lease, PrefillBusy, PrefillFailed, WorkerError, WorkerFailed,
                                     WorkerPool, WorkerRejected, WorkerUnavailable)
from services.scheduling.placement import PromptCache, Route
from services.worker_api.types import GenerateInput, TokenDelta


logger = logging.getLogger(__name__)


class NoWorkerAvailable(Exception):
    """Every worker the request could go to failed before its first token, or none can take it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A request's one routing decision, made before admission (which reads its path) and served by
    :meth:`Dispatcher.generate`; only a retry after a failed worker routes again."""

    cache: PromptCache
    block_hashes: list[bytes]
    route: Route | None


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, metrics: RouterMetrics, placement: Placement,
                 queues: PrefillQueues | None = None, detokenize: Detokenize | None = None) -> None:
        """``detokenize``: the model's detokenizer, for the text a failed worker held back (without
        it, a moved request may lose the few characters a stop string's margin held)."""
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._queues = queues
        self._placement = placement
        self._detokenize = detokenize
        self.on_request: list[Callable[[int], None]] = []

    async def plan(self, request: GenerateInput, exclude: frozenset[str] = frozenset()) -> Plan:
        """What is cached of the prompt and where the request goes (None: no worker can take it)."""
        cache, block_hashes = await self._placement.prompt_cache(request.prompt_token_ids)
        return Plan(cache, block_hashes, self._route(request, cache, block_hashes, exclude))

    def _route(self, request: GenerateInput, cache: PromptCache, block_hashes: list[bytes],
               exclude: frozenset[str]) -> Route | None:
        """The placement's route; a request that asks for prompt logprobs prefills on its decode worker: they
        need the logits of every prompt position on one engine, and a hand-off's prefill leaves the last
        position to the decode worker (services/kv_connector/scheduler.py)."""
        route = self._placement.route(request.request_id, cache, block_hashes, exclude)
        if route is not None and route.prefill is not None and request.sampling.prompt_logprobs is not None:
            return Route("local", route.decode)
        return route

    async def generate(self, request: GenerateInput, plan: Plan | None = None) -> AsyncIterator[TokenDelta]:
        """Yields the request's deltas on ``plan``'s route (planned here when not given). Raises
        NoWorkerAvailable, WorkerRejected or WorkerError before the first delta. When the decode worker
        fails after it, the request moves to another worker (at most ``max_migrations`` times) and the
        stream goes on; WorkerFailed when it cannot. Each ``on_request`` callback first gets the
        prompt's length (once per request, not per retry or move).

        Closing the iterator cancels the gRPC calls, which aborts the request on the workers.
        """
        for callback in self.on_request:
            callback(len(request.prompt_token_ids))
        plan = plan or await self.plan(request)
        progress = Continuation(request, self._detokenize)
        failed: set[str] = set()
        current, moved_by, scan = request, None, None
        while True:
            try:
                async for delta in self._serve(current, plan, failed, moved_by):
                    if scan is not None:
                        delta = scan.feed(progress.resumed(delta))
                    progress.record(delta)
                    yield delta
                    if scan is not None and scan.stopped:
                        return
                return
            except WorkerFailed as failure:
                if not failure.worker:  # a move that found no worker to go on
                    raise
                failed.add(failure.worker)
                following, moved_by = self._move(progress, failure), failure.reason
            if following is None:  # every token was out already: only the stream's end was lost
                yield TokenDelta(progress.held_text(), (), "length", progress.num_prompt_tokens,
                                 progress.num_cached_tokens)
                return
            current = following
            scan = StopScan(request.sampling.stop, progress.held_text())
            plan = await self.plan(current, exclude=frozenset(failed))

    def _move(self, progress: Continuation, failure: WorkerFailed) -> GenerateInput | None:
        """The request another worker goes on with after ``failure`` (None: no token is left to
        generate); raises ``failure`` when the request may not move again."""
        if progress.num_moves >= self._config.max_migrations:
            self._metrics.migrations.labels(failure.reason, "limit").inc()
            raise failure
        if progress.token_ids and (problem := resume_problem(progress.request.sampling)) is not None:
            self._metrics.migrations.labels(failure.reason, "inexact").inc()
            raise WorkerFailed(f"{failure}; the request cannot move to another worker exactly: {problem}",
                               failure.reason, "")
        following = progress.next_input()
        if following is None:
            self._metrics.migrations.labels(failure.reason, "finished").inc()
            return None
        logger.warning("request %s: %s after %d tokens; moving it to another worker (move %d)",
                       progress.request.request_id, failure, len(progress.token_ids), progress.num_moves)
        return following

    async def _serve(self, request: GenerateInput, plan: Plan, exclude: set[str],
                     moved_by: str | None) -> AsyncIterator[TokenDelta]:
        """One worker's deltas: the planned route, or another one while workers fail before their first
        token (``max_attempts`` in all). Raises WorkerFailed after the first delta, and instead of
        NoWorkerAvailable, WorkerRejected or WorkerError for a request that moved (``moved_by``: the
        reason), whose client has its first tokens already."""
        try:
            async for delta in self._attempts(request, plan, exclude):
                if moved_by is not None:
                    self._metrics.migrations.labels(moved_by, "resumed").inc()
                    moved_by = None
                yield delta
        except (NoWorkerAvailable, WorkerRejected, WorkerError) as exc:
            if moved_by is None:
                raise
            self._metrics.migrations.labels(moved_by, "failed").inc()
            raise WorkerFailed(f"no worker could continue the request: {exc}", moved_by, "") from None

    async def _attempts(self, request: GenerateInput, plan: Plan, exclude: set[str]) -> AsyncIterator[TokenDelta]:
        tried = set(exclude)
        num_tokens = len(request.prompt_token_ids)
        num_committed = num_tokens + request.sampling.max_tokens
        for attempt in range(self._config.max_attempts):
            route = plan.route if attempt == 0 else \
                self._route(request, plan.cache, plan.block_hashes, frozenset(tried))
            if route is None:
                break
            tried.add(route.decode)
            decode = self._pool.lease(route.decode, num_committed)
            queued = self._enqueue(route.path, num_tokens)
            try:
                await decode.acquire_stream()
                try:
                    call, first = await self._start(request, route, decode)
                except WorkerUnavailable:
                    continue
                if queued:
                    queued = False
                    self._queues.dequeue(route.path, num_tokens, prefilled=True)
                yield first
                async for delta in call.rest():
                    yield delta
                return
            finally:
                decode.release()
                if queued:
                    self._queues.dequeue(route.path, num_tokens, prefilled=False)
        raise NoWorkerAvailable("No worker is available to serve this request; try again later")

    def _enqueue(self, path: str, num_tokens: int) -> bool:
        if self._queues is None:
            return False
        self._queues.enqueue(path, num_tokens)
        return True

    async def _start(self, request: GenerateInput, route: Route, decode: Lease) -> tuple[GenerateCall, TokenDelta]:
        """The call and its first delta; a failed hand-off falls back to a local prefill."""
        if route.prefill is not None:
            handoff, num_busy = request, 0
            while True:
                try:
                    return await self._start_with_handoff(handoff, route, decode)
                except PrefillBusy:  # another router took the worker's last slot: the pool waits for a free one
                    # a new request and KV transfer id: the decode worker may still hold the cancelled ones
                    num_busy += 1
                    handoff = dataclasses.replace(request, request_id=f"{request.request_id}-busy{num_busy}")
                except PrefillFailed:
                    break
            self._metrics.prefill_fallbacks.inc()
        self._metrics.routed.labels("local").inc()
        call = self._pool.generate(decode, request)
        try:
            return call, await call.first()
        except BaseException:
            call.cancel()
            raise

    async def _leave_a_draining_decode_worker(self, request_id: str, route: Route, prefill: Lease,
                                              decode: Lease) -> None:
        """A request holds its decode worker from the moment it is routed. If that worker began to drain
        for a role flip (or was flipped to prefill) while the request waited for its hand-off slot, the
        request decodes on another one and keeps the slot: the drain does not wait for it, and the worker
        does not refuse it once the request finally reaches it (every router's requests alike; the
        deciding router's drain would otherwise wait for its own such requests only)."""
        handle = decode.handle
        if not (handle.draining or handle.role == "prefill"):
            return
        other = self._pool.replacement_decode(prefill.handle, handle, route.path)
        if other is None:
            return
        logger.info("request %s: decode worker %s drains for a role flip; it decodes on %s instead", request_id,
                    handle.name, other.name)
        await decode.move_to(other)

    async def _start_with_handoff(self, request: GenerateInput, route: Route,
                                  decode: Lease) -> tuple[GenerateCall, TokenDelta]:
        """The decode worker waits for KV that the prefill worker streams to it."""
        # a hand-off waiting for its turn is the prefill worker's load already
        prefill = self._pool.lease(route.prefill)
        try:
            waiting = decode.handle
            waiting.num_decodes_awaiting_handoff += 1
            try:
                await self._pool.acquire_handoff(prefill, request.request_id)  # and one of its streams
            finally:
                waiting.num_decodes_awaiting_handoff -= 1
            await self._leave_a_draining_decode_worker(request.request_id, route, prefill, decode)
            self._metrics.routed.labels(route.path).inc()
            consumer = dataclasses.replace(request, kv_transfer=consume(request.request_id))
            call = self._pool.generate(decode, consumer)
            prefill_call = self._pool.prefill(prefill, request, decode.handle)  # owns the lease from here
        except BaseException:
            prefill.release()
            raise
        try:
            first = await call.first(prefill_call)
        except BaseException:
            call.cancel()
            prefill_call.cancel()
            raise
        finally:
            prefill.release_handoff()  # the decode worker's reservation is in use now, or gone
        return call, first
