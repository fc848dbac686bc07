"""The router's short-timescale threshold loop: after every stats poll, the PrfaaS prefill workers'
KV link telemetry becomes one ``LinkSample`` for ``CongestionAwareThreshold``, whose threshold
the dispatcher routes with from then on; every ``scheduler.reoptimize_interval_s`` the long
timescale (``services.router.reoptimize``) moves the controller's base and ceiling."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.config import DeploymentConfig
from services.router.admission import PrefillQueues
from services.router.metrics import RouterMetrics
from services.router.reoptimize import ThresholdReoptimizer
from services.router.workers import WorkerHandle, WorkerPool
from services.scheduling.congestion import STATES, CongestionAwareThreshold, CongestionControllerConfig
from services.scheduling.link_signals import LinkSignals

logger = logging.getLogger(__name__)


class ThresholdControl:
    """Registered as a ``WorkerPool.on_poll`` callback; never blocks. Owns the offload threshold:
    :attr:`controller` is the one value the dispatcher routes with and placement reads the base of.
    With ``queues`` and a positive ``scheduler.reoptimize_interval_s`` it also re-optimises the base
    and ceiling on that schedule (:attr:`reoptimizer`, whose ``record_request`` the dispatcher calls
    per request)."""

    def __init__(self, config: DeploymentConfig, pool: WorkerPool, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic, queues: PrefillQueues | None = None) -> None:
        self.controller = CongestionAwareThreshold(controller_config(config))
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._signals = LinkSignals()
        self.reoptimizer = None
        if queues is not None and config.scheduler.reoptimize_interval_s > 0:
            self.reoptimizer = ThresholdReoptimizer(config, self.controller, queues, metrics, clock, clock())
        self._export()

    def on_poll(self) -> None:
        before = (self.controller.state, self.controller.threshold_tokens)
        now_s = self._clock()
        workers = self._prfaas_workers()
        sample = self._signals.sample(now_s, [(h.name, h.healthy, h.stats) for h in workers],
                                      {h.name: h.num_handoffs_waiting for h in workers})
        self.controller.observe(sample)
        if self.reoptimizer is not None:
            self.reoptimizer.on_poll(now_s, workers)
        after = (self.controller.state, self.controller.threshold_tokens)
        if after != before:
            self._metrics.threshold_changes.inc()
            logger.info("offload threshold %s -> %s tokens (state %s; link utilization %.2f, congested %s, "
                        "usable PrfaaS workers %d)", before[1], after[1], after[0], self.controller.utilization,
                        self.controller.congested, sample.num_usable_workers)
        self._export()

    def _prfaas_workers(self) -> list[WorkerHandle]:
        return [h for h in self._pool.handles if h.prefill is not None and h.config.cluster == "prfaas"]

    def _export(self) -> None:
        self._metrics.threshold.set(self.controller.threshold_tokens)
        self._metrics.threshold_base.set(self.controller.base_tokens)
        self._metrics.threshold_ceiling.set(self.controller.ceiling_tokens)
        for state in STATES:
            self._metrics.controller_state.labels(state).set(1 if state == self.controller.state else 0)
        self._metrics.link_utilization.set(self.controller.utilization)
        self._metrics.link_congested.set(1 if self.controller.congested else 0)


def controller_config(config: DeploymentConfig) -> CongestionControllerConfig:
    s = config.scheduler
    return CongestionControllerConfig(
        base_threshold_tokens=s.offload_threshold_tokens,
        max_threshold_tokens=s.max_offload_threshold_tokens or max(config.model.max_model_len,
                                                                   s.offload_threshold_tokens),
        link_capacity_gbps=s.link_capacity_gbps,
        raise_utilization=s.threshold_raise_utilization,
        lower_utilization=s.threshold_lower_utilization,
        step=s.threshold_step,
        hold_s=s.threshold_hold_s,
        retransmit_ratio=s.congestion_retransmit_ratio,
        rtt_increase_ms=s.congestion_rtt_increase_ms,
        queue_depth_per_worker=s.congestion_queue_depth,
    )
