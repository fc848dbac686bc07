"""How fast the PrfaaS prefill worker runs in the deployment against the profile, for bench/sim_vs_real.py.

The profile measures ``decode-0``'s engine, alone, a few minutes before the loads. The PrfaaS
instance is another engine: ``prefill-0``, on its own core, in its network namespace, sending its KV
as it goes. The simulator priced both with the same curve, and the offloaded requests' TTFT came out
too high. Measured from five full runs' saved requests, the PrfaaS path ran at 0.88x the profile's
latency with float32 engines and at 0.94, 0.94, 0.98 and 1.04x with bfloat16.

Near the knee a few percent of the bottleneck's speed moves mean TTFT by far more than that. In the
float32 run, 0.7x the knee's error went from +25% at 1.0x to -27% at 0.887x. So the profile's
three-sample median, taken minutes earlier, cannot be trusted to that precision.

The two calibration loads measure it. They are light, and run just before the compared loads.
``solve`` finds the factor on the PrfaaS instance's latency curve at which the simulator, replaying
the calibration loads' very requests, gives their offloaded requests' measured mean TTFT. The loads
compared afterwards send other prompts, at other rates; the factor is fixed before any of them runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

BOUNDS = (0.5, 2.0)     # a factor outside is no engine's drift but a broken deployment or profile
MIN_REQUESTS = 8        # offloaded calibration requests needed to measure it at all
STEPS = 24              # bisection steps: the factor to about 1e-7 of its range
PROFILE = "prefill_prfaas"


@dataclass(frozen=True, slots=True)
class Speed:
    factor: float           # on the PrfaaS instance's prefill latency curve
    requests: int           # offloaded calibration requests it was measured on
    measured_s: float       # their mean TTFT, measured
    profiled_s: float       # their mean TTFT as the simulator gives it with the profile as it is
    reason: str

    def describe(self) -> str:
        return (f"{self.factor:.3f}x the profile's prefill latency ({self.reason}; {self.requests} offloaded "
                f"calibration requests: mean TTFT {self.measured_s:.3f} s measured, {self.profiled_s:.3f} s "
                "predicted with the profile as it is)")


def solve(mean_at: Callable[[float], float], target: float, bounds: tuple[float, float] = BOUNDS,
          steps: int = STEPS) -> float:
    """The factor in ``bounds`` at which ``mean_at`` (non-decreasing in it) reaches ``target``: a bound
    where the target lies beyond it."""
    lo, hi = bounds
    if mean_at(lo) >= target:
        return lo
    if mean_at(hi) <= target:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mean_at(mid) >= target else (mid, hi)
    return (lo + hi) / 2


def fit(mean_at: Callable[[float], float], measured: list[float]) -> Speed:
    """The PrfaaS instance's factor from the offloaded calibration requests' measured TTFTs; ``mean_at``
    gives the simulator's mean TTFT of the same requests at a factor."""
    profiled = mean_at(1.0)
    if len(measured) < MIN_REQUESTS:
        return Speed(1.0, len(measured), sum(measured) / max(len(measured), 1), profiled,
                     f"fewer than {MIN_REQUESTS} offloaded requests: the profile as it is")
    target = sum(measured) / len(measured)
    factor = solve(mean_at, target)
    reason = "the simulator's mean TTFT equals the measured one"
    if factor in BOUNDS:
        reason = f"at the bound {factor:g}: the deployment or the profile is off by more than an engine drifts"
    return Speed(factor, len(measured), target, profiled, reason)


def with_factor(inputs, factor: float):
    """``inputs`` with the PrfaaS instance's prefill latency curve times ``factor``; the local instance
    keeps the profile's (its engine is the one profiled)."""
    name = inputs.prfaas_pd.prfaas_profile
    curve = inputs.prefill_profiles[name]
    scaled = replace(curve, name=PROFILE, latency_s=tuple(latency * factor for latency in curve.latency_s))
    return replace(inputs, prefill_profiles={**inputs.prefill_profiles, PROFILE: scaled},
                   prfaas_pd=replace(inputs.prfaas_pd, prfaas_profile=PROFILE))
