"""A workload fitted to measured requests: the prompt-length distribution, arrival rate and burstiness.

Lengths: a truncated log-normal whose bounds are the sample's extremes (each integer length standing for
the interval of half a token around it) and whose ``mu``/``sigma`` are the maximum-likelihood estimates
for those bounds. A normal truncated to fixed bounds is an exponential family in (x, x^2), so the
estimate is the one whose mean and variance of ``ln L`` equal the sample's; a fixed-point iteration
on the moments finds it. Arrivals: the mean rate and the coefficient of variation (CV) of the gaps
between arrivals, 1 for a Poisson process, above 1 for bursty traffic.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from services.planner.distribution import normal_mass
from services.planner.inputs import LengthDistributionSpec

HALF_TOKEN = 0.5
MIN_SIGMA = 1e-3
MAX_ITERATIONS = 500


class FitError(ValueError):
    """A sample that no distribution can be fitted to; the message says why."""


@dataclass(frozen=True, slots=True)
class ArrivalStats:
    num_requests: int
    duration_s: float
    rate: float
    interarrival_cv: float


def fit_lengths(lengths: Sequence[float]) -> LengthDistributionSpec:
    """The truncated log-normal of the sample (see the module docstring); at least two lengths."""
    if len(lengths) < 2:
        raise FitError(f"need at least 2 prompt lengths to fit, got {len(lengths)}")
    if min(lengths) < 1:
        raise FitError(f"prompt lengths must be at least 1 token, got {min(lengths):g}")
    lo, hi = min(lengths) - HALF_TOKEN, max(lengths) + HALF_TOKEN
    logs = [math.log(x) for x in lengths]
    mu, sigma = truncated_normal_mle(statistics.fmean(logs), statistics.pvariance(logs), math.log(lo), math.log(hi))
    return LengthDistributionSpec("truncated_lognormal", mu, sigma, lo, hi)


def truncated_normal_mle(mean: float, variance: float, a: float, b: float) -> tuple[float, float]:
    """(mu, sigma) of the normal that, truncated to [a, b], has this mean and variance."""
    target_sd = max(math.sqrt(variance), MIN_SIGMA)
    mu, sigma = mean, target_sd
    # A sample as spread as a uniform one has no finite sigma; at twice the bounds' width the truncated
    # normal's variance is within 0.5% of a uniform's, and exp(mu + sigma^2 / 2) stays finite.
    sigma_cap = 2.0 * (b - a)
    for _ in range(MAX_ITERATIONS):
        fitted_mean, fitted_var = truncated_normal_moments(mu, sigma, a, b)
        fitted_sd = math.sqrt(max(fitted_var, 1e-300))
        next_mu = mu + (mean - fitted_mean)
        next_sigma = min(max(sigma * target_sd / fitted_sd, MIN_SIGMA), sigma_cap)
        if abs(next_mu - mu) < 1e-10 and abs(next_sigma - sigma) < 1e-10:
            break
        mu, sigma = next_mu, next_sigma
    return mu, sigma


def truncated_normal_moments(mu: float, sigma: float, a: float, b: float) -> tuple[float, float]:
    """Mean and variance of Normal(mu, sigma) truncated to [a, b]."""
    alpha, beta = (a - mu) / sigma, (b - mu) / sigma
    mass = normal_mass(alpha, beta)
    if mass < 1e-300:  # all the mass lies beyond one bound: the truncated normal hugs that bound
        edge = a if beta <= 0 else b
        return edge, 0.0
    pa, pb = _pdf(alpha), _pdf(beta)
    shift = (pa - pb) / mass
    spread = (alpha * pa - beta * pb) / mass
    return mu + sigma * shift, sigma * sigma * max(1.0 + spread - shift * shift, 0.0)


def arrival_stats(arrival_times_s: Sequence[float]) -> ArrivalStats:
    """Mean rate and CV of the gaps of arrival times (any order, any origin); at least three."""
    times = sorted(arrival_times_s)
    if len(times) < 3:
        raise FitError(f"need at least 3 arrival times to fit a rate and its burstiness, got {len(times)}")
    duration = times[-1] - times[0]
    if duration <= 0:
        raise FitError("all requests arrived at the same instant: no arrival rate can be measured")
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean_gap = duration / len(gaps)
    return ArrivalStats(num_requests=len(times), duration_s=duration, rate=1.0 / mean_gap,
                        interarrival_cv=statistics.pstdev(gaps) / mean_gap)


def _pdf(z: float) -> float:
    return 0.0 if math.isinf(z) else math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

