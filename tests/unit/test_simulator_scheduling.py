"""The routing rule, the planner's offload model and the router's threshold controller as the
simulator runs them (the controller's own behaviours are in test_congestion_threshold.py)."""
import math

import pytest

from services.planner.model import PrfaasModel
from services.scheduling.congestion import CongestionAwareThreshold, LinkSample
from services.scheduling.routing import choose_prefill_site
from services.scheduling.threshold import OffloadModel
from services.simulator.bandwidth import parse_trace
from services.simulator.engine import simulate
from services.simulator.setup import make_controller
from test_simulator import spec_for


@pytest.mark.parametrize("tokens, threshold, available, site", [
    (20_000, 19_400, True, "prfaas"),
    (19_400, 19_400, True, "local"),      # not longer than t
    (100, 19_400, True, "local"),
    (100_000, 19_400, False, "local"),    # PrfaaS cluster unavailable
    (100_000, math.inf, True, "local"),   # offloading stopped
    (1, 0, True, "prfaas"),
])
def test_routing_table(tokens, threshold, available, site):
    assert choose_prefill_site(tokens, threshold, available) == site


def linear_kv(t):
    """E[S_kv; L > t] for a toy workload: 1 GB at t = 0 falling linearly to 0 at t = 10,000."""
    return max(0.0, 1e9 * (1 - t / 10_000))


def linear_local(t):
    """Local prefill seconds per arriving request per instance: 0 at t = 0, 1 s at t = 10,000."""
    return t / 10_000


def offload_model(**overrides):
    return OffloadModel(linear_kv, min_tokens=2_000, max_tokens=10_000, resolution_tokens=1, **overrides)


@pytest.mark.parametrize("gbps, rate, headroom, expected", [
    (100.0, 1.0, 0.9, 2_000),     # 6.4 Gbps of KV fits: the planner's threshold stays
    (4.0, 1.0, 1.0, 5_000),       # fits when 1e9 * (1 - t/1e4) <= headroom * gbps * 1.25e8
    (4.0, 1.0, 0.5, 7_500),
    (0.0, 1.0, 0.9, 10_000),
    (4.0, 0.0, 0.9, 2_000),       # no traffic
])
def test_required_threshold_fits_the_kv_into_the_link(gbps, rate, headroom, expected):
    assert offload_model(headroom=headroom).required_threshold(gbps, rate) == pytest.approx(expected, abs=1)


@pytest.mark.parametrize("gbps, rate, base, ceiling", [
    (100.0, 0.5, 2_000, 10_000),  # local prefill stays under 0.9 up to the maximum
    (100.0, 1.0, 2_000, 9_000),   # local prefill reaches 0.9 at t = 9,000
    (4.0, 1.0, 5_000, 9_000),     # the link needs t >= 5,000; local prefill has room above it
    (1.0, 2.0, 8_889, 8_889),     # infeasible: 2e9 (1 - t/1e4) = 2 (t/1e4) 1.25e8 balances at 8/9; no raise
])
def test_bounds_cap_the_raise_where_local_prefill_would_bind(gbps, rate, base, ceiling):
    model = offload_model(local_prefill_s=linear_local, headroom=1.0)
    assert model.bounds(gbps, rate) == (pytest.approx(base, abs=2), pytest.approx(ceiling, abs=2))


def test_case_study_model_balances_link_and_local_prefill(case):
    inputs, plan = case
    rate = 0.85 * plan.prfaas.lambda_max
    model = PrfaasModel(inputs)
    kv_per_request = model.offloaded_kv_bytes_per_request
    balanced = make_controller(inputs, plan, headroom=0.9).model
    link_only = OffloadModel(kv_per_request, balanced.min_tokens, balanced.max_tokens, headroom=0.9)
    t_balanced, t_link_only = balanced.required_threshold(10, rate), link_only.required_threshold(10, rate)
    assert plan.prfaas.threshold_tokens < t_balanced < t_link_only
    dist = model.distribution
    link_utilization = rate * kv_per_request(t_balanced) / (10e9 / 8)
    local_utilization = rate * dist.partial_expect(model.local.latency_s, dist.lo, t_balanced) / plan.prfaas.num_prefill
    assert link_utilization == pytest.approx(local_utilization, rel=0.01)
    assert rate * kv_per_request(t_link_only) <= 0.9 * 10e9 / 8


def link(now_s, gbps=10.0, capacity=100.0, **signals):
    """A sample as the simulator synthesizes it (4 PrfaaS instances, 3 local prefill instances)."""
    return LinkSample(now_s=now_s, egress_gbps=gbps, capacity_gbps=capacity,
                      num_usable_workers=4 if capacity > 0 else 0, num_local_workers=3,
                      **{"num_local_queued": 0, **signals})


BASE = "base"
RAISED = "raised"
STOPPED = "stopped"


@pytest.mark.parametrize("name, samples, state", [
    ("headroom at 100 Gbps keeps the planner's t", [link(0)], BASE),
    ("a saturated 10 Gbps link raises t", [link(0, gbps=9.5, capacity=10)], RAISED),
    ("a transfer waiting longer than the RTT proxy raises t", [link(0, rtt_increase_ms=5_000)], RAISED),
    ("a long PrfaaS queue with idle local prefill raises t", [link(0, num_queued=40)], RAISED),
    ("not when local prefill is queued deeper", [link(0, num_queued=40, num_local_queued=60)], BASE),
    ("the link at 0 Gbps stops offloading", [link(0), link(1, gbps=0, capacity=0)], STOPPED),
    ("still stopped within the hold", [link(0, gbps=0, capacity=0), link(1), link(5.5)], STOPPED),
    ("offloading resumes after the hold", [link(0, gbps=0, capacity=0), link(1), link(6.5)], BASE),
])
def test_controller_in_the_simulator_setting(case, name, samples, state):
    controller = make_controller(*case)
    thresholds = [controller.observe(s) for s in samples]
    assert controller.state == state, name
    base = case[1].prfaas.threshold_tokens
    expected = {BASE: base, STOPPED: math.inf}.get(state)
    assert thresholds[-1] == expected if expected is not None else thresholds[-1] > base


def test_lowers_with_hysteresis_after_the_link_recovers(case):
    controller = make_controller(*case)
    saturated = [controller.observe(link(t, gbps=9.8, capacity=10)) for t in range(0, 16)]
    assert saturated[-1] > saturated[0] > case[1].prfaas.threshold_tokens
    between_bands = [controller.observe(link(t, gbps=70)) for t in range(16, 40)]
    assert set(between_bands) == {saturated[-1]}           # 0.6 <= utilization <= 0.85: hold
    recovered = [controller.observe(link(t, gbps=10)) for t in range(40, 100)]
    changes = [t for t, (a, b) in enumerate(zip(recovered, recovered[1:]), start=41) if a != b]
    assert all(b - a >= controller.config.hold_s for a, b in zip(changes, changes[1:]))
    assert recovered[-1] == case[1].prfaas.threshold_tokens and controller.state == BASE


def test_reoptimize_moves_the_base_with_the_bandwidth(case):
    inputs, plan = case
    controller = make_controller(inputs, plan)
    rate = 0.85 * plan.prfaas.lambda_max
    assert controller.reoptimize(100, rate) == plan.prfaas.threshold_tokens
    dropped = controller.reoptimize(10, rate)
    assert dropped > plan.prfaas.threshold_tokens and controller.base_tokens == dropped
    assert controller.ceiling_tokens >= controller.base_tokens
    assert controller.observe(link(0, gbps=9.9, capacity=10)) <= controller.ceiling_tokens
    controller.reoptimize(100, rate)
    assert controller.base_tokens == plan.prfaas.threshold_tokens
    held = controller.threshold_tokens                     # the new ceiling caps it; the rest is the short timescale's
    assert held == min(dropped, controller.ceiling_tokens) > plan.prfaas.threshold_tokens
    assert controller.observe(link(10, gbps=10)) < held


def test_the_simulator_runs_the_routers_controller_class(case, monkeypatch):
    from services.router import threshold_control

    controller = make_controller(*case)
    assert type(controller) is threshold_control.CongestionAwareThreshold is CongestionAwareThreshold
    seen: list[tuple[LinkSample, float]] = []
    observe = CongestionAwareThreshold.observe

    def spy(self, sample):
        seen.append((sample, observe(self, sample)))
        return seen[-1][1]

    monkeypatch.setattr(CongestionAwareThreshold, "observe", spy)
    load_factor, num_requests = 0.85, 4_000
    duration = num_requests / (load_factor * case[1].prfaas.lambda_max)
    trace = parse_trace("0:100,40%:0,60%:100", duration)
    result = simulate(spec_for(case, "adaptive", load_factor, num_requests, bandwidth_trace=trace), controller)
    assert len(seen) > 0.5 * duration  # about one sample per simulated second
    down = [t for s, t in seen if trace[1][0] <= s.now_s < trace[2][0]]
    assert down and all(t == math.inf for t in down)
    after = [t for s, t in seen if s.now_s >= trace[2][0] + 2 * controller.config.hold_s]
    assert after and all(t < math.inf for t in after)
    assert result.ttfts[num_requests - 1] > 0
