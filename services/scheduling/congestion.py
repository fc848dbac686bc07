"""The short-timescale threshold controller (paper, section 3.4.3): link telemetry -> threshold t.

Every stats interval the caller hands in one :class:`LinkSample` (the PrfaaS prefill workers' KV
links and queue, aggregated). The controller raises t by ``step`` while the egress link is above
``raise_utilization`` of its capacity or shows congestion (retransmissions, RTT inflation, a long
PrfaaS queue), and lowers it by ``step`` toward the base threshold while utilization is below
``lower_utilization`` without congestion. Between the two bands it holds, and any change waits
``hold_s`` after the previous one, so t does not flap around a boundary.

When no PrfaaS prefill worker is usable (all unhealthy, or their links failing transfers),
offloading stops at once; it resumes after the workers have been usable for ``hold_s``.
The controller is pure: no I/O, the caller supplies the clock. The router and the simulator run it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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
    """One stats interval of the PrfaaS egress link, summed over the usable prefill workers."""

    now_s: float
    egress_gbps: float = 0.0
    retransmit_ratio: float = 0.0
    rtt_increase_ms: float = 0.0
    num_queued: int = 0
    num_usable_workers: int = 1


class CongestionAwareThreshold:
    """Call :meth:`observe` once per stats interval; read :attr:`threshold_tokens` (the value to
    route with: ``inf`` while offloading is stopped) and :attr:`state`. Never blocks."""

    def __init__(self, config: CongestionControllerConfig) -> None:
        self.config = config
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
        return "raised" if self._level_tokens > self.config.base_threshold_tokens else "base"

    def observe(self, sample: LinkSample) -> float:
        cfg = self.config
        self.utilization = sample.egress_gbps / cfg.link_capacity_gbps
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
        queue_limit = cfg.queue_depth_per_worker * max(sample.num_usable_workers, 1)
        return (sample.retransmit_ratio > cfg.retransmit_ratio or sample.rtt_increase_ms > cfg.rtt_increase_ms
                or sample.num_queued > queue_limit)

    def _adjust(self, now_s: float) -> None:
        cfg = self.config
        level = self._level_tokens
        if self.congested or self.utilization > cfg.raise_utilization:
            target = min(max(level * cfg.step, level + cfg.min_step_tokens), cfg.max_threshold_tokens)
        elif self.utilization < cfg.lower_utilization:
            target = max(min(level / cfg.step, level - cfg.min_step_tokens), cfg.base_threshold_tokens)
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
