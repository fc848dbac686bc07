"""A bandwidth-aware routing threshold (paper, section 3.3).

Offloading every request longer than t sends ``rate * E[S_kv(L); L > t]`` bytes per second across
the cluster link (``E[S_kv(L); L > t] = p(t) * E[S_kv | L > t]``). When the measured bandwidth
``B`` can no longer carry that with some headroom, the controller raises t to the smallest value
with ``rate * E[S_kv(L); L > t] <= headroom * B``; it never goes below the planner's threshold,
which is already the throughput optimum when the link is not the bottleneck.

Raising t moves work onto local prefill. When the controller also knows the local prefill load
(``local_prefill_s(t)`` = E[T_local(L); L <= t] / N_p, seconds per arriving request per instance),
it stops raising t where local prefill would become busier than the link: it picks the smallest
t with ``link utilization <= max(headroom, local utilization)``, so an infeasible link (both
sides overloaded) is balanced instead of moving the whole overload onto the local cluster.

Bandwidth samples are smoothed asymmetrically (drops are believed at once, recoveries slowly) and
lowering t waits until the change exceeds a hysteresis band, so the threshold does not flap.
The controller is pure: the caller supplies samples, the arrival rate and the clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GBPS = 1e9 / 8


@dataclass(frozen=True, slots=True)
class ThresholdControllerConfig:
    base_threshold_tokens: float
    min_tokens: float
    max_tokens: float
    headroom: float = 0.9
    rise_smoothing: float = 0.2
    drop_smoothing: float = 1.0
    hysteresis: float = 0.05
    resolution_tokens: float = 16.0

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        if not (0 < self.rise_smoothing <= 1 and 0 < self.drop_smoothing <= 1):
            raise ValueError("smoothing weights must be in (0, 1]")
        if not self.min_tokens <= self.base_threshold_tokens <= self.max_tokens:
            raise ValueError("the base threshold must lie within [min_tokens, max_tokens]")


class BandwidthAwareThreshold:
    """Turns bandwidth samples into a routing threshold.

    ``offloaded_kv_bytes(t)`` is E[S_kv(L); L > t], the KV bytes the link carries per arriving
    request at threshold t; it must be non-increasing in t. Call :meth:`observe` whenever a
    bandwidth sample arrives (router: from transfer telemetry; simulator: from the link model);
    it never blocks and returns the threshold to use from now on.
    """

    def __init__(self, config: ThresholdControllerConfig, offloaded_kv_bytes: Callable[[float], float],
                 local_prefill_s: Callable[[float], float] | None = None) -> None:
        self.config = config
        self._offloaded_kv_bytes = offloaded_kv_bytes
        self._local_prefill_s = local_prefill_s
        self._estimate_gbps: float | None = None
        self._solved_for: tuple[float, float] | None = None
        self.threshold_tokens = config.base_threshold_tokens

    @property
    def bandwidth_estimate_gbps(self) -> float | None:
        return self._estimate_gbps

    def observe(self, bandwidth_gbps: float, arrival_rate: float) -> float:
        estimate = self._smooth(max(bandwidth_gbps, 0.0))
        if self._solved_for is not None and _close(self._solved_for, (estimate, arrival_rate)):
            return self.threshold_tokens
        self._solved_for = (estimate, arrival_rate)
        required = self.required_threshold(estimate, arrival_rate)
        current = self.threshold_tokens
        if required > current or (current - required) > self.config.hysteresis * current:
            self.threshold_tokens = required
        return self.threshold_tokens

    def required_threshold(self, bandwidth_gbps: float, arrival_rate: float) -> float:
        """The smallest t >= the base threshold whose offloaded KV fits ``headroom * bandwidth``
        (or, with a local load model, fits at least as well as local prefill does)."""
        cfg = self.config
        if arrival_rate <= 0:
            return cfg.base_threshold_tokens
        bandwidth = bandwidth_gbps * GBPS

        def fits(t: float) -> bool:
            link = arrival_rate * self._offloaded_kv_bytes(t)
            if link <= cfg.headroom * bandwidth:
                return True
            return self._local_prefill_s is not None and link <= arrival_rate * self._local_prefill_s(t) * bandwidth

        lo, hi = cfg.base_threshold_tokens, cfg.max_tokens
        if fits(lo):
            return lo
        if not fits(hi):
            return hi
        while hi - lo > cfg.resolution_tokens:
            mid = (lo + hi) / 2
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def _smooth(self, sample: float) -> float:
        previous = self._estimate_gbps
        if previous is None:
            self._estimate_gbps = sample
        else:
            weight = self.config.drop_smoothing if sample < previous else self.config.rise_smoothing
            self._estimate_gbps = previous + weight * (sample - previous)
        return self._estimate_gbps


def _close(a: tuple[float, float], b: tuple[float, float], tolerance: float = 0.005) -> bool:
    return all(abs(x - y) <= tolerance * max(abs(x), 1e-12) for x, y in zip(a, b))
