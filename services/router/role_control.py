"""The router's long-timescale loop: after every stats poll, the local PD workers' queues and
utilization go to ``RoleBalancer``; its actions drain a worker and then flip its run-time role.

The worker holds its role: a flip is a compare-and-set ``SetRole`` call on it (``WorkerPool.set_role``),
and every router reads the result from the worker's stats within one stats interval. Every local PD
worker runs its engine with a ``kv_both`` connector and serves both the DecodeWorker and the
PrefillWorker RPCs, so a flipped worker is simply routed prefills (role ``prefill``) or generations
(role ``decode``) from then on; while it drains, it refuses new requests of either kind. A worker needs
a ``kv_port`` to decode requests prefilled elsewhere, so only workers with one flip.

Only one router decides at a time (``Leadership``: replica 0 under `prfaas up`, the holder of a
Kubernetes Lease in a cluster); the others only follow the workers' stats. A generation that moved
under the decider (a second decider) makes its change fail instead of overwriting the other's.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.config import DeploymentConfig, RoleFlipsConfig
from services.router.leadership import Leadership, always_leader
from services.router.metrics import RouterMetrics
from services.router.workers import RoleConflict, WorkerHandle, WorkerPool
from services.scheduling.affinity import PrefixAffinity
from services.scheduling.roles import PdWorkerLoad, RoleAction, RoleBalancer, RoleFlipConfig, StageSnapshot

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
STAGES = ("prefill", "decode", "none")


class RoleControl:
    """Registered as a ``WorkerPool.on_poll`` callback; waits only for the SetRole calls it makes."""

    def __init__(self, config: DeploymentConfig, pool: WorkerPool, metrics: RouterMetrics,
                 affinity: PrefixAffinity | None = None, clock: Callable[[], float] = time.monotonic,
                 leadership: Leadership = always_leader) -> None:
        self.balancer = RoleBalancer(role_flip_config(config.scheduler.role_flips))
        self._max_num_seqs = {w.name: config.engine_for(w).max_num_seqs for w in config.workers}
        self._pool = pool
        self._metrics = metrics
        self._affinity = affinity
        self._clock = clock
        self._leadership = leadership
        self._roles = {h.name: h.role for h in pool.handles}
        self._export()

    async def on_poll(self) -> None:
        if self._leadership.is_leader():
            await self._clear_stray_drains()
            action = self.balancer.observe(self.snapshot())
            if action is not None:
                await self._apply(action)
        elif self.balancer.draining is not None:
            logger.info("role flip: no longer deciding; the drain of %s is left to the router that decides now",
                        self.balancer.draining.worker)
            self.balancer.abandon()
        self._follow()
        self._export()

    def snapshot(self) -> StageSnapshot:
        now_s = self._clock()
        loads = tuple(self._load(h, now_s) for h in self._pd_workers())
        return StageSnapshot(now_s, loads)

    def _pd_workers(self) -> list[WorkerHandle]:
        return [h for h in self._pool.handles
                if h.config.cluster == "local" and h.decode is not None and h.role in ("prefill", "decode")]

    def _load(self, handle: WorkerHandle, now_s: float) -> PdWorkerLoad:
        stats = handle.stats
        # this router's requests at the worker (not those waiting for a hand-off slot to decode here: they
        # move elsewhere if it drains), or every router's as it last reported
        running = max(handle.num_in_flight - handle.num_decodes_awaiting_handoff, stats.num_active_requests,
                      stats.num_running_requests)
        utilization = max(stats.num_running_requests / max(self._max_num_seqs[handle.name], 1), stats.kv_cache_usage)
        # the prefill queue: in the engine, in the worker's hand-off queue (every router's), and at this router
        queued = stats.num_waiting_requests + stats.num_handoffs_queued + handle.num_handoffs_at_router
        return PdWorkerLoad(handle.name, handle.role, num_in_flight=running,
                            num_prefill_queued=queued, decode_utilization=utilization,
                            flippable=handle.flippable and handle.usable(now_s), home_role=handle.config.role)

    async def _clear_stray_drains(self) -> None:
        """A worker left draining by a decider that stopped (or lost its lease) mid-flip serves again."""
        ours = self.balancer.draining.worker if self.balancer.draining is not None else None
        for handle in self._pd_workers():
            if handle.draining and handle.name != ours and handle.flippable:
                await self._set(handle, handle.role, False, "ending a drain no router continues")

    async def _apply(self, action: RoleAction) -> None:
        handle = self._pool.handle(action.worker)
        if action.kind == "drain":
            logger.info("role flip: draining worker %s (%s -> %s; %s binds)", handle.name, handle.role,
                        action.to_role, self.balancer.binding)
            if not await self._set(handle, handle.role, True, "drain"):
                self.balancer.abandon()
            return
        if action.kind == "cancel":
            self._metrics.role_flip_cancels.inc()
            logger.warning("role flip: worker %s did not drain in time; it stays %s", handle.name, handle.role)
            await self._set(handle, handle.role, False, "cancel")
            return
        was = handle.role
        if await self._set(handle, action.to_role, False, "flip"):
            logger.info("role flip: worker %s is now %s (was %s)", handle.name, action.to_role, was)
            self._metrics.role_flips.labels(action.to_role).inc()

    async def _set(self, handle: WorkerHandle, role: str, draining: bool, what: str) -> bool:
        try:
            await self._pool.set_role(handle, role, draining)
            return True
        except RoleConflict as exc:
            logger.warning("role flip: %s of %s not applied: %s", what, handle.name, exc)
            return False

    def _follow(self) -> None:
        """A role changed at the worker (by this router or another): the prefix estimate of it is stale."""
        for handle in self._pool.handles:
            if self._roles.get(handle.name) != handle.role:
                logger.info("worker %s is %s now (generation %d)", handle.name, handle.role, handle.role_generation)
                self._roles[handle.name] = handle.role
                if self._affinity is not None:
                    self._affinity.forget(handle.name)

    def _export(self) -> None:
        for handle in self._pd_workers():
            for role in ROLES:
                self._metrics.worker_role.labels(handle.name, role).set(1 if role == handle.role else 0)
            self._metrics.worker_draining.labels(handle.name).set(1 if handle.draining else 0)
        binding = self.balancer.binding or "none"
        for stage in STAGES:
            self._metrics.binding_stage.labels(stage).set(1 if stage == binding else 0)
        self._metrics.role_decider.set(1 if self._leadership.is_leader() else 0)


def role_flip_config(flips: RoleFlipsConfig) -> RoleFlipConfig:
    return RoleFlipConfig(
        min_dwell_s=flips.min_dwell_s,
        sustain_s=flips.sustain_s,
        max_drain_s=flips.max_drain_s,
        prefill_queue_high=flips.prefill_queue_high,
        prefill_queue_low=flips.prefill_queue_low,
        decode_utilization_high=flips.decode_utilization_high,
        decode_utilization_low=flips.decode_utilization_low,
        min_workers_per_role=flips.min_workers_per_role,
    )
