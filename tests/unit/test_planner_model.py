"""The planner's pieces against hand values and brute-force numerics."""
import math

import pytest
from support.planner_inputs import synthetic_raw

from services.planner import search as search_module
from services.planner.distribution import TruncatedLogNormal
from services.planner.inputs import parse_plan_inputs
from services.planner.model import PrfaasModel
from services.planner.profiles import MIB, PiecewiseLinear
from services.planner.search import homogeneous_plan, naive_plan, search_prfaas

CURVE = PiecewiseLinear((1.0, 3.0, 7.0), (10.0, 20.0, 28.0))  # slopes 5, then 2


@pytest.mark.parametrize("x, y", [
    (1.0, 10.0), (2.0, 15.0), (3.0, 20.0), (5.0, 24.0), (7.0, 28.0),  # knots and interior
    (0.0, 5.0), (-1.0, 0.0),                                          # extrapolates the first segment
    (9.0, 32.0), (17.0, 48.0),                                        # extrapolates the last segment
])
def test_piecewise_linear_interpolates_and_extrapolates(x, y):
    assert CURVE(x) == pytest.approx(y)


def brute_expect(dist, f, a, b, points=40_000):
    """E[f(L); a < L <= b] by the midpoint rule over ln L (independent of the closed forms)."""
    lo, hi = math.log(max(a, dist.lo)), math.log(min(b, dist.hi))
    if lo >= hi:
        return 0.0
    du = (hi - lo) / points
    total = mass = 0.0
    for i in range(points):
        u = lo + (i + 0.5) * du
        w = math.exp(-((u - dist.mu) / dist.sigma) ** 2 / 2)
        total += f(math.exp(u)) * w
    la, lb = math.log(dist.lo), math.log(dist.hi)
    for i in range(points):
        u = la + (i + 0.5) * (lb - la) / points
        mass += math.exp(-((u - dist.mu) / dist.sigma) ** 2 / 2)
    return total * du / (mass * (lb - la) / points)


DIST = TruncatedLogNormal(mu=9.9, sigma=1.0, lo=128.0, hi=131072.0)


def test_symmetric_truncation_hand_values():
    mu, sigma = 5.0, 0.7
    dist = TruncatedLogNormal(mu, sigma, math.exp(mu - 2 * sigma), math.exp(mu + 2 * sigma))
    assert dist.sf(math.exp(mu)) == pytest.approx(0.5, abs=1e-12)
    assert dist.cdf(math.exp(mu + 2 * sigma)) == pytest.approx(1.0)
    untruncated = TruncatedLogNormal(mu, sigma, 1e-9, 1e12)
    assert untruncated.mean == pytest.approx(math.exp(mu + sigma ** 2 / 2), rel=1e-9)
    # E[L | L > median] of an untruncated log-normal: 2 * exp(mu + s^2/2) * Phi(s)
    phi_sigma = 0.5 * (1 + math.erf(sigma / math.sqrt(2)))
    expected = 2 * math.exp(mu + sigma ** 2 / 2) * phi_sigma
    assert untruncated.mean_above(math.exp(mu)) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("t", [128.0, 1000.0, 19400.0, 60000.0, 131000.0])
def test_class_means_match_brute_force(t):
    ident = lambda x: x  # noqa: E731
    one = lambda x: 1.0  # noqa: E731
    p = brute_expect(DIST, one, t, DIST.hi)
    assert DIST.sf(t) == pytest.approx(p, rel=1e-6, abs=1e-12)
    assert DIST.mean_above(t) == pytest.approx(brute_expect(DIST, ident, t, DIST.hi) / p, rel=1e-6)
    if t > DIST.lo:
        assert DIST.mean_below(t) == pytest.approx(brute_expect(DIST, ident, DIST.lo, t) / (1 - p), rel=1e-6)


@pytest.mark.parametrize("t", [500.0, 8192.0, 19400.0, 50000.0])
def test_expectation_of_piecewise_profile_matches_brute_force(t):
    latency = PiecewiseLinear((1024, 8192, 32768, 131072), (0.44, 0.72, 1.84, 7.40))
    above = brute_expect(DIST, latency, t, DIST.hi) / DIST.sf(t)
    below = brute_expect(DIST, latency, DIST.lo, t) / DIST.cdf(t)
    assert DIST.expect_above(latency, t) == pytest.approx(above, rel=1e-6)
    assert DIST.expect_below(latency, t) == pytest.approx(below, rel=1e-6)
    # latency is convex, so pricing the mean length understates the mean latency (Jensen)
    assert latency(DIST.mean_above(t)) <= DIST.expect_above(latency, t)


def test_limits_with_no_mass_on_one_side():
    assert DIST.sf(DIST.hi) == 0.0 and DIST.mean_above(DIST.hi) == DIST.hi
    assert DIST.cdf(DIST.lo) == 0.0 and DIST.mean_below(DIST.lo) == DIST.lo


def hand_bounds(dist, t, n_p, n_prfaas=2, n_local=6, gbps=100.0):
    """The model's formulas for the synthetic profiles, written out by hand."""
    l_long, l_short, p = dist.mean_above(t), dist.mean_below(t), dist.sf(t)
    theta_prfaas = min(n_prfaas / (l_long / 2000), gbps * 1e9 / 8 / (0.1 * l_long * MIB))
    theta_pd_p = n_p / (l_short / 1000)
    theta_pd_d = (n_local - n_p) * 10 / (0.01 * 100)
    return theta_prfaas, theta_pd_p, theta_pd_d, min(theta_prfaas / p, theta_pd_p / (1 - p), theta_pd_d)


@pytest.mark.parametrize("t, n_p, gbps", [(800, 1, 100), (1000, 2, 100), (1500, 3, 100), (2500, 5, 100),
                                           (1000, 2, 1.0), (3000, 4, 0.5)])
def test_thetas_and_min_match_hand_formulas(t, n_p, gbps):
    inputs = parse_plan_inputs(synthetic_raw(**{"deployments.prfaas_pd.cross_cluster_gbps": gbps}))
    model = PrfaasModel(inputs)
    bounds = model.bounds(t, n_p)
    expected = hand_bounds(model.distribution, t, n_p, gbps=gbps)
    got = (bounds.theta_prfaas, bounds.theta_pd_p, bounds.theta_pd_d, bounds.lambda_max)
    assert got == pytest.approx(expected, rel=1e-12)


def exhaustive_optimum(model):
    best = (0.0, 0.0, 0)
    for t in range(int(model.min_tokens), int(model.max_tokens) + 1):
        for n_p in range(1, model.num_local):
            value = model.lambda_max(float(t), n_p)
            if value > best[0]:
                best = (value, float(t), n_p)
    return best


@pytest.mark.parametrize("gbps, link_binds", [(100.0, False), (0.8, True)])
@pytest.mark.parametrize("max_grid_points", [search_module.MAX_GRID_POINTS, 20])
def test_search_finds_the_exhaustive_optimum(monkeypatch, gbps, link_binds, max_grid_points):
    monkeypatch.setattr(search_module, "MAX_GRID_POINTS", max_grid_points)
    inputs = parse_plan_inputs(synthetic_raw(**{"deployments.prfaas_pd.cross_cluster_gbps": gbps}))
    model = PrfaasModel(inputs)
    best_value, best_t, best_n_p = exhaustive_optimum(model)
    plan = search_prfaas(model)
    assert plan.lambda_max >= best_value * (1 - 1e-9)
    assert abs(plan.threshold_tokens - best_t) <= 100
    assert plan.num_prefill == best_n_p
    link_bound = gbps * 1e9 / 8 / plan.stats.long_kv_bytes
    assert (plan.bounds.theta_prfaas == pytest.approx(link_bound)) is link_binds


def test_linear_profiles_make_exact_mode_equal_mean_mode():
    inputs = parse_plan_inputs(synthetic_raw())
    mean, exact = PrfaasModel(inputs), PrfaasModel(inputs, exact=True)
    for t in (300.0, 1200.0, 4000.0):
        assert exact.lambda_max(t, 3) == pytest.approx(mean.lambda_max(t, 3), rel=1e-9)


def test_baselines_match_hand_formulas():
    inputs = parse_plan_inputs(synthetic_raw())
    mean_tokens = TruncatedLogNormal.from_spec(inputs.workload.input_length).mean
    homogeneous = homogeneous_plan(inputs)
    by_split = {n: min(n / (mean_tokens / 1000), (8 - n) * 10.0) for n in range(1, 8)}
    best_n = max(by_split, key=by_split.get)
    assert (homogeneous.num_prefill, homogeneous.num_decode) == (best_n, 8 - best_n)
    assert homogeneous.lambda_max == pytest.approx(by_split[best_n])
    naive = naive_plan(inputs)
    assert naive.lambda_max == pytest.approx(min(2 / (mean_tokens / 2000), 100e9 / 8 / (0.1 * mean_tokens * MIB), 60.0))
