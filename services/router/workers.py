"""The router's view of its workers: gRPC channels, health and stats polling, in-flight counts,
back-off of failing workers and the run-time role of local PD workers (flipped by ``RoleControl``).

The one owner of a ``WorkerHandle``'s fields: a request takes a worker with ``WorkerPool.lease``
(counted in its load, then one of its gRPC streams and, for a hand-off, one of its hand-off slots)
and calls it through ``WorkerPool.generate`` / ``WorkerPool.prefill``, which apply the deadlines and
the retry rule and translate gRPC's errors into this module's exceptions; nothing above this module
sees gRPC."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.config import RouterConfig, WorkerConfig
from services.router.layouts import Announcement, LayoutNegotiation
from services.router.metrics import RouterMetrics
from services.scheduling.backoff import Backoff, BackoffConfig
from services.scheduling.placement import PromptCache, Route, WorkerView, choose_route, pick_least_loaded
from services.security import GrpcSecurity
from services.worker_api import convert
from services.worker_api.types import MAX_RESERVE_WAIT_S, GenerateInput, PrefixUpdate, TokenDelta, WorkerStats

logger = logging.getLogger(__name__)

STREAMS_RESERVED = 8  # of a worker's gRPC stream limit, kept for health, stats and cache lookups
# Failures before a worker's first output that another worker may not have: the request moves on.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.CANCELLED}
# A hand-off not yet answered is prefilled locally once its prefill worker leaves this many polls in a
# row unanswered: one missed poll can be a busy moment, two (at least one stats interval plus the
# poll's timeout apart) are a hang or a dead link.
UNANSWERED_POLLS = 2
MIN_RECHECK_S = 0.25  # a down worker is polled at most this often
HANDOFF_RECHECK_S = 0.05  # a hand-off waiting for a slot another router holds asks the worker again this often
# The finish reasons of an answer the router stands behind (OpenAI's). Anything else a worker ends a
# request with (vLLM's "abort" when its engine dropped the request: a worker stopping past its drain,
# an engine that failed; or "error") is a failure of that worker, never an answer for the client.
FINISHED = frozenset({"stop", "length", "tool_calls"})
# A worker's port is closed while its engine loads (services.engine.serve) or while it restarts; gRPC
# waits longer after each refused connection before it dials again (1 s growing by 1.6x, to 120 s by
# default), and calls fail at once meanwhile: a port closed for 11 s, the worker was seen 5.3-5.8 s
# after it opened (tests/unit/test_router_reconnect.py), 1.0 s with these. A dial each second at most.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000))


class WorkerUnavailable(Exception):
    """A call failed before the worker's first output in a way another worker may not: unreachable,
    a retryable status, or no first token in time. The worker is backed off already."""


class WorkerRejected(Exception):
    """The worker refused the request itself (INVALID_ARGUMENT); the message says why."""


class WorkerError(Exception):
    """The worker failed the call before its first output in a way another worker would not fix."""


class WorkerFailed(Exception):
    """A worker failed after it had already streamed output; ``reason`` names how (the gRPC status in
    lower case, or ``unanswered_polls``). The dispatcher may move the request to another worker."""

    def __init__(self, message: str, reason: str, worker: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.worker = worker


class PrefillFailed(Exception):
    """A hand-off's prefill worker failed, or stopped being usable, before the request's KV came."""


class PrefillBusy(PrefillFailed):
    """The prefill worker refused the hand-off before starting it (RESOURCE_EXHAUSTED: every one of its
    hand-off slots held, by this router or another, or it drains): wait and try again, or go elsewhere."""


class PrefixStreamUnavailable(Exception):
    """A worker's prefix-cache stream could not be opened or ended."""


class RoleConflict(Exception):
    """A role change was refused: another router changed the worker's role first (a stale
    generation), or the worker could not be reached."""


@dataclass(slots=True)
class WorkerHandle:
    config: WorkerConfig
    channel: grpc.aio.Channel
    decode: pb_grpc.DecodeWorkerStub | None
    prefill: pb_grpc.PrefillWorkerStub | None
    stats_stub: object
    health: health_pb2_grpc.HealthStub
    backoff: Backoff
    role: str = "both"  # the worker's run-time role: its own (WorkerStats.role), cached from the last poll
    role_generation: int = 0  # of ``role`` and ``draining`` (0: a worker that does not hold its role)
    tp_size: int = 1  # the engine's tensor-parallel ranks; rank r receives KV at kv_port + r
    draining: bool = False
    healthy: bool = False
    num_in_flight: int = 0
    num_committed_tokens: int = 0
    stats: WorkerStats = field(default_factory=WorkerStats)  # the last GetStats answer, converted
    # Request streams (Generate, Prefill) open at once on the channel, below the worker's stream limit:
    # past that limit the worker refuses new streams (UNAVAILABLE) and its health checks fail with them,
    # so a request waits here for a stream instead.
    streams: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    # Hand-offs this worker prefills at once, until their decode worker's first token (None: no limit);
    # see RouterConfig.max_handoffs_per_prefill_worker.
    handoffs: asyncio.Semaphore | None = None
    # Requests waiting here for one of those slots: the PrfaaS queue the worker's stats cannot show
    # (the threshold controller adds them to its queue; exported as prfaas_router_handoffs_waiting).
    num_handoffs_waiting: int = 0
    # Of those, the ones waiting for one of this router's own slots (the rest wait in the worker's queue,
    # which its stats count: ``num_handoffs_queued``).
    num_handoffs_at_router: int = 0
    # Requests routed to decode here that still wait for their prefill worker's hand-off slot: counted in
    # ``num_in_flight``, but none has reached the worker, and each moves to another decode worker when it
    # gets its slot if this one drains meanwhile, so a drain does not wait for them.
    num_decodes_awaiting_handoff: int = 0
    # Hand-offs this router started on the worker since its last stats answer, which counts them from
    # then on (``stats.num_handoffs``): the router's estimate of the worker's slots between polls.
    num_handoffs_since_poll: int = 0
    num_started_since_poll: int = 0  # requests (leases) this router started on it since its last stats answer
    # The worker refused a hand-off as busy since its last stats answer: wait for the next one.
    handoff_refused: bool = False
    # The worker answers ReserveHandoff (False: an older worker, whose slots are read from its stats).
    reserves: bool = True
    refresh: asyncio.Future | None = None  # a stats call made for the hand-offs waiting here (shared)
    # Polls in a row that the worker did not answer (health check or stats call failed or timed out):
    # a hung process or a dead link, not a worker that answers NOT_SERVING while it drains.
    num_unanswered_polls: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def kv_address(self) -> str:
        return f"{self.config.host}:{self.config.kv_port}"

    @property
    def flippable(self) -> bool:
        """A local PD worker that can take either single role (both stubs, a KV port to receive on)."""
        return (self.config.cluster == "local" and self.config.role in ("prefill", "decode")
                and self.decode is not None and self.prefill is not None and self.config.kv_port is not None)

    def usable(self, now_s: float) -> bool:
        return self.healthy and self.backoff.available(now_s)

    @property
    def feeds_kv(self) -> bool:
        """May prefill a prompt whose KV streams to another worker (a layout producer)."""
        return self.prefill is not None

    @property
    def takes_kv(self) -> bool:
        """May decode a prompt prefilled elsewhere (a layout consumer)."""
        return self.decode is not None and self.config.kv_port is not None

    def view(self, now_s: float, cannot_feed: frozenset[str] = frozenset()) -> WorkerView:
        """Draining workers take no new work in either role."""
        return WorkerView(
            name=self.name,
            healthy=self.usable(now_s),
            role=self.role,
            cluster=self.config.cluster,
            generates=self.decode is not None and self.role != "prefill" and not self.draining,
            prefills=self.prefill is not None and not self.draining,
            receives_kv=self.config.kv_port is not None,
            num_in_flight=self.num_in_flight,
            num_started_since_poll=self.num_started_since_poll,
            num_active=self.stats.num_active_requests,
            num_running=self.stats.num_running_requests,
            num_waiting=self.stats.num_waiting_requests,
            kv_cache_usage=self.stats.kv_cache_usage,
            cannot_feed=cannot_feed,
        )


class Lease:
    """One request's hold on a worker: counted in its load (``num_in_flight`` and the committed
    tokens) from creation, holding one of its request streams after ``acquire_stream`` and one of its
    hand-off slots after ``WorkerPool.acquire_handoff``, until ``release`` (later calls do nothing).
    ``reservation``: the worker's own hand-off slot held for this lease's Prefill (ReserveHandoff)."""

    __slots__ = ("handle", "_num_committed_tokens", "_stream", "_handoff", "_released", "reservation")

    def __init__(self, handle: WorkerHandle, num_committed_tokens: int) -> None:
        self.handle = handle
        self._num_committed_tokens = num_committed_tokens
        self._stream = False
        self._handoff: asyncio.Semaphore | None = None
        self._released = False
        self.reservation = ""
        handle.num_in_flight += 1
        handle.num_started_since_poll += 1
        handle.num_committed_tokens += num_committed_tokens

    async def acquire_stream(self) -> None:
        """Waits for a stream below the worker's limit (see ``WorkerHandle.streams``)."""
        await self.handle.streams.acquire()
        self._stream = True

    async def move_to(self, handle: WorkerHandle) -> None:
        """Counts on ``handle`` from now on, with one of its streams if this lease held one; only before
        any call was made under it (a request whose decode worker began to drain while it waited for a
        hand-off slot decodes elsewhere)."""
        stream, self._stream = self._stream, False
        if stream:
            self.handle.streams.release()
        self.handle.num_in_flight -= 1
        self.handle.num_committed_tokens -= self._num_committed_tokens
        self.handle = handle
        handle.num_in_flight += 1
        handle.num_started_since_poll += 1
        handle.num_committed_tokens += self._num_committed_tokens
        if stream:
            await self.acquire_stream()

    def release_handoff(self) -> None:
        """The hand-off slot goes back once, by whichever comes first: the decode worker's first
        token, or the end of the prefill call."""
        if self._handoff is not None:
            slots, self._handoff = self._handoff, None
            slots.release()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.release_handoff()
        if self._stream:
            self.handle.streams.release()
        self.handle.num_in_flight -= 1
        self.handle.num_committed_tokens -= self._num_committed_tokens


class GenerateCall:
    """A Generate stream on one worker; its gRPC errors become this module's exceptions here."""

    def __init__(self, pool: "WorkerPool", handle: WorkerHandle, call, request_id: str) -> None:
        self._pool = pool
        self._handle = handle
        self._call = call
        self._request_id = request_id

    def cancel(self) -> None:
        """Cancels the call, which aborts the request on the worker."""
        self._call.cancel()

    async def first(self, prefill: "PrefillCall | None" = None) -> TokenDelta:
        """The first delta, within ``first_token_timeout_s``. With ``prefill`` (a hand-off), raises
        PrefillFailed when the prefill fails first. Raises WorkerUnavailable (the worker is backed
        off and the call cancelled), WorkerRejected or WorkerError."""
        config = self._pool.config
        read = asyncio.ensure_future(self._call.read())
        try:
            async with asyncio.timeout(config.first_token_timeout_s):
                if prefill is not None:
                    await prefill.wait_unless_first(read, self._request_id, config.stats_interval_s)
                message = await read
            if message is grpc.aio.EOF:
                raise WorkerError(f"worker {self._handle.name} ended the request without output")
            delta = convert.delta_from_proto(message)
            if delta.finish_reason is None or delta.finish_reason in FINISHED:
                self._pool.mark_reachable(self._handle)
                return delta
            logger.warning("request %s: worker %s ended the request before its first token (%s)", self._request_id,
                           self._handle.name, delta.finish_reason)
        except TimeoutError:
            logger.warning("request %s: worker %s gave no first token in %.0f s", self._request_id,
                           self._handle.name, config.first_token_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise WorkerRejected(exc.details()) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # draining or flipped: another worker
                logger.info("request %s: worker %s takes no new request (%s); trying another", self._request_id,
                            self._handle.name, exc.details())
                self.cancel()
                raise WorkerUnavailable(self._handle.name) from None
            if exc.code() not in RETRYABLE:
                raise WorkerError(f"worker error: {exc.details()}") from None
            logger.warning("request %s: worker %s failed before the first token: %s", self._request_id,
                           self._handle.name, exc.code().name)
        finally:
            read.cancel()
        self.cancel()
        self._pool.mark_unreachable(self._handle)
        self._pool.metrics.worker_retries.inc()
        raise WorkerUnavailable(self._handle.name)

    async def rest(self) -> AsyncIterator[TokenDelta]:
        """The deltas after the first; raises WorkerFailed when the worker fails meanwhile: its call
        ends with an error, or it leaves ``UNANSWERED_POLLS`` of the router's polls in a row
        unanswered while the stream waits (a hung process or a dead link). Either backs it off. A request
        past its deadline (``request_timeout_s``) ends with WorkerFailed naming no worker: it does not move."""
        name = self._handle.name
        try:
            while (message := await self._next()) is not grpc.aio.EOF:
                delta = convert.delta_from_proto(message)
                if delta.finish_reason is not None and delta.finish_reason not in FINISHED:
                    if delta.text or delta.token_ids:  # what it generated stands; only the end does not
                        yield dataclasses.replace(delta, finish_reason=None)
                    raise WorkerFailed(f"worker {name} ended the request unfinished ({delta.finish_reason})",
                                       delta.finish_reason, name)
                yield delta
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the request's own deadline, not the worker's fault
                raise WorkerFailed(f"the request ran past router.request_timeout_s "
                                   f"({self._pool.config.request_timeout_s:g} s) on worker {name}",
                                   "deadline_exceeded", "") from None
            self._pool.mark_unreachable(self._handle)
            raise WorkerFailed(f"worker {name} failed mid-request: {exc.code().name}", exc.code().name.lower(),
                               name) from None
        finally:
            self._call.cancel()

    async def _next(self):
        read = asyncio.ensure_future(self._call.read())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self._pool.config.stats_interval_s)
                if done:
                    return read.result()
                if self._handle.num_unanswered_polls >= UNANSWERED_POLLS:
                    self._pool.mark_unreachable(self._handle)
                    raise WorkerFailed(f"worker {self._handle.name} stopped answering mid-request", "unanswered_polls",
                                       self._handle.name)
        finally:
            read.cancel()


class PrefillCall:
    """A hand-off's Prefill call on a prefill worker, which owns the worker's lease until it ends."""

    def __init__(self, call, task: asyncio.Future, handle: WorkerHandle) -> None:
        self._call = call
        self._task = task
        self._handle = handle

    def cancel(self) -> None:
        self._call.cancel()

    async def wait_unless_first(self, read: asyncio.Future, request_id: str, poll_interval_s: float) -> None:
        """Return once the first token is there or the prefill succeeded; raise PrefillFailed when the
        prefill failed, or when its worker stopped answering the router's polls (``UNANSWERED_POLLS`` in
        a row: a hung process or a dead link, whose call would only end at its timeout) before either."""
        task, name = self._task, self._handle.name
        while True:
            await asyncio.wait({read, task}, timeout=poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
            if read.done() or (task.done() and (task.cancelled() or task.exception() is None)):
                return
            if task.done():
                exc = task.exception()
                why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    logger.info("request %s: prefill worker %s is busy (%s)", request_id, name, why)
                    self._handle.handoff_refused = True
                    read.cancel()
                    raise PrefillBusy()
                logger.warning("request %s: prefill on %s failed (%s); prefilling locally instead", request_id, name,
                               why)
                break
            if self._handle.num_unanswered_polls >= UNANSWERED_POLLS:
                logger.warning("request %s: prefill worker %s stopped answering before the request's KV came; "
                               "prefilling locally instead", request_id, name)
                break
        read.cancel()
        raise PrefillFailed()


class WorkerPool:
    def __init__(self, workers: tuple[WorkerConfig, ...], config: RouterConfig, metrics: RouterMetrics,
                 backoff: BackoffConfig = BackoffConfig(), flippable: bool = False,
                 kv_high_watermark: float = 0.9, clock: Callable[[], float] = time.monotonic,
                 security: GrpcSecurity = GrpcSecurity(), tp_sizes: dict[str, int] | None = None) -> None:
        """``flippable``: role flips are on, so single-role local PD workers get both stubs;
        ``tp_sizes``: each worker's engine TP size where above 1 (from the deployment config)."""
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self.kv_high_watermark = kv_high_watermark
        self._handles = {w.name: _connect(w, backoff, flippable, security, config.max_handoffs_per_prefill_worker)
                         for w in workers}
        for name, size in (tp_sizes or {}).items():
            self._handles[name].tp_size = size
        self.layouts = LayoutNegotiation(metrics)
        self._poller: asyncio.Task | None = None
        self.on_poll: list[Callable[[], Awaitable[None] | None]] = []
        # how often a down worker is polled between the full polls: the first back-off's length
        self.recheck_s = min(config.stats_interval_s, max(backoff.base_s, MIN_RECHECK_S))

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await asyncio.gather(*(h.channel.close() for h in self._handles.values()))

    @property
    def handles(self) -> tuple[WorkerHandle, ...]:
        return tuple(self._handles.values())

    def is_usable(self, handle: WorkerHandle) -> bool:
        """Healthy and not backing off, now."""
        return handle.usable(self._clock())

    def views(self) -> tuple[WorkerView, ...]:
        now_s = self._clock()
        return tuple(h.view(now_s, self.layouts.refused(h.name)) for h in self._handles.values())

    def route(self, incremental_prefill_tokens: int, threshold_tokens: float, exclude: frozenset[str] = frozenset(),
              *, cache: PromptCache | None = None, scarce: bool = False) -> Route | None:
        return choose_route(self.views(), incremental_prefill_tokens, threshold_tokens, exclude, cache=cache,
                            scarce=scarce, kv_high_watermark=self.kv_high_watermark)

    def handle(self, name: str) -> WorkerHandle:
        return self._handles[name]

    def replacement_decode(self, prefill: WorkerHandle, current: WorkerHandle, path: str) -> WorkerHandle | None:
        """The decode worker for a hand-off whose chosen one (``current``) began to drain, or was flipped
        to prefill, while the request waited for ``prefill``'s slot: the least loaded other one of its
        cluster that takes KV ``prefill`` can feed (a PD-D worker on the ``pd`` path); None if none."""
        views = self.views()
        refused = next(v.cannot_feed for v in views if v.name == prefill.name)
        candidates = tuple(v for v in views if v.receives_kv and v.cluster == current.config.cluster
                           and v.name != current.name and v.name not in refused
                           and (path != "pd" or v.role == "decode"))
        name = pick_least_loaded(candidates, kv_high_watermark=self.kv_high_watermark)
        return None if name is None else self._handles[name]

    @property
    def config(self) -> RouterConfig:
        return self._config

    @property
    def metrics(self) -> RouterMetrics:
        return self._metrics

    def lease(self, name: str, num_committed_tokens: int = 0) -> Lease:
        """Counts a request in worker ``name``'s load until the lease is released."""
        return Lease(self._handles[name], num_committed_tokens)

    async def acquire_handoff(self, lease: Lease, request_id: str) -> None:
        """Waits for one of the leased prefill worker's hand-off slots
        (RouterConfig.max_handoffs_per_prefill_worker): this router's own, then one of its request
        streams, then the worker's own slot, reserved in the worker's queue, which every router shares
        first come first served. Raises PrefillFailed when the worker stops being usable (failed health
        checks) or drains while this waits."""
        handle = lease.handle
        gauge = self._metrics.handoffs_waiting.labels(handle.name)
        handle.num_handoffs_waiting += 1
        gauge.set(handle.num_handoffs_waiting)
        try:
            if handle.handoffs is not None:
                await self._own_slot(lease, handle.handoffs, request_id)
            await lease.acquire_stream()
            await self._hold_worker_slot(lease, request_id)
        finally:
            handle.num_handoffs_waiting -= 1
            gauge.set(handle.num_handoffs_waiting)

    async def _own_slot(self, lease: Lease, slots: asyncio.Semaphore, request_id: str) -> None:
        """One of this router's slots for the worker, first come first served: the one wait stays in the
        semaphore's queue while the worker's health is checked every stats interval (a wait cancelled
        and begun again would go to the back of the queue)."""
        handle = lease.handle
        acquire = asyncio.ensure_future(slots.acquire())
        handle.num_handoffs_at_router += 1
        try:
            while not (await asyncio.wait({acquire}, timeout=self._config.stats_interval_s))[0]:
                if not self.is_usable(handle):
                    logger.warning("request %s: prefill worker %s stopped answering while the request waited for "
                                   "it; prefilling locally instead", request_id, handle.name)
                    raise PrefillFailed()
                if handle.draining:
                    logger.info("request %s: prefill worker %s drains for a role flip; prefilling locally instead",
                                request_id, handle.name)
                    raise PrefillFailed()
            acquire.result()
            lease._handoff = slots
        finally:
            handle.num_handoffs_at_router -= 1
            if not acquire.done():
                acquire.cancel()
            elif lease._handoff is None and not acquire.cancelled() and acquire.exception() is None:
                slots.release()  # taken just as this wait was given up

    async def _hold_worker_slot(self, lease: Lease, request_id: str) -> None:
        """The worker's own slot (its stats say it has a limit): reserved in the worker's queue, which
        serves every router first come first served; the Prefill names the reservation."""
        handle = lease.handle
        if handle.handoff_refused or not handle.stats.max_handoffs or not handle.reserves:
            await self._wait_for_worker_slot(lease, request_id)  # its next stats say why it refused
            return
        wait_s = min(self._config.request_timeout_s, MAX_RESERVE_WAIT_S)
        call = handle.prefill.ReserveHandoff(convert.reserve_handoff_request(request_id, wait_s),
                                             timeout=wait_s + self._config.connect_timeout_s)
        task = asyncio.ensure_future(call)
        try:
            while not (await asyncio.wait({task}, timeout=self._config.stats_interval_s))[0]:
                if not self.is_usable(handle):
                    logger.warning("request %s: prefill worker %s stopped answering while the request waited for "
                                   "it; prefilling locally instead", request_id, handle.name)
                    raise PrefillFailed()
            lease.reservation = task.result().reservation_id
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                logger.info("worker %s reserves no hand-off slots (an older worker); its stats are read instead",
                            handle.name)
                handle.reserves = False
                await self._wait_for_worker_slot(lease, request_id)
                return
            logger.info("request %s: prefill worker %s gave no hand-off slot (%s: %s); prefilling locally instead",
                        request_id, handle.name, exc.code().name, exc.details())
            raise PrefillFailed() from None
        finally:
            call.cancel()  # a wait given up leaves the worker's queue

    async def _wait_for_worker_slot(self, lease: Lease, request_id: str) -> None:
        """A worker without ReserveHandoff whose slots other routers hold: wait until its last reported
        count plus the hand-offs this router started since then leaves one free (the worker refuses the
        rest anyway)."""
        handle = lease.handle
        while handle.handoff_refused or (handle.stats.max_handoffs and handle.stats.num_handoffs
                                         + handle.num_handoffs_since_poll >= handle.stats.max_handoffs):
            await asyncio.sleep(HANDOFF_RECHECK_S)
            await self._refresh(handle)
            if handle.draining:
                logger.info("request %s: prefill worker %s drains for a role flip; prefilling locally instead",
                            request_id, handle.name)
                raise PrefillFailed()
            if not self.is_usable(handle):
                logger.warning("request %s: prefill worker %s stopped answering while the request waited for it; "
                               "prefilling locally instead", request_id, handle.name)
                raise PrefillFailed()
        handle.num_handoffs_since_poll += 1

    def generate(self, lease: Lease, request: GenerateInput) -> GenerateCall:
        """Starts the request's Generate stream on the leased worker, with the request deadline."""
        handle = lease.handle
        call = handle.decode.Generate(convert.generate_input_to_proto(request), timeout=self._config.request_timeout_s)
        return GenerateCall(self, handle, call, request.request_id)

    def prefill(self, lease: Lease, request: GenerateInput, decode: WorkerHandle) -> PrefillCall:
        """Starts the request's Prefill on the leased worker, streaming its KV to ``decode``. The call
        owns the lease from here: it is released, and the outcome recorded, when the call ends."""
        handle = lease.handle
        call = handle.prefill.Prefill(convert.prefill_request_to_proto(request, decode.kv_address, decode.tp_size,
                                                                       lease.reservation),
                                      timeout=self._config.request_timeout_s)
        task = asyncio.ensure_future(call)
        task.add_done_callback(lambda done: self._prefill_done(done, request.request_id, lease))
        return PrefillCall(call, task, handle)

    def _prefill_done(self, task: asyncio.Future, request_id: str, lease: Lease) -> None:
        lease.release()
        handle = lease.handle
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.mark_reachable(handle)
            return
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        logger.info("request %s: prefill on %s ended with %s", request_id, handle.name,
                    code.name if code is not None else type(exc).__name__)
        if code == grpc.StatusCode.UNAVAILABLE:
            self.mark_unreachable(handle)

    def mark_unreachable(self, handle: WorkerHandle) -> None:
        """Called when a call failed to reach the worker: it is skipped for a back-off (growing with
        each failure) and until a poll finds it healthy again."""
        wait = handle.backoff.fail(self._clock())
        if handle.healthy:
            logger.warning("worker %s unreachable; routing around it for %.1f s", handle.name, wait)
        handle.healthy = False
        self._metrics.worker_up.labels(handle.name).set(0)
        self._metrics.worker_backoff.labels(handle.name).set(wait)

    def mark_reachable(self, handle: WorkerHandle) -> None:
        """Called when a call to the worker succeeded: its back-off starts over."""
        if handle.backoff.num_failures:
            handle.backoff.succeed()
            self._metrics.worker_backoff.labels(handle.name).set(0)

    def any_healthy(self) -> bool:
        return pick_least_loaded(self.views()) is not None

    async def poll_once(self) -> None:
        """Refresh every worker's health and stats, then run the ``on_poll`` callbacks."""
        await asyncio.gather(*(self._poll(h) for h in self._handles.values()))
        self.negotiate_layouts()
        for callback in self.on_poll:
            try:
                if (pending := callback()) is not None:
                    await pending
            except Exception:  # one callback's bug must not stop the polls the routes depend on
                logger.exception("poll callback %r failed", callback)

    def negotiate_layouts(self) -> None:
        """Judge the layouts the serving workers announced in their last stats (see ``layouts``)."""
        serving = [h for h in self._handles.values() if h.healthy]
        announced = {h.name: Announcement(h.stats.layout_spec, h.stats.kv_protocol_version) for h in serving}
        self.layouts.update({h.name: announced[h.name] for h in serving if h.feeds_kv},
                            {h.name: announced[h.name] for h in serving if h.takes_kv})

    async def _poll_forever(self) -> None:
        """Every worker each ``stats_interval_s``; between those, every ``recheck_s``, the workers that
        are down and carry no request (one starting up, or back after a crash), so that a long stats
        interval does not keep a serving worker out of the routes for that long."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._config.stats_interval_s
            while due - loop.time() > self.recheck_s:
                await asyncio.sleep(self.recheck_s)
                await self.recheck_down()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await self.poll_once()

    async def recheck_down(self) -> None:
        """Poll the workers that are down and carry no request; a worker with a stream in flight is
        left to the full poll, whose unanswered polls in a row say it hung (``UNANSWERED_POLLS``)."""
        down = [h for h in self._handles.values() if not h.healthy and h.num_in_flight == 0]
        if not down:
            return
        await asyncio.gather(*(self._poll(h) for h in down))
        if any(h.healthy for h in down):
            self.negotiate_layouts()

    async def _poll(self, handle: WorkerHandle) -> None:
        timeout = self._config.connect_timeout_s
        try:
            health = await handle.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            handle.stats = convert.stats_from_proto(await handle.stats_stub.GetStats(convert.stats_request(),
                                                                                     timeout=timeout))
            handle.num_handoffs_since_poll, handle.num_started_since_poll, handle.handoff_refused = 0, 0, False
            self._take_role(handle, handle.stats.role, handle.stats.draining, handle.stats.role_generation)
            healthy = health.status == health_pb2.HealthCheckResponse.SERVING
            handle.num_unanswered_polls = 0
        except grpc.aio.AioRpcError:
            healthy = False
            handle.num_unanswered_polls += 1
        if healthy != handle.healthy:
            logger.info("worker %s is %s", handle.name, "healthy" if healthy else "not serving")
        handle.healthy = healthy
        self._export(handle)

    async def _refresh(self, handle: WorkerHandle) -> None:
        """The worker's stats now rather than at the next full poll (a slot another router freed is seen
        within HANDOFF_RECHECK_S, not a stats interval): one call at a time, shared by every waiter."""
        if handle.refresh is None or handle.refresh.done():
            handle.refresh = asyncio.ensure_future(self._poll(handle))
        await asyncio.shield(handle.refresh)

    async def set_role(self, handle: WorkerHandle, role: str, draining: bool) -> None:
        """Asks the worker to take ``role`` (and drain or not), compare-and-set on the generation this
        router last saw; raises RoleConflict when it refuses (another router changed it first) or cannot
        be reached. The worker's answer is the new truth, cached here at once."""
        try:
            state = await handle.decode.SetRole(convert.set_role_request(handle.role_generation, role, draining),
                                                timeout=self._config.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise RoleConflict(f"worker {handle.name} refused the role change: {exc.code().name}: "
                               f"{exc.details()}") from None
        self._take_role(handle, state.role, state.draining, state.generation)

    async def watch_prefix_cache(self, handle: WorkerHandle) -> AsyncIterator[PrefixUpdate]:
        """The worker's prefix-cache stream (a snapshot, then deltas); raises PrefixStreamUnavailable when
        it cannot be opened or ends."""
        call = handle.stats_stub.WatchPrefixCache(convert.watch_prefix_cache_request())
        try:
            async for message in call:
                yield convert.prefix_update_from_proto(message)
        except grpc.aio.AioRpcError as exc:
            raise PrefixStreamUnavailable(f"{exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()
        raise PrefixStreamUnavailable("the stream ended")

    @staticmethod
    def _take_role(handle: WorkerHandle, role: str, draining: bool, generation: int) -> None:
        """The worker's role state, unless this router holds a newer one (an answer that crossed a poll)."""
        if generation and generation >= handle.role_generation:
            handle.role, handle.draining, handle.role_generation = role, draining, generation

    def _export(self, handle: WorkerHandle) -> None:
        self._metrics.worker_up.labels(handle.name).set(1 if handle.healthy else 0)
        self._metrics.worker_running.labels(handle.name).set(handle.stats.num_running_requests)
        self._metrics.worker_kv_usage.labels(handle.name).set(handle.stats.kv_cache_usage)
        self._metrics.observe_kv_links(handle.name, handle.stats)


def _connect(worker: WorkerConfig, backoff: BackoffConfig, flippable: bool, security: GrpcSecurity,
             max_handoffs: int) -> WorkerHandle:
    channel = security.aio_channel(f"{worker.host}:{worker.port}", options=RECONNECT_OPTIONS)
    decode = pb_grpc.DecodeWorkerStub(channel) if worker.service == "decode_worker" else None
    prefills = worker.service == "prefill_worker" or worker.role in ("prefill", "both") or (
        flippable and decode is not None and worker.kv_port is not None)
    prefill = pb_grpc.PrefillWorkerStub(channel) if prefills else None
    return WorkerHandle(
        config=worker,
        channel=channel,
        decode=decode,
        prefill=prefill,
        stats_stub=decode or prefill,
        health=health_pb2_grpc.HealthStub(channel),
        backoff=Backoff(backoff),
        role=worker.role,
        streams=asyncio.Semaphore(max(1, security.max_concurrent_streams - STREAMS_RESERVED)),
        handoffs=asyncio.Semaphore(max_handoffs) if prefill is not None and max_handoffs > 0 else None,
    )
