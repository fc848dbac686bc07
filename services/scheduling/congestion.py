"""The short-timescale threshold controller (paper, section 3.4.3): link telemetry -> threshold t.

Every stats interval the caller hands in one :class:`LinkSample` (the PrfaaS prefill workers' KV
links and queue, aggregated). The controller raises t by ``step`` while the egress link is above
``raise_utilization`` of its capacity or shows congestion (retransmissions, RTT inflation, a long
PrfaaS queue), and lowers it by ``step`` toward the base threshold while utilization is below
``lower_utilization`` without congestion. Between the two bands it holds, and any change waits
``hold_s`` after the previous one, so t does not flap around a boundary.

When no PrfaaS prefill worker is usable (all unhealthy, or their links failing transfers),
offloading stops at once; it resumes after the workers have been usable for ``hold_s``.

Long timescale: with an :class:`~services.scheduling.threshold.OffloadModel` (the planner's model),
:meth:`CongestionAwareThreshold.reoptimize` moves the floor the controller returns to (the base)
to the threshold the link's bandwidth allows at the observed arrival rate, and caps how far the
short timescale may raise t before local prefill becomes the bottleneck (the ceiling).

The controller is pure: no I/O, the caller supplies the clock. The router and the simulator
(``services/simulator``) run this same class.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from services.scheduling.threshold import OffloadModel

ControllerState = Literal["base", "raised", "stopped"]
STATES: tuple[ControllerState, ...] = ("base", "raised", "stopped")


@dataclass(frozen=True, slots=True)
class CongestionControllerConfig:
    base_threshold_tokens: float
    max_threshold_tokens: float
    link_capacity_gbps: float
    raise_utilization: float = 0.85
    lower_utilization: float = 0.6
    step: float = 1.5
    hold_s: float = 5.0
    retransmit_ratio: float = 0.01
    rtt_increase_ms: float = 20.0
    queue_depth_per_worker: float = 8.0
    min_step_tokens: float = 128.0

    def __post_init__(self) -> None:
        if not 0 < self.lower_utilization < self.raise_utilization:
            raise ValueError("need 0 < lower_utilization < raise_utilization")
        if self.step <= 1:
            raise ValueError("step must be greater than 1")
        if not 0 <= self.base_threshold_tokens <= self.max_threshold_tokens:
            raise ValueError("need 0 <= base_threshold_tokens <= max_threshold_tokens")
        if self.link_capacity_gbps <= 0:
            raise ValueError("link_capacity_gbps must be positive")


@dataclass(frozen=True, slots=True)
class LinkSample:
    """One stats interval of the PrfaaS egress link, summed over the usable prefill workers.
    ``capacity_gbps``: the link's measured capacity; None means the configured one.
    ``num_local_queued``: requests waiting for local prefill over ``num_local_workers``; when given,
    a long PrfaaS queue counts as congestion only while it is longer per worker than the local one
    (raising t then would only move the backlog onto the busier side)."""

    now_s: float
    egress_gbps: float = 0.0
    retransmit_ratio: float = 0.0
    rtt_increase_ms: float = 0.0
    num_queued: int = 0
    num_usable_workers: int = 1
    capacity_gbps: float | None = None
    num_local_queued: int | None = None
    num_local_workers: int = 1


class OffloadThreshold(Protocol):
    """What the router reads of the offload threshold's owner: the value to route with and its base."""

    @property
    def threshold_tokens(self) -> float: ...

    @property
    def base_tokens(self) -> float: ...


class FixedThreshold:
    """The offload threshold when no controller moves it (``scheduler.adaptive_threshold`` off); read
    like :class:`CongestionAwareThreshold`."""

    def __init__(self, threshold_tokens: float) -> None:
        self.threshold_tokens = self.base_tokens = threshold_tokens


class CongestionAwareThreshold:
    """Call :meth:`observe` once per stats interval; read :attr:`threshold_tokens` (the value to
    route with: ``inf`` while offloading is stopped) and :attr:`state`. Never blocks."""

    def __init__(self, config: CongestionControllerConfig, model: OffloadModel | None = None) -> None:
        self.config = config
        self.model = model
        self.base_tokens = config.base_threshold_tokens
        self.ceiling_tokens = config.max_threshold_tokens
        self._level_tokens = config.base_threshold_tokens
        self.state: ControllerState = "base"
        self.utilization = 0.0
        self.congested = False
        self._last_change_s = -math.inf
        self._usable_since_s: float | None = None

    @property
    def threshold_tokens(self) -> float:
        return math.inf if self.state == "stopped" else self._level_tokens

    @property
    def offloading(self) -> bool:
        return self.state != "stopped"

    @property
    def _level_state(self) -> ControllerState:
        return "raised" if self._level_tokens > self.base_tokens else "base"

    def reoptimize(self, bandwidth_gbps: float, arrival_rate: float) -> float:
        """Long timescale (minutes): re-derive the base and the ceiling from the planner's model
        at this bandwidth and arrival rate, never below the configured base or above the maximum.
        Without a model this is a no-op. Returns the threshold to route with."""
        if self.model is None:
            return self.threshold_tokens
        cfg = self.config
        base, ceiling = self.model.bounds(bandwidth_gbps, arrival_rate)
        self.base_tokens = min(max(base, cfg.base_threshold_tokens), cfg.max_threshold_tokens)
        self.ceiling_tokens = min(max(ceiling, self.base_tokens), cfg.max_threshold_tokens)
        self._level_tokens = min(max(self._level_tokens, self.base_tokens), self.ceiling_tokens)
        if self.state != "stopped":
            self.state = self._level_state
        return self.threshold_tokens

    def observe(self, sample: LinkSample) -> float:
        cfg = self.config
        capacity = cfg.link_capacity_gbps if sample.capacity_gbps is None else sample.capacity_gbps
        self.utilization = sample.egress_gbps / capacity if capacity > 0 else 0.0
        self.congested = self._congested(sample)
        if sample.num_usable_workers <= 0:
            self._stop(sample.now_s)
        elif self.state == "stopped":
            self._maybe_resume(sample.now_s)
        elif sample.now_s - self._last_change_s >= cfg.hold_s:
            self._adjust(sample.now_s)
        return self.threshold_tokens

    def _congested(self, sample: LinkSample) -> bool:
        cfg = self.config
        return (sample.retransmit_ratio > cfg.retransmit_ratio or sample.rtt_increase_ms > cfg.rtt_increase_ms
                or self._queue_congested(sample))

    def _queue_congested(self, sample: LinkSample) -> bool:
        per_worker = sample.num_queued / max(sample.num_usable_workers, 1)
        if per_worker <= self.config.queue_depth_per_worker:
            return False
        if sample.num_local_queued is None:
            return True
        return per_worker > sample.num_local_queued / max(sample.num_local_workers, 1)

    def _adjust(self, now_s: float) -> None:
        cfg = self.config
        level = self._level_tokens
        if self.congested or self.utilization > cfg.raise_utilization:
            target = min(max(level * cfg.step, level + cfg.min_step_tokens), self.ceiling_tokens)
        elif self.utilization < cfg.lower_utilization:
            target = max(min(level / cfg.step, level - cfg.min_step_tokens), self.base_tokens)
        else:
            return
        if target != level:
            self._level_tokens = target
            self._last_change_s = now_s
        self.state = self._level_state

    def _stop(self, now_s: float) -> None:
        if self.state != "stopped":
            self.state = "stopped"
            self._last_change_s = now_s
        self._usable_since_s = None

    def _maybe_resume(self, now_s: float) -> None:
        if self._usable_since_s is None:
            self._usable_since_s = now_s
        if now_s - self._usable_since_s >= self.config.hold_s:
            self.state = self._level_state
            self._last_change_s = now_s
            self._usable_since_s = None
