"""Arrival processes with a given mean rate: Poisson, bursty on/off, and a 2-state MMPP."""
from __future__ import annotations

import random


class PoissonArrivals:
    def __init__(self, rate: float, rng: random.Random) -> None:
        self._rate, self._expo = rate, rng.expovariate

    def next_after(self, t: float) -> float:
        return t + self._expo(self._rate)


class ModulatedArrivals:
    """A Poisson process whose rate switches between two states with exponential sojourns.

    On/off is the special case with a zero-rate "off" state. Memorylessness makes it exact to
    draw the next arrival at the current state's rate and, if that passes the state's end, to
    restart the draw from the switch.
    """

    def __init__(self, rates: tuple[float, float], sojourns_s: tuple[float, float], rng: random.Random) -> None:
        self._rates, self._sojourns, self._rng = rates, sojourns_s, rng
        self._state = 0
        self._state_end = rng.expovariate(1.0 / sojourns_s[0])

    def next_after(self, t: float) -> float:
        expo = self._rng.expovariate
        while True:
            rate = self._rates[self._state]
            candidate = t + expo(rate) if rate > 0 else float("inf")
            if candidate <= self._state_end:
                return candidate
            t = self._state_end
            self._state ^= 1
            self._state_end = t + expo(1.0 / self._sojourns[self._state])


class ReplayedArrivals:
    """The arrival times of a recorded workload, in order (``next_after`` ignores its argument)."""

    def __init__(self, times: tuple[float, ...]) -> None:
        self._times, self._next = times, 0

    def next_after(self, t: float) -> float:
        at = self._times[self._next]
        self._next += 1
        return at


def make_arrivals(kind: str, rate: float, rng: random.Random, burst_seconds: float = 30.0):
    """``onoff``: on and off periods of mean ``burst_seconds`` each, at twice the mean rate when on.
    ``mmpp``: high (1.6x) and low (0.4x) states of mean ``burst_seconds`` each."""
    if rate <= 0:
        raise ValueError("the arrival rate must be positive")
    if kind == "poisson":
        return PoissonArrivals(rate, rng)
    if kind == "onoff":
        return ModulatedArrivals((2.0 * rate, 0.0), (burst_seconds, burst_seconds), rng)
    if kind == "mmpp":
        return ModulatedArrivals((1.6 * rate, 0.4 * rate), (burst_seconds, burst_seconds), rng)
    raise ValueError(f"unknown arrival process {kind!r} (allowed: poisson, onoff, mmpp)")
