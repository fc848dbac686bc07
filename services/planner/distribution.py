"""The truncated log-normal prompt-length distribution, with exact (closed-form) class statistics.

With ``Z = Phi(b) - Phi(a)`` the truncation mass, the log-normal partial expectation
``E[L; x < L <= y] = exp(mu + sigma^2/2) * (Phi((ln y - mu - sigma^2)/sigma) - Phi((ln x - mu - sigma^2)/sigma)) / Z``
gives E[L | L > t] and E[L | L <= t] exactly, and because profiles are piecewise linear,
``E[f(L) | class]`` is a sum of ``intercept * P(piece) + slope * E[L; piece]`` over the pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.planner.inputs import LengthDistributionSpec
from services.planner.profiles import PiecewiseLinear

_SQRT2 = math.sqrt(2.0)


def normal_mass(za: float, zb: float) -> float:
    """P(za < Z <= zb) for a standard normal Z, accurate in both tails."""
    if za >= zb:
        return 0.0
    if za >= 0.0:
        return 0.5 * (math.erfc(za / _SQRT2) - math.erfc(zb / _SQRT2))
    if zb <= 0.0:
        return 0.5 * (math.erfc(-zb / _SQRT2) - math.erfc(-za / _SQRT2))
    return 1.0 - 0.5 * (math.erfc(-za / _SQRT2) + math.erfc(zb / _SQRT2))


@dataclass(frozen=True)
class TruncatedLogNormal:
    """ln L ~ Normal(mu, sigma), restricted to ``lo <= L <= hi`` tokens."""

    mu: float
    sigma: float
    lo: float
    hi: float

    @classmethod
    def from_spec(cls, spec: LengthDistributionSpec) -> TruncatedLogNormal:
        return cls(spec.mu, spec.sigma, spec.min_tokens, spec.max_tokens)

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and 0 < self.lo < self.hi):
            raise ValueError("need sigma > 0 and 0 < lo < hi")
        if self._mass(self.lo, self.hi) <= 0.0:
            raise ValueError("the truncation range holds no probability mass")

    def _z(self, x: float, shift: float = 0.0) -> float:
        if x <= 0.0:
            return float("-inf")
        if math.isinf(x):
            return float("inf")
        return (math.log(x) - self.mu - shift) / self.sigma

    def _mass(self, x: float, y: float, shift: float = 0.0) -> float:
        return normal_mass(self._z(x, shift), self._z(y, shift))

    @property
    def total_mass(self) -> float:
        return self._mass(self.lo, self.hi)

    def probability(self, x: float, y: float) -> float:
        """P(x < L <= y)."""
        x, y = max(x, self.lo), min(y, self.hi)
        return self._mass(x, y) / self.total_mass if x < y else 0.0

    def partial_mean(self, x: float, y: float) -> float:
        """E[L; x < L <= y] = E[L * 1{x < L <= y}]."""
        x, y = max(x, self.lo), min(y, self.hi)
        if x >= y:
            return 0.0
        s2 = self.sigma * self.sigma
        mass = self._mass(x, y, shift=s2)  # tiny where exp(mu + s2 / 2) is huge: multiply in logs
        return math.exp(self.mu + s2 / 2 + math.log(mass / self.total_mass)) if mass > 0.0 else 0.0

    def cdf(self, x: float) -> float:
        return self.probability(self.lo, x) if x < self.hi else 1.0

    def pdf(self, x: float) -> float:
        if not self.lo <= x <= self.hi:
            return 0.0
        z = self._z(x)
        return math.exp(-z * z / 2) / (x * self.sigma * math.sqrt(2 * math.pi) * self.total_mass)

    def sf(self, t: float) -> float:
        """P(L > t)."""
        return self.probability(t, self.hi)

    @property
    def mean(self) -> float:
        return self.partial_mean(self.lo, self.hi)

    def mean_above(self, t: float) -> float:
        """E[L | L > t]; the limit ``hi`` when no mass lies above t."""
        p = self.sf(t)
        return self.partial_mean(t, self.hi) / p if p > 0.0 else self.hi

    def mean_below(self, t: float) -> float:
        """E[L | L <= t]; the limit ``lo`` when no mass lies below t."""
        q = self.cdf(t)
        return self.partial_mean(self.lo, t) / q if q > 0.0 else self.lo

    def partial_expect(self, f: PiecewiseLinear, x: float, y: float) -> float:
        """E[f(L); x < L <= y], exactly, for a piecewise-linear f."""
        x, y = max(x, self.lo), min(y, self.hi)
        total = 0.0
        for seg in f.segments:
            a, b = max(x, seg.lo), min(y, seg.hi)
            if a < b:
                total += seg.intercept * self.probability(a, b) + seg.slope * self.partial_mean(a, b)
        return total

    def expect(self, f: PiecewiseLinear) -> float:
        return self.partial_expect(f, self.lo, self.hi)

    def expect_above(self, f: PiecewiseLinear, t: float) -> float:
        """E[f(L) | L > t]; f(hi) when no mass lies above t."""
        p = self.sf(t)
        return self.partial_expect(f, t, self.hi) / p if p > 0.0 else f(self.hi)

    def expect_below(self, f: PiecewiseLinear, t: float) -> float:
        """E[f(L) | L <= t]; f(lo) when no mass lies below t."""
        q = self.cdf(t)
        return self.partial_expect(f, self.lo, t) / q if q > 0.0 else f(self.lo)
