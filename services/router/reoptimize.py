"""The router's long-timescale re-optimisation of the offload threshold (paper, section 3.4.3).

Every ``scheduler.reoptimize_interval_s`` the profiles measured online (``OnlineProfiles``: recent
prompt lengths and the arrival rate, KV bytes per token from the PrfaaS prefill workers' sent bytes,
the local prefill rate measured by ``PrefillQueues``) become the planner's ``OffloadModel``, and
``CongestionAwareThreshold.reoptimize`` moves the base (the floor the short timescale returns to)
and the ceiling (the most it may raise t) to what the configured link capacity allows at that
arrival rate. While the profiles hold too little data the re-optimisation is skipped.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from services.config import DeploymentConfig
from services.router.admission import PrefillQueues
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerHandle
from services.scheduling.congestion import CongestionAwareThreshold
from services.scheduling.profiles import OnlineProfiles
from services.scheduling.threshold import OffloadModel

logger = logging.getLogger(__name__)

LOCAL_PATHS = ("pd", "local")


class ThresholdReoptimizer:
    """Driven by ``ThresholdControl.on_poll`` (:meth:`on_poll`) and registered as a
    ``Dispatcher.on_request`` callback (:meth:`record_request`); never blocks."""

    def __init__(self, config: DeploymentConfig, controller: CongestionAwareThreshold, queues: PrefillQueues,
                 metrics: RouterMetrics, clock: Callable[[], float], start_s: float) -> None:
        self.interval_s = config.scheduler.reoptimize_interval_s
        self.profiles = OnlineProfiles(start_s, window_s=self.interval_s)
        self._controller = controller
        self._queues = queues
        self._metrics = metrics
        self._clock = clock
        self._next_s = start_s + self.interval_s
        self._bytes_sent: dict[str, int] = {}
        self._num_pending_bytes = 0
        self._num_offloaded_tokens = queues.queue("prfaas").num_tokens_prefilled

    def record_request(self, num_prompt_tokens: int) -> None:
        self.profiles.record_request(self._clock(), num_prompt_tokens)

    def on_poll(self, now_s: float, prfaas_workers: list[WorkerHandle]) -> bool:
        """Counts the KV bytes sent since the previous poll; re-optimises when due. True if it did."""
        self._count_bytes(prfaas_workers)
        if now_s < self._next_s:
            return False
        self._next_s = now_s + self.interval_s
        self._close_kv_period()
        local_rate = self.local_tokens_per_s
        cfg = self._controller.config
        model = self.profiles.offload_model(now_s, cfg.base_threshold_tokens, cfg.max_threshold_tokens, local_rate)
        if model is None:
            logger.debug("threshold re-optimisation skipped: %s", self.profiles.missing(now_s))
            return False
        self._apply(now_s, model, local_rate)
        return True

    @property
    def local_tokens_per_s(self) -> float | None:
        """The rate of the local path that prefilled the most (PD prefill workers, else the decode workers)."""
        path = max(LOCAL_PATHS, key=lambda p: self._queues.queue(p).num_tokens_prefilled)
        return self._queues.queue(path).tokens_per_s

    def _apply(self, now_s: float, model: OffloadModel, local_rate: float | None) -> None:
        controller = self._controller
        before = (controller.base_tokens, controller.ceiling_tokens)
        rate = self.profiles.arrival_rate(now_s)
        controller.model = model
        threshold = controller.reoptimize(controller.config.link_capacity_gbps, rate)
        self._metrics.reoptimizations.inc()
        self._metrics.kv_bytes_per_token.set(self.profiles.kv_bytes_per_token)
        self._metrics.link_kv_tokens_per_second.set(
            controller.config.link_capacity_gbps * 1e9 / 8 / self.profiles.kv_bytes_per_token)
        lengths = self.profiles.lengths(now_s)
        logger.info("offload threshold re-optimised: base %.0f -> %.0f, ceiling %.0f -> %.0f tokens, threshold "
                    "now %s (link %g Gbit/s, %.3g requests/s, %d prompts of mean %.0f tokens, %.0f KV bytes/token, "
                    "local prefill %s tokens/s)", before[0], controller.base_tokens, before[1],
                    controller.ceiling_tokens, threshold, controller.config.link_capacity_gbps, rate,
                    lengths.num_samples, lengths.mean, self.profiles.kv_bytes_per_token,
                    "unknown" if local_rate is None else f"{local_rate:.0f}")

    def _count_bytes(self, workers: list[WorkerHandle]) -> None:
        for handle in workers:
            total = sum(link.bytes_sent for link in handle.stats.kv_links)
            previous = self._bytes_sent.get(handle.name)
            if previous is not None:
                self._num_pending_bytes += total - previous if total >= previous else total
            self._bytes_sent[handle.name] = total

    def _close_kv_period(self) -> None:
        offloaded = self._queues.queue("prfaas").num_tokens_prefilled
        self.profiles.record_kv_transfer(self._num_pending_bytes, offloaded - self._num_offloaded_tokens)
        self._num_pending_bytes = 0
        self._num_offloaded_tokens = offloaded
