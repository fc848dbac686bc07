"""The router's short-timescale threshold loop: after every stats poll, the PrfaaS prefill workers'
KV link telemetry becomes one ``LinkSample`` for ``CongestionAwareThreshold``, whose threshold
the dispatcher routes with from then on; every ``scheduler.reoptimize_interval_s`` the long
timescale (``services.router.reoptimize``) moves the controller's base and ceiling."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.config import DeploymentConfig
from services.engine.types import WorkerStats
from services.router.admission import PrefillQueues
from services.router.metrics import RouterMetrics
from services.router.reoptimize import ThresholdReoptimizer
from services.router.workers import WorkerHandle, WorkerPool
from services.scheduling.congestion import (STATES, CongestionAwareThreshold, CongestionControllerConfig,
                                            LinkSample)

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 1448
# A prefill worker's link telemetry rides on its engine's forward passes (a snapshot at most once a
# second, none while the engine idles): figures older than this describe no current traffic.
STALE_S = 3.0


@dataclass(frozen=True, slots=True)
class _Totals:
    bytes_sent: int
    retransmits: int
    transfers_failed: int


@dataclass(frozen=True, slots=True)
class _Reading:
    """One worker's link between its last two distinct telemetry snapshots, seen at ``at_s``."""

    totals: _Totals
    at_s: float
    num_bytes: int = 0
    num_retransmits: int = 0
    elapsed_s: float = 0.0
    rtt_increase_ms: float = 0.0


class LinkSignals:
    """Differences successive ``WorkerStats`` of the PrfaaS prefill workers into link samples. Rates
    come from distinct snapshots (a poll that finds the same snapshot again repeats the previous
    figures, up to ``STALE_S``, then reads as an idle link), so a poll interval shorter than the
    snapshot interval does not alias into 0/2x rates, and a stale RTT does not read as congestion.
    A worker is usable when it is healthy and none of its transfers failed since the previous poll."""

    def __init__(self) -> None:
        self._previous: dict[str, _Totals] = {}
        self._readings: dict[str, _Reading] = {}
        self._min_rtt_ms: dict[tuple[str, str], float] = {}

    def sample(self, now_s: float, workers: list[tuple[str, bool, WorkerStats]]) -> LinkSample:
        num_bytes = num_retransmits = num_queued = num_usable = 0
        egress_bps = rtt_increase = 0.0
        for name, healthy, stats in workers:
            totals = _totals(stats)
            previous = self._previous.get(name, totals)
            self._previous[name] = totals
            reading = self._read(name, now_s, totals, stats)
            if now_s - reading.at_s <= STALE_S and reading.elapsed_s > 0:
                num_bytes += reading.num_bytes
                num_retransmits += reading.num_retransmits
                egress_bps += reading.num_bytes * 8 / reading.elapsed_s
                rtt_increase = max(rtt_increase, reading.rtt_increase_ms)
            if healthy:
                num_queued += stats.num_waiting_requests
                num_usable += totals.transfers_failed <= previous.transfers_failed
        return LinkSample(
            now_s=now_s,
            egress_gbps=egress_bps / 1e9,
            retransmit_ratio=num_retransmits / max(num_bytes / SEGMENT_BYTES, 1.0),
            rtt_increase_ms=rtt_increase,
            num_queued=num_queued,
            num_usable_workers=num_usable,
        )

    def _read(self, worker: str, now_s: float, totals: _Totals, stats: WorkerStats) -> _Reading:
        last = self._readings.get(worker)
        if last is not None and totals == last.totals:
            return last
        rtt_increase = self._rtt_increase(worker, stats)
        reading = _Reading(totals, now_s)
        if last is not None:
            reading = _Reading(totals, now_s, num_bytes=max(totals.bytes_sent - last.totals.bytes_sent, 0),
                               num_retransmits=max(totals.retransmits - last.totals.retransmits, 0),
                               elapsed_s=min(now_s - last.at_s, STALE_S), rtt_increase_ms=rtt_increase)
        self._readings[worker] = reading
        return reading

    def _rtt_increase(self, worker: str, stats: WorkerStats) -> float:
        increase = 0.0
        for link in stats.kv_links:
            if link.rtt_ms <= 0:
                continue
            key = (worker, link.peer)
            lowest = min(self._min_rtt_ms.get(key, link.rtt_ms), link.rtt_ms)
            self._min_rtt_ms[key] = lowest
            increase = max(increase, link.rtt_ms - lowest)
        return increase


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
        sample = self._signals.sample(now_s, [(h.name, h.healthy, h.stats) for h in workers])
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


def _totals(stats: WorkerStats) -> _Totals:
    return _Totals(bytes_sent=sum(link.bytes_sent for link in stats.kv_links),
                   retransmits=sum(link.retransmits for link in stats.kv_links),
                   transfers_failed=sum(link.transfers_failed for link in stats.kv_links))
