"""The PrfaaS throughput model (paper, section 3.4).

For a threshold t, requests longer than t (fraction p = P(L > t)) prefill on the PrfaaS cluster
and ship their KV across the link; the rest prefill on the local PD cluster's N_p prefill
instances; every request decodes on the N_d local decode instances:

    Theta_prfaas = min(N_prfaas / T_prfaas(l_long), B_out / S_kv(l_long))
    Theta_pd_p   = N_p / T_local(l_short)
    Theta_pd_d   = N_d * BS_max / (T_decode * L_out)
    Lambda_max   = min(Theta_prfaas / p, Theta_pd_p / (1 - p), Theta_pd_d)

with l_long = E[L | L > t] and l_short = E[L | L <= t] (the paper's simplification). In exact
mode T(l_long) becomes E[T(L) | L > t], and likewise for T(l_short) and S_kv(l_long).
"""
from __future__ import annotations

from dataclasses import dataclass

from services.planner.distribution import TruncatedLogNormal
from services.planner.inputs import DecodeProfile, PlanInputs
from services.planner.profiles import PrefillCurves

INF = float("inf")


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def decode_rate_per_instance(profile: DecodeProfile, output_tokens: int) -> float:
    """Requests per second one decode instance finishes with all batch slots busy."""
    return profile.max_batch_size / (profile.step_time_s * output_tokens)


@dataclass(frozen=True, slots=True)
class ThresholdStats:
    """Everything about a threshold that does not depend on the prefill/decode split."""

    threshold_tokens: float
    offloaded_fraction: float
    mean_long_tokens: float
    mean_short_tokens: float
    long_prefill_s: float
    long_kv_bytes: float
    short_prefill_s: float


@dataclass(frozen=True, slots=True)
class Bounds:
    theta_prfaas: float
    theta_pd_p: float
    theta_pd_d: float
    offloaded_fraction: float

    @property
    def prfaas_limit(self) -> float:
        """Theta_prfaas / p: the arrival rate at which the PrfaaS cluster (or the link) saturates."""
        p = self.offloaded_fraction
        return self.theta_prfaas / p if p > 0 else INF

    @property
    def local_prefill_limit(self) -> float:
        """Theta_pd_p / (1 - p): the arrival rate at which local prefill saturates."""
        q = 1.0 - self.offloaded_fraction
        return self.theta_pd_p / q if q > 0 else INF

    @property
    def lambda_max(self) -> float:
        return min(self.prfaas_limit, self.local_prefill_limit, self.theta_pd_d)


class PrfaasModel:
    """Evaluates the model for one input file; ``stats(t)`` is cached, so searches stay cheap."""

    def __init__(self, inputs: PlanInputs, exact: bool = False, bandwidth_gbps: float | None = None) -> None:
        deployment = inputs.prfaas_pd
        self.exact = exact
        self.distribution = TruncatedLogNormal.from_spec(inputs.workload.input_length)
        self.prfaas = PrefillCurves.from_profile(inputs.prefill_profiles[deployment.prfaas_profile])
        self.local = PrefillCurves.from_profile(inputs.prefill_profiles[deployment.prefill_profile])
        self.num_prfaas = deployment.num_prfaas
        self.num_local = deployment.num_local
        gbps = deployment.cross_cluster_gbps if bandwidth_gbps is None else bandwidth_gbps
        self.bandwidth_bytes_per_s = gbps_to_bytes_per_s(gbps)
        self.decode_rate = decode_rate_per_instance(inputs.decode_profiles[deployment.decode_profile],
                                                    inputs.workload.output_tokens)
        self._cache: dict[float, ThresholdStats] = {}

    @property
    def min_tokens(self) -> float:
        return self.distribution.lo

    @property
    def max_tokens(self) -> float:
        return self.distribution.hi

    def stats(self, t: float) -> ThresholdStats:
        cached = self._cache.get(t)
        if cached is None:
            cached = self._cache[t] = self._compute_stats(t)
        return cached

    def _compute_stats(self, t: float) -> ThresholdStats:
        d = self.distribution
        l_long, l_short = d.mean_above(t), d.mean_below(t)
        if self.exact:
            long_s, long_kv = d.expect_above(self.prfaas.latency_s, t), d.expect_above(self.prfaas.kv_sizes, t)
            short_s = d.expect_below(self.local.latency_s, t)
        else:
            long_s, long_kv = self.prfaas.latency_s(l_long), self.prfaas.kv_sizes(l_long)
            short_s = self.local.latency_s(l_short)
        return ThresholdStats(t, d.sf(t), l_long, l_short, long_s, long_kv, short_s)

    def bounds(self, t: float, num_prefill: int) -> Bounds:
        s = self.stats(t)
        theta_prfaas = min(self.num_prfaas / s.long_prefill_s, self.bandwidth_bytes_per_s / s.long_kv_bytes)
        theta_pd_p = num_prefill / s.short_prefill_s
        theta_pd_d = (self.num_local - num_prefill) * self.decode_rate
        return Bounds(theta_prfaas, theta_pd_p, theta_pd_d, s.offloaded_fraction)

    def lambda_max(self, t: float, num_prefill: int) -> float:
        return self.bounds(t, num_prefill).lambda_max

    def best_split(self, t: float) -> tuple[int, float]:
        """The N_p in 1..count-1 that maximizes Lambda_max at threshold t, and that maximum.

        min(a * N_p, c * (count - N_p)) rises then falls in N_p, so the best integer split is the
        floor or ceiling of the real crossing point; ties go to the smaller N_p.
        """
        s = self.stats(t)
        q = 1.0 - s.offloaded_fraction
        a = 1.0 / (s.short_prefill_s * q) if q > 0 else INF
        c = self.decode_rate
        k = self.num_local
        crossing = 1.0 if a == INF else c * k / (a + c)
        candidates = sorted({min(max(n, 1), k - 1) for n in (int(crossing), int(crossing) + 1)})
        best = max(candidates, key=lambda n: (self.lambda_max(t, n), -n))
        return best, self.lambda_max(t, best)

    def egress_gbps(self, t: float, arrival_rate: float) -> float:
        s = self.stats(t)
        return arrival_rate * s.offloaded_fraction * s.long_kv_bytes * 8 / 1e9

    def offloaded_kv_bytes_per_request(self, t: float) -> float:
        """E[S_kv(L); L > t]: KV bytes the link carries per arriving request (always exact)."""
        d = self.distribution
        return d.partial_expect(self.prfaas.kv_sizes, t, d.hi)
