"""Confidence intervals of the benchmarks' compared figures (pure functions; no I/O).

A prediction compared request by request with what was measured (the simulator replays the very
requests the load generator sent) errs by ``sum(predicted - measured) / sum(measured)``. Requests
that arrive close together share a queue, so their errors are not independent: the interval
resamples whole batches of consecutive requests (a block bootstrap), not single requests.

Past the knee that bootstrap says little: the requests that complete inside the window are the
earliest to arrive, so each batch is all done or all not, and the interval swings with how many of
each a resample draws, however many requests there are. There the load runs as independent
replications instead (each drained, each with prompts of its own), and the interval is Student's t
over their errors (``replication_interval``).
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

NUM_BATCHES = 10
RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    estimate: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def batch_sums(values: Sequence[float], num_batches: int = NUM_BATCHES) -> list[float]:
    """``values`` in order, summed over ``num_batches`` runs of consecutive values as equal as they split."""
    n = len(values)
    bounds = [round(i * n / num_batches) for i in range(num_batches + 1)]
    return [sum(values[start:end]) for start, end in zip(bounds, bounds[1:]) if end > start]


def paired_error_interval(measured: Sequence[float], predicted: Sequence[float], num_batches: int = NUM_BATCHES,
                          resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> Interval:
    """The relative error of ``predicted`` against ``measured`` (paired, in arrival order) and its
    ``level`` block-bootstrap interval over ``num_batches`` batches of consecutive requests."""
    if len(measured) != len(predicted) or not measured:
        raise ValueError(f"need equally many measured and predicted values, at least one "
                         f"({len(measured)} and {len(predicted)})")
    real = batch_sums(measured, num_batches)
    diff = batch_sums([p - m for m, p in zip(measured, predicted)], num_batches)
    estimate = _ratio(sum(diff), sum(real))
    rng = random.Random(seed)
    picks = range(len(real))
    draws = sorted(_ratio(sum(diff[i] for i in chosen), sum(real[i] for i in chosen))
                   for chosen in (rng.choices(picks, k=len(real)) for _ in range(resamples)))
    tail = (1 - level) / 2
    return Interval(estimate, draws[int(tail * (resamples - 1))], draws[math.ceil((1 - tail) * (resamples - 1))])


def replication_interval(measured: Sequence[float], predicted: Sequence[float], level: float = LEVEL) -> Interval:
    """The relative error of ``predicted`` against ``measured`` totals over independent replications
    (one pair per replication), ``sum(predicted - measured) / sum(measured)``, and its ``level``
    Student's t interval from the spread of the replications' own relative errors."""
    if len(measured) != len(predicted) or len(measured) < 2 or min(measured) <= 0:
        raise ValueError(f"need at least two replications, measured totals above 0 ({list(measured)} and "
                         f"{list(predicted)})")
    from scipy.stats import t

    errors = [(p - m) / m for m, p in zip(measured, predicted)]
    estimate = _ratio(sum(predicted) - sum(measured), sum(measured))
    half = t.ppf(1 - (1 - level) / 2, len(errors) - 1) * statistics.stdev(errors) / math.sqrt(len(errors))
    return Interval(estimate, estimate - half, estimate + half)


def proportion_interval(share: float, count: int, level: float = LEVEL) -> Interval:
    """Wilson interval of a share observed over ``count`` trials."""
    if count <= 0:
        return Interval(share, 0.0, 1.0)
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    centre = (share + z * z / (2 * count)) / (1 + z * z / count)
    spread = z / (1 + z * z / count) * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count))
    return Interval(share, max(0.0, centre - spread), min(1.0, centre + spread))


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else (0.0 if not numerator else math.copysign(math.inf, numerator))

