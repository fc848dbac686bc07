"""Profiled curves (prefill latency, KV size) as piecewise-linear functions of the prompt length.

Between table points the curve is linear; outside them it continues the first or last segment
(linear extrapolation), so a length beyond the profiled range is still priced, not clamped.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from services.planner.inputs import PrefillProfile

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Segment:
    """``y = intercept + slope * x`` for ``lo < x <= hi`` (``lo``/``hi`` may be infinite)."""

    lo: float
    hi: float
    intercept: float
    slope: float


class PiecewiseLinear:
    def __init__(self, xs: tuple[float, ...], ys: tuple[float, ...]) -> None:
        if len(xs) != len(ys) or len(xs) < 2:
            raise ValueError("a piecewise-linear curve needs at least two (x, y) points")
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError("x values must be strictly increasing")
        self.xs = tuple(float(x) for x in xs)
        self.ys = tuple(float(y) for y in ys)
        self.slopes = tuple((y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
        self.intercepts = tuple(y0 - s * x0 for x0, y0, s in zip(xs, ys, self.slopes))
        self._inner = self.xs[1:-1]

    def __call__(self, x: float) -> float:
        i = bisect_right(self._inner, x)
        return self.intercepts[i] + self.slopes[i] * x

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The linear pieces over the whole real line, extrapolated ends included."""
        bounds = (float("-inf"),) + self._inner + (float("inf"),)
        return tuple(Segment(lo, hi, a, b)
                     for lo, hi, a, b in zip(bounds, bounds[1:], self.intercepts, self.slopes))


@dataclass(frozen=True)
class PrefillCurves:
    """One prefill profile: latency in seconds and KV size in bytes, by prompt length in tokens."""

    name: str
    latency_s: PiecewiseLinear
    kv_bytes: PiecewiseLinear | None

    @classmethod
    def from_profile(cls, profile: PrefillProfile) -> PrefillCurves:
        kv = None
        if profile.kv_size_mib is not None:
            kv = PiecewiseLinear(profile.lengths, tuple(v * MIB for v in profile.kv_size_mib))
        return cls(profile.name, PiecewiseLinear(profile.lengths, profile.latency_s), kv)

    @property
    def kv_sizes(self) -> PiecewiseLinear:
        """``kv_bytes`` of a profile that has KV sizes (every profile whose KV crosses clusters)."""
        if self.kv_bytes is None:
            raise ValueError(f"profile {self.name!r} has no KV sizes")
        return self.kv_bytes

    def phi_kv_gbps(self, length: float) -> float:
        """KV throughput a busy instance emits, Phi_kv(l) = S_kv(l) / T_prefill(l), in Gbit/s."""
        return self.kv_sizes(length) * 8 / self.latency_s(length) / 1e9
