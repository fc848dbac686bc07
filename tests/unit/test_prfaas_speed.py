"""bench/_prfaas_speed.py: the PrfaaS prefill worker's speed against the profile, measured on the calibration
loads' offloaded requests, and applied to the PrfaaS instance's latency curve alone."""
import pytest
from support.bench import bench_module
from support.planner_inputs import synthetic_raw

from services.planner.inputs import parse_plan_inputs
from services.planner.report import run_plan
from services.simulator.setup import topology_for

speed = bench_module("_prfaas_speed")


def test_the_factor_is_where_the_simulated_mean_meets_the_measured_one():
    calls = []

    def mean_at(factor):  # a queue: the mean grows faster than the service time near saturation
        calls.append(factor)
        return factor / (1.2 - 0.5 * factor)

    factor = speed.solve(mean_at, 1.5)
    assert mean_at(factor) == pytest.approx(1.5, rel=1e-5)
    assert len(calls) <= speed.STEPS + 3
    assert speed.solve(lambda f: f, 0.1) == speed.BOUNDS[0]
    assert speed.solve(lambda f: f, 9.0) == speed.BOUNDS[1]


def test_the_fit_says_how_it_got_its_factor():
    def mean_at(factor):
        return 2.0 * factor

    fitted = speed.fit(mean_at, [1.6, 1.8, 1.7, 1.9, 1.8, 1.6, 1.8, 1.8])
    assert fitted.factor == pytest.approx(0.875, rel=1e-5)
    assert (fitted.requests, fitted.profiled_s) == (8, 2.0)
    assert fitted.measured_s == pytest.approx(1.75)
    assert "equals the measured one" in fitted.describe() and "0.875x" in fitted.describe()
    too_few = speed.fit(mean_at, [1.0] * (speed.MIN_REQUESTS - 1))
    assert too_few.factor == 1.0 and "fewer than" in too_few.reason
    beyond = speed.fit(mean_at, [9.0] * 10)
    assert beyond.factor == speed.BOUNDS[1] and "at the bound" in beyond.reason


def test_only_the_prfaas_instance_is_scaled():
    inputs = parse_plan_inputs(synthetic_raw())
    scaled = speed.with_factor(inputs, 0.8)
    assert scaled.prfaas_pd.prfaas_profile == speed.PROFILE
    assert scaled.prefill_profiles[speed.PROFILE].latency_s == pytest.approx((0.4, 0.8))
    assert scaled.prefill_profiles["fast"] == inputs.prefill_profiles["fast"]  # the naive deployment's, untouched
    assert scaled.prefill_profiles[speed.PROFILE].kv_size_mib == inputs.prefill_profiles["fast"].kv_size_mib
    before = topology_for("static", inputs, run_plan(inputs))
    after = topology_for("static", scaled, run_plan(scaled))
    assert after.prfaas_latency(1500) == pytest.approx(0.8 * before.prfaas_latency(1500))
    assert after.local_latency(1500) == pytest.approx(before.local_latency(1500))
