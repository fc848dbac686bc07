"""The planner's model of the offload threshold (paper, sections 3.3-3.4): what t the link allows.

Offloading every request longer than t sends ``rate * E[S_kv(L); L > t]`` bytes per second across
the cluster link. :class:`OffloadModel` answers the long-timescale question of the threshold
controller (``CongestionAwareThreshold.reoptimize``): given the link bandwidth and the arrival
rate, which threshold should be the floor the controller returns to, and how far may the short
timescale raise it before local prefill becomes the bottleneck.

- **base**: the smallest t >= the planner's threshold whose offloaded KV fits ``headroom`` of the
  link. With a local load model (``local_prefill_s(t)`` = E[T_local(L); L <= t] / N_p, seconds per
  arriving request per instance) it stops where local prefill would become busier than the link
  (smallest t with ``link utilization <= max(headroom, local utilization)``), so an infeasible link
  (both sides overloaded) is balanced instead of moving the whole overload onto the local cluster.
- **ceiling**: the largest t at which local prefill stays below ``local_max_utilization`` (never
  below the base); without a local load model, ``max_tokens``.

Pure: the caller supplies the bandwidth and the arrival rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GBPS = 1e9 / 8


@dataclass(frozen=True, slots=True)
class OffloadModel:
    """``offloaded_kv_bytes(t)`` is E[S_kv(L); L > t] (non-increasing in t); ``local_prefill_s(t)``,
    when given, is the local prefill busy time per arriving request per instance (non-decreasing)."""

    offloaded_kv_bytes: Callable[[float], float]
    min_tokens: float
    max_tokens: float
    local_prefill_s: Callable[[float], float] | None = None
    headroom: float = 0.75
    local_max_utilization: float = 0.9
    resolution_tokens: float = 16.0

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        if not 0 < self.local_max_utilization:
            raise ValueError("local_max_utilization must be positive")
        if not self.min_tokens <= self.max_tokens:
            raise ValueError("need min_tokens <= max_tokens")

    def bounds(self, bandwidth_gbps: float, arrival_rate: float) -> tuple[float, float]:
        """(base, ceiling) for the short-timescale controller, both within [min_tokens, max_tokens]."""
        base = self.required_threshold(bandwidth_gbps, arrival_rate)
        if self.local_prefill_s is None:
            return base, self.max_tokens
        if arrival_rate <= 0:
            return base, base
        local, limit = self.local_prefill_s, self.local_max_utilization / arrival_rate
        if local(base) > limit:
            return base, base
        if local(self.max_tokens) <= limit:
            return base, self.max_tokens
        return base, self._smallest(base, self.max_tokens, lambda t: local(t) > limit)

    def required_threshold(self, bandwidth_gbps: float, arrival_rate: float) -> float:
        """The smallest t >= ``min_tokens`` whose offloaded KV fits ``headroom * bandwidth`` (or,
        with a local load model, fits at least as well as local prefill does)."""
        if arrival_rate <= 0:
            return self.min_tokens
        bandwidth = max(bandwidth_gbps, 0.0) * GBPS

        def fits(t: float) -> bool:
            link = arrival_rate * self.offloaded_kv_bytes(t)
            if link <= self.headroom * bandwidth:
                return True
            return self.local_prefill_s is not None and link <= arrival_rate * self.local_prefill_s(t) * bandwidth

        return self._smallest(self.min_tokens, self.max_tokens, fits)

    def _smallest(self, lo: float, hi: float, holds: Callable[[float], bool]) -> float:
        """The smallest t in [lo, hi] (to ``resolution_tokens``) where a monotone ``holds`` is true;
        ``hi`` when it holds nowhere."""
        if holds(lo):
            return lo
        if not holds(hi):
            return hi
        while hi - lo > self.resolution_tokens:
            mid = (lo + hi) / 2
            if holds(mid):
                hi = mid
            else:
                lo = mid
        return hi
