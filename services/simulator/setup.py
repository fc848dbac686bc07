"""What one simulation run models: the deployment a policy runs on, the workload, the offered load."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from services.planner.distribution import TruncatedLogNormal
from services.planner.inputs import PlanInputs, PrefixHitSpec
from services.planner.model import PrfaasModel
from services.planner.profiles import PiecewiseLinear, PrefillCurves
from services.planner.report import PlanResult
from services.scheduling.congestion import CongestionAwareThreshold, CongestionControllerConfig
from services.scheduling.placement import WorkerView
from services.scheduling.threshold import OffloadModel
from services.simulator.runtime import RuntimeModel

Policy = Literal["homogeneous", "naive", "static", "adaptive"]
POLICIES: tuple[Policy, ...] = ("homogeneous", "naive", "static", "adaptive")
ARRIVALS = ("poisson", "onoff", "mmpp")


@dataclass(frozen=True)
class Topology:
    """The servers one policy runs on; a cluster with zero instances is absent."""

    num_prfaas: int
    num_local_prefill: int
    num_decode: int
    max_batch_size: int
    decode_step_s: float
    prfaas_latency: PiecewiseLinear | None
    prfaas_kv_bytes: PiecewiseLinear | None
    local_latency: PiecewiseLinear | None
    link_gbps: float
    kv_bytes: PiecewiseLinear | None = None   # the model's KV bytes by length, for pool loads
    num_both: int = 0                         # colocated workers: prefill (local path) and decode in one engine
    decode_step_curve: PiecewiseLinear | None = None  # colocated decode step by batch size (None: decode_step_s)


@dataclass(frozen=True)
class Workload:
    lengths: TruncatedLogNormal
    output_tokens: int
    prefix_hit: PrefixHitSpec | None = None


@dataclass(frozen=True)
class RunSpec:
    """One run: a policy on its topology, at an offered rate, under a bandwidth trace."""

    policy: Policy
    topology: Topology
    workload: Workload
    rate: float
    num_requests: int
    threshold_tokens: float
    arrivals: str = "poisson"
    burst_seconds: float = 30.0
    bandwidth_trace: tuple[tuple[float, float], ...] = ()
    mean_length_mode: bool = False
    seed: int = 0
    ttft_slo_s: float | None = None
    slo_factor: float = 2.0
    observe_interval_s: float = 1.0
    reoptimize_interval_s: float = 300.0
    num_samples: int = 1000
    progress: bool = False
    runtime: RuntimeModel = RuntimeModel()
    replay: tuple[tuple[float, float], ...] = ()  # (arrival s, prompt tokens) per request: a recorded workload

    def __post_init__(self) -> None:
        if self.replay and len(self.replay) != self.num_requests:
            raise ValueError(f"a replayed workload of {len(self.replay)} requests cannot run {self.num_requests}")
        if any(b[0] < a[0] for a, b in zip(self.replay, self.replay[1:])):
            raise ValueError("a replayed workload's arrival times must not decrease")


def deployment_views(topology: Topology) -> tuple[WorkerView, ...]:
    """The deployment as ``choose_route`` sees it: one worker per role, each standing for its pool."""
    views = [WorkerView("decode", True, role="decode", receives_kv=True)]
    if topology.num_prfaas:
        views.append(WorkerView("prfaas", True, role="prefill", cluster="prfaas", generates=False, prefills=True))
    if topology.num_local_prefill:
        views.append(WorkerView("local", True, role="prefill", cluster="local", generates=False, prefills=True))
    return tuple(views)


def colocated(topology: Topology, num_both: int, step_by_batch: tuple[tuple[float, float], ...] = ()) -> Topology:
    """``topology`` with its local PD instances (prefill-role and decode-role) replaced by ``num_both``
    colocated workers, which prefill with the local prefill profile and decode with the decode profile
    (each step priced by ``step_by_batch``, (batch size, seconds) points, where given); ``topology``
    itself when ``num_both`` is 0."""
    if not num_both:
        return topology
    curve = PiecewiseLinear(*zip(*step_by_batch)) if step_by_batch else None
    return replace(topology, num_local_prefill=0, num_decode=0, num_both=num_both, decode_step_curve=curve)


def contended(topology: Topology, factor: float) -> Topology:
    """``topology`` with every engine's prefill latency and decode step ``factor`` times longer (the
    share of their cores the host's other processes take: ``RuntimeModel.contention_factor``)."""
    if factor == 1.0:
        return topology

    def slower(curve: PiecewiseLinear | None) -> PiecewiseLinear | None:
        return None if curve is None else PiecewiseLinear(curve.xs, tuple(y * factor for y in curve.ys))

    return replace(topology, decode_step_s=topology.decode_step_s * factor,
                   decode_step_curve=slower(topology.decode_step_curve),
                   prfaas_latency=slower(topology.prfaas_latency), local_latency=slower(topology.local_latency))


def workload_of(inputs: PlanInputs) -> Workload:
    return Workload(TruncatedLogNormal.from_spec(inputs.workload.input_length), inputs.workload.output_tokens,
                    inputs.workload.prefix_hit)


def topology_for(policy: Policy, inputs: PlanInputs, plan: PlanResult) -> Topology:
    """Homogeneous and naive run on their own deployments (best split for homogeneous); static
    and adaptive run on the PrfaaS-PD deployment with the planner's split."""
    if policy == "homogeneous":
        if inputs.homogeneous_pd is None or plan.homogeneous is None:
            raise ValueError("the config has no deployments.homogeneous_pd")
        dep = inputs.homogeneous_pd
        return _topology(inputs, 0, None, plan.homogeneous.num_prefill, dep.prefill_profile,
                         plan.homogeneous.num_decode, dep.decode_profile, 0.0)
    if policy == "naive":
        if inputs.naive_heterogeneous is None:
            raise ValueError("the config has no deployments.naive_heterogeneous")
        dep = inputs.naive_heterogeneous
        return _topology(inputs, dep.num_prefill, dep.prefill_profile, 0, None, dep.num_decode,
                         dep.decode_profile, dep.cross_cluster_gbps)
    dep = inputs.prfaas_pd
    return _topology(inputs, dep.num_prfaas, dep.prfaas_profile, plan.prfaas.num_prefill, dep.prefill_profile,
                     plan.prfaas.num_decode, dep.decode_profile, dep.cross_cluster_gbps)


SIMULATED_LINK = {
    # The simulated link has no TCP: its "RTT increase" is how long the oldest KV transfer has
    # waited for the link, and transfers take ~0.1-2 s each, so 20 ms (the router's default) would
    # count every second transfer as congestion. Retransmissions never occur.
    "rtt_increase_ms": 2000.0,
}


def make_controller(inputs: PlanInputs, plan: PlanResult, headroom: float = 0.75,
                    **overrides) -> CongestionAwareThreshold:
    """The adaptive policy's controller: the router's ``CongestionAwareThreshold`` starting at the
    planner's threshold, with the planner's model for its long-timescale re-optimisation (the
    offloaded KV bytes E[S_kv(L); L > t] and the local prefill load E[T_local(L); L <= t] / N_p).
    ``overrides`` are ``CongestionControllerConfig`` fields."""
    spec = inputs.workload.input_length
    config = CongestionControllerConfig(**{
        "base_threshold_tokens": plan.prfaas.threshold_tokens, "max_threshold_tokens": spec.max_tokens,
        "link_capacity_gbps": inputs.prfaas_pd.cross_cluster_gbps, **SIMULATED_LINK, **overrides})
    model = PrfaasModel(inputs)
    local = model.local.latency_s
    num_prefill = plan.prfaas.num_prefill

    def local_prefill_s(t: float) -> float:
        return model.distribution.partial_expect(local, model.distribution.lo, t) / num_prefill

    offload = OffloadModel(model.offloaded_kv_bytes_per_request, min_tokens=plan.prfaas.threshold_tokens,
                           max_tokens=spec.max_tokens, local_prefill_s=local_prefill_s, headroom=headroom)
    return CongestionAwareThreshold(config, offload)


def _topology(inputs: PlanInputs, num_prfaas: int, prfaas_profile: str | None, num_local: int,
              local_profile: str | None, num_decode: int, decode_profile: str, link_gbps: float) -> Topology:
    prfaas = PrefillCurves.from_profile(inputs.prefill_profiles[prfaas_profile]) if prfaas_profile else None
    local = PrefillCurves.from_profile(inputs.prefill_profiles[local_profile]) if local_profile else None
    decode = inputs.decode_profiles[decode_profile]
    kv_profiles = [p for p in (prfaas_profile, local_profile, *inputs.prefill_profiles)
                   if p and inputs.prefill_profiles[p].kv_size_mib is not None]
    return Topology(num_prfaas=num_prfaas, num_local_prefill=num_local, num_decode=num_decode,
                    max_batch_size=decode.max_batch_size, decode_step_s=decode.step_time_s,
                    prfaas_latency=prfaas.latency_s if prfaas else None,
                    prfaas_kv_bytes=prfaas.kv_bytes if prfaas else None,
                    local_latency=local.latency_s if local else None, link_gbps=link_gbps,
                    kv_bytes=PrefillCurves.from_profile(inputs.prefill_profiles[kv_profiles[0]]).kv_bytes
                    if kv_profiles else None)
