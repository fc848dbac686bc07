"""The routing rule and the bandwidth-aware threshold controller the simulator (and the router) run."""
import pytest

from services.planner.inputs import load_plan_inputs
from services.planner.model import PrfaasModel
from services.planner.report import run_plan
from services.scheduling.routing import choose_prefill_site
from services.scheduling.threshold import BandwidthAwareThreshold, ThresholdControllerConfig
from services.simulator.setup import make_controller
from test_simulator import CASE_STUDY


@pytest.mark.parametrize("tokens, threshold, available, site", [
    (20_000, 19_400, True, "prfaas"),
    (19_400, 19_400, True, "local"),      # not longer than t
    (100, 19_400, True, "local"),
    (100_000, 19_400, False, "local"),    # PrfaaS cluster unavailable
    (1, 0, True, "prfaas"),
])
def test_routing_table(tokens, threshold, available, site):
    assert choose_prefill_site(tokens, threshold, available) == site


def linear_kv(t):
    """E[S_kv; L > t] for a toy workload: 1 GB at t = 0 falling linearly to 0 at t = 10,000."""
    return max(0.0, 1e9 * (1 - t / 10_000))


def controller(**overrides):
    config = ThresholdControllerConfig(base_threshold_tokens=2_000, min_tokens=0, max_tokens=10_000,
                                       resolution_tokens=1, **overrides)
    return BandwidthAwareThreshold(config, linear_kv)


def test_keeps_the_base_threshold_while_the_link_has_room():
    # rate 1/s * E[S; L > 2000] = 0.8 GB/s = 6.4 Gbps <= 0.9 * 100 Gbps
    assert controller().observe(100, 1.0) == 2_000


@pytest.mark.parametrize("gbps, headroom, expected", [(4.0, 1.0, 5_000), (4.0, 0.5, 7_500), (0.0, 0.9, 10_000)])
def test_raises_the_threshold_until_the_kv_fits(gbps, headroom, expected):
    # fits when 1e9 * (1 - t/1e4) <= headroom * gbps * 1.25e8 bytes/s
    assert controller(headroom=headroom).observe(gbps, 1.0) == pytest.approx(expected, abs=1)


def test_drops_are_believed_at_once_recoveries_are_smoothed_and_hysteresis_holds():
    c = controller(headroom=1.0, rise_smoothing=0.5, hysteresis=0.1)
    assert c.observe(4.0, 1.0) == pytest.approx(5_000, abs=1)
    assert c.observe(4.2, 1.0) == pytest.approx(5_000, abs=1)  # estimate 4.1 Gbps: t would be 4,875, inside hysteresis
    assert c.bandwidth_estimate_gbps == pytest.approx(4.1)
    assert c.observe(2.0, 1.0) == pytest.approx(7_500, abs=1)  # a drop is taken at once
    assert c.observe(100.0, 1.0) == pytest.approx(2_000, abs=1)  # estimate 51 Gbps: back to the base
    assert c.observe(4.0, 1.0) == pytest.approx(5_000, abs=1)


def test_case_study_controller_balances_link_and_local_prefill():
    inputs = load_plan_inputs(CASE_STUDY)
    plan = run_plan(inputs)
    rate = 0.85 * plan.prfaas.lambda_max
    model = PrfaasModel(inputs)
    kv_per_request = model.offloaded_kv_bytes_per_request
    balanced = make_controller(inputs, plan)
    link_only = BandwidthAwareThreshold(balanced.config, kv_per_request)
    t_balanced, t_link_only = balanced.observe(10, rate), link_only.observe(10, rate)
    assert plan.prfaas.threshold_tokens < t_balanced < t_link_only
    dist = model.distribution
    link_utilization = rate * kv_per_request(t_balanced) / (10e9 / 8)
    local_utilization = rate * dist.partial_expect(model.local.latency_s, dist.lo, t_balanced) / plan.prfaas.num_prefill
    assert link_utilization == pytest.approx(local_utilization, rel=0.01)
    assert rate * kv_per_request(t_link_only) <= 0.9 * 10e9 / 8
