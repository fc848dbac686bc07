"""What every worker answers, whatever its service: a Prefill call (a PrfaaS prefill worker serves
it, and so does a PD worker, which the router may flip to prefill) and the stats message both
services answer ``GetStats`` with. Converts protobuf and calls the engine; each service's servicer
(services/prefill_worker/server.py, services/decode_worker/server.py) delegates here."""
from __future__ import annotations

import contextlib
import logging
import time

import grpc
from prfaas.v1 import worker_pb2 as pb

from services.engine.engine import Engine
from services.engine.kv_sends import KvSendFailed, KvSendWatch
from services.engine.serve import CallerGuard, WorkerIdentity
from services.engine.worker_state import Busy, NotFlippable, StaleGeneration
from services.kv_transport import PROTOCOL_VERSION as KV_PROTOCOL_VERSION
from services.kv_transport.telemetry import TransportSnapshot
from services.logs import bind_request_id
from services.worker_api import convert
from services.worker_api.types import MAX_RESERVE_WAIT_S

logger = logging.getLogger(__name__)


class WorkerServicer:
    """What every servicer of a worker holds, and its ``GetStats`` (both worker APIs have it)."""

    def __init__(self, engine: Engine, identity: WorkerIdentity, guard: CallerGuard) -> None:
        self._engine = engine
        self._identity = identity
        self._guard = guard

    async def GetStats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return stats_message(self._engine, self._identity, self._guard)

    async def WatchPrefixCache(self, request: pb.WatchPrefixCacheRequest, context):
        """A snapshot of the engine's prefix cache, then its changes; ends RESOURCE_EXHAUSTED when the
        caller fell ``SUBSCRIBER_QUEUE`` updates behind (it calls again for a new snapshot)."""
        index = self._guard.prefix_cache
        if index is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker publishes no prefix cache events "
                                "(engine.enable_prefix_caching is off)")
        subscriber, snapshot = index.subscribe()
        try:
            for update in snapshot:
                yield convert.prefix_update_to_proto(update)
            while not subscriber.overflowed:
                yield convert.prefix_update_to_proto(await subscriber.updates.get())
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefix cache updates fell behind; call again")
        finally:
            index.unsubscribe(subscriber)

    async def SetRole(self, request: pb.SetRoleRequest, context) -> pb.RoleState:
        """Compare-and-set of the run-time role: FAILED_PRECONDITION for a stale generation or a worker
        that does not flip, INVALID_ARGUMENT for an unknown role."""
        roles = self._guard.roles
        try:
            state = roles.compare_and_set(request.expected_generation, request.role, request.draining)
        except StaleGeneration as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except NotFlippable as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT if request.role not in ("prefill", "decode") \
                else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, str(exc))
        if state.draining:  # hand-offs waiting for a slot go elsewhere now
            self._guard.handoffs.refuse_waiters("the worker is draining for a role flip")
        logger.info("role set by %s: %s%s (generation %d)", context.peer(), state.role,
                    ", draining" if state.draining else "", state.generation)
        return pb.RoleState(role=state.role, draining=state.draining, generation=state.generation)


class PrefillServicer(WorkerServicer):
    """PrefillWorker's calls, which a PrfaaS prefill worker and a PD worker both serve."""

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        return await prefill(self._engine, self._guard, request, context)

    async def ReserveHandoff(self, request: pb.ReserveHandoffRequest, context) -> pb.HandoffReservation:
        return await reserve_handoff(self._guard, request, context)


async def prefill(engine: Engine, guard: CallerGuard, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
    """Computes the prompt's KV (one output token), streaming it to ``kv_target``, which must be a
    worker KV port of the deployment (PERMISSION_DENIED otherwise, before anything is dialled).
    Returns when the prefill is done and its KV has left for ``kv_target``; ABORTED as soon as the
    KV transfer failed at the sender (``kv_sends``): the router then prefills the request itself."""
    bind_request_id(request.request_id)
    if not request.prompt_token_ids:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
    tp_size = max(1, request.kv_target_tp_size)
    if request.kv_target and (why := guard.kv_targets.refusal(request.kv_target, tp_size)) is not None:
        guard.rejections.count("unknown_peer")
        logger.warning("request %s: refused Prefill from %s: %s", request.request_id, context.peer(), why)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
    try:  # RESOURCE_EXHAUSTED before anything starts: the router waits or goes elsewhere
        guard.roles.check_prefill()
        with guard.handoffs.held(request.handoff_reservation) if request.kv_target else contextlib.nullcontext():
            return await _prefill(engine, request, context)
    except Busy as exc:
        guard.handoffs.cancel(request.handoff_reservation)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


async def reserve_handoff(guard: CallerGuard, request: pb.ReserveHandoffRequest, context) -> pb.HandoffReservation:
    """One hand-off slot held for the Prefill that names it (services/engine/worker_state.HandoffSlots):
    waits in the worker's one queue up to ``wait_s``; RESOURCE_EXHAUSTED after that, or at once while
    the worker drains."""
    bind_request_id(request.request_id)
    if not 0 <= request.wait_s <= MAX_RESERVE_WAIT_S:  # also NaN
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"wait_s must be from 0 to {MAX_RESERVE_WAIT_S:g} seconds, not {request.wait_s}")
    try:
        guard.roles.check_prefill()
        reservation = await guard.handoffs.reserve(request.wait_s)
    except Busy as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    return pb.HandoffReservation(reservation_id=reservation)


async def _prefill(engine: Engine, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
    started = time.perf_counter()
    prefill_input = convert.prefill_input_from_proto(request)
    watch = KvSendWatch(prefill_input.kv_transfer.transfer_id if prefill_input.kv_transfer else "",
                        lambda: _transport(engine))
    stream = engine.generate(prefill_input)
    try:
        last = await watch.prefill(stream)
        if prefill_input.kv_transfer is not None:
            await watch.wait_for_sent()
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except KvSendFailed as exc:
        logger.warning("request %s: KV transfer to %s failed: %s", request.request_id, request.kv_target, exc)
        await context.abort(grpc.StatusCode.ABORTED, f"KV transfer to {request.kv_target} failed: {exc}")
    finally:
        await stream.aclose()  # a cancelled call aborts the prefill in the engine
    if last is None or last.finish_reason not in ("stop", "length"):  # the engine dropped it (vLLM's abort)
        why = last.finish_reason if last is not None else "no output"
        await context.abort(grpc.StatusCode.ABORTED, f"the prefill ended unfinished ({why})")
    elapsed = time.perf_counter() - started
    logger.debug("request %s: prefilled %d tokens in %.3f s", request.request_id, last.num_prompt_tokens, elapsed)
    return pb.PrefillResponse(
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
        prefill_seconds=elapsed,
    )


def _transport(engine: Engine) -> TransportSnapshot | None:
    connector = engine.stats().kv_connector
    return connector.transport if connector is not None else None


def stats_message(engine: Engine, identity: WorkerIdentity, guard: CallerGuard) -> pb.WorkerStats:
    role = guard.roles.current
    return convert.stats_to_proto(
        engine.stats(),
        worker_name=identity.worker_name,
        service=identity.service,
        role=role.role,
        draining=role.draining,
        role_generation=role.generation,
        num_handoffs=guard.handoffs.num_held,
        max_handoffs=guard.handoffs.limit,
        peak_handoffs=guard.handoffs.peak_held,
        num_handoffs_queued=guard.handoffs.num_waiting,
        model=identity.model,
        max_model_len=engine.max_model_len if engine.started else 0,
        grpc_rejected=guard.rejections.snapshot(),
        layout_spec=engine.layout_spec,
        kv_protocol_version=KV_PROTOCOL_VERSION,
    )
