"""When requests are sent: pure generators of arrival times (seconds from the start), RNG passed in.

Gamma-distributed gaps as in `vllm bench serve`: shape = burstiness, mean = 1 / rate, so burstiness 1.0
is a Poisson process and smaller values are burstier. On/off arrivals run that process only during
the on periods.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def gamma_arrivals(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Arrival times of a gamma renewal process; everything at t=0 for an infinite rate."""
    now = 0.0
    while True:
        yield now
        if not math.isinf(rate):
            now += rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))


def onoff_arrivals(rate: float, burstiness: float, on_s: float, off_s: float,
                   rng: np.random.Generator) -> Iterator[float]:
    """The gamma process in 'active time', stretched so that every `on_s` of it is followed by `off_s` idle."""
    for active in gamma_arrivals(rate, burstiness, rng):
        yield to_wall_time(active, on_s, off_s)


def to_wall_time(active_s: float, on_s: float, off_s: float) -> float:
    return active_s + math.floor(active_s / on_s) * off_s


def replayed_arrivals(timestamps: list[float]) -> Iterator[float]:
    """A trace's timestamps, shifted so the first request goes at t=0."""
    if not timestamps:
        return
    first = min(timestamps)
    for stamp in timestamps:
        yield stamp - first
