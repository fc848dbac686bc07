"""The router's long-timescale loop: after every stats poll, the local PD workers' queues and
utilization go to ``RoleBalancer``; its actions drain a worker and then flip its run-time role.

A flip is a router-side change only: every local PD worker runs its engine with a ``kv_both``
connector and serves both the DecodeWorker and the PrefillWorker RPCs, so a flipped worker is
simply routed prefills (role ``prefill``) or generations (role ``decode``) from then on. A worker
needs a ``kv_port`` to decode requests prefilled elsewhere, so only workers with one flip.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.config import DeploymentConfig, RoleFlipsConfig
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerHandle, WorkerPool
from services.scheduling.affinity import PrefixAffinity
from services.scheduling.roles import PdWorkerLoad, RoleAction, RoleBalancer, RoleFlipConfig, StageSnapshot

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
STAGES = ("prefill", "decode", "none")


class RoleControl:
    """Registered as a ``WorkerPool.on_poll`` callback; never blocks."""

    def __init__(self, config: DeploymentConfig, pool: WorkerPool, metrics: RouterMetrics,
                 affinity: PrefixAffinity | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.balancer = RoleBalancer(role_flip_config(config.scheduler.role_flips))
        self._max_num_seqs = {w.name: config.engine_for(w).max_num_seqs for w in config.workers}
        self._pool = pool
        self._metrics = metrics
        self._affinity = affinity
        self._clock = clock
        self._export()

    def on_poll(self) -> None:
        action = self.balancer.observe(self.snapshot())
        if action is not None:
            self._apply(action)
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
        running = max(handle.num_in_flight, stats.num_active_requests, stats.num_running_requests)
        utilization = max(stats.num_running_requests / max(self._max_num_seqs[handle.name], 1), stats.kv_cache_usage)
        return PdWorkerLoad(handle.name, handle.role, num_in_flight=running,
                            num_prefill_queued=stats.num_waiting_requests, decode_utilization=utilization,
                            flippable=handle.flippable and handle.usable(now_s))

    def _apply(self, action: RoleAction) -> None:
        handle = self._pool.handle(action.worker)
        if action.kind == "drain":
            handle.draining = True
            logger.info("role flip: draining worker %s (%s -> %s; %s binds)", handle.name, handle.role,
                        action.to_role, self.balancer.binding)
            return
        handle.draining = False
        if action.kind == "cancel":
            self._metrics.role_flip_cancels.inc()
            logger.warning("role flip: worker %s did not drain in time; it stays %s", handle.name, handle.role)
            return
        logger.info("role flip: worker %s is now %s (was %s)", handle.name, action.to_role, handle.role)
        handle.role = action.to_role
        self._metrics.role_flips.labels(action.to_role).inc()
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
