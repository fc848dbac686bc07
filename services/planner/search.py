"""The optimum threshold and prefill/decode split, and the two baselines the paper compares against.

Lambda_max(t) is a minimum of monotone pieces, so it can have kinks and several local peaks
(one per prefill/decode split). The search evaluates a grid of at most ``resolution`` tokens,
then refines around the best few local peaks on finer grids down to one token.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.planner.distribution import TruncatedLogNormal
from services.planner.inputs import PlanInputs
from services.planner.model import Bounds, PrfaasModel, ThresholdStats, decode_rate_per_instance, gbps_to_bytes_per_s
from services.planner.profiles import PrefillCurves

MAX_GRID_POINTS = 200_000
NUM_REFINED_PEAKS = 5
REFINE_POINTS = 200


@dataclass(frozen=True, slots=True)
class PrfaasPlan:
    threshold_tokens: float
    num_prfaas: int
    num_prefill: int
    num_decode: int
    bounds: Bounds
    stats: ThresholdStats
    egress_gbps: float

    @property
    def lambda_max(self) -> float:
        return self.bounds.lambda_max


@dataclass(frozen=True, slots=True)
class HomogeneousPlan:
    num_prefill: int
    num_decode: int
    theta_prefill: float
    theta_decode: float
    mean_tokens: float

    @property
    def lambda_max(self) -> float:
        return min(self.theta_prefill, self.theta_decode)


@dataclass(frozen=True, slots=True)
class NaivePlan:
    theta_prefill: float
    theta_link: float
    theta_decode: float
    mean_tokens: float

    @property
    def lambda_max(self) -> float:
        return min(self.theta_prefill, self.theta_link, self.theta_decode)


def search_prfaas(model: PrfaasModel, resolution: float = 100.0) -> PrfaasPlan:
    lo, hi = model.min_tokens, model.max_tokens
    step = max(resolution, (hi - lo) / MAX_GRID_POINTS)
    candidates = _grid(lo, hi, step)
    while True:
        values = [model.best_split(t)[1] for t in candidates]
        peaks = _top_peaks(values, NUM_REFINED_PEAKS)
        if step <= 1.0:
            break
        fine = step / (REFINE_POINTS / 2)
        candidates = sorted({t for i in peaks
                             for t in _grid(max(lo, candidates[i] - step), min(hi, candidates[i] + step), fine)})
        step = fine
    best_t = candidates[max(peaks, key=lambda i: (values[i], -candidates[i]))]
    return plan_at(model, best_t, model.best_split(best_t)[0])


def plan_at(model: PrfaasModel, t: float, num_prefill: int) -> PrfaasPlan:
    bounds = model.bounds(t, num_prefill)
    return PrfaasPlan(t, model.num_prfaas, num_prefill, model.num_local - num_prefill, bounds, model.stats(t),
                      model.egress_gbps(t, bounds.lambda_max))


def lambda_by_split(model: PrfaasModel, t: float) -> list[tuple[int, float]]:
    """(N_p, Lambda_max) for every split at threshold t: the left panel of the paper's Figure 5."""
    return [(n, model.lambda_max(t, n)) for n in range(1, model.num_local)]


def bounds_by_threshold(model: PrfaasModel, num_prefill: int, num_points: int = 400) -> list[tuple[float, Bounds]]:
    """(t, Bounds) across the length range at a fixed split: the right panel of Figure 5."""
    lo, hi = model.min_tokens, model.max_tokens
    return [(t, model.bounds(t, num_prefill)) for t in _grid(lo, hi, (hi - lo) / num_points)]


def homogeneous_plan(inputs: PlanInputs, exact: bool = False) -> HomogeneousPlan | None:
    deployment = inputs.homogeneous_pd
    if deployment is None:
        return None
    dist = TruncatedLogNormal.from_spec(inputs.workload.input_length)
    latency = PrefillCurves.from_profile(inputs.prefill_profiles[deployment.prefill_profile]).latency_s
    prefill_s = dist.expect(latency) if exact else latency(dist.mean)
    decode_rate = decode_rate_per_instance(inputs.decode_profiles[deployment.decode_profile],
                                           inputs.workload.output_tokens)
    k = deployment.num_instances
    plans = [HomogeneousPlan(n, k - n, n / prefill_s, (k - n) * decode_rate, dist.mean) for n in range(1, k)]
    return max(plans, key=lambda p: (p.lambda_max, -p.num_prefill))


def naive_plan(inputs: PlanInputs, exact: bool = False) -> NaivePlan | None:
    deployment = inputs.naive_heterogeneous
    if deployment is None:
        return None
    dist = TruncatedLogNormal.from_spec(inputs.workload.input_length)
    curves = PrefillCurves.from_profile(inputs.prefill_profiles[deployment.prefill_profile])
    if exact:
        prefill_s, kv_bytes = dist.expect(curves.latency_s), dist.expect(curves.kv_sizes)
    else:
        prefill_s, kv_bytes = curves.latency_s(dist.mean), curves.kv_sizes(dist.mean)
    decode_rate = decode_rate_per_instance(inputs.decode_profiles[deployment.decode_profile],
                                           inputs.workload.output_tokens)
    return NaivePlan(deployment.num_prefill / prefill_s,
                     gbps_to_bytes_per_s(deployment.cross_cluster_gbps) / kv_bytes,
                     deployment.num_decode * decode_rate, dist.mean)


def _grid(lo: float, hi: float, step: float) -> list[float]:
    points = [lo + i * step for i in range(int((hi - lo) / step) + 1)]
    if points[-1] < hi:
        points.append(hi)
    return points


def _top_peaks(values: list[float], count: int) -> list[int]:
    """Indices of the highest local maxima (plateaus included), best first."""
    last = len(values) - 1
    peaks = [i for i, v in enumerate(values)
             if (i == 0 or v >= values[i - 1]) and (i == last or v >= values[i + 1])]
    return sorted(peaks, key=lambda i: -values[i])[:count]
