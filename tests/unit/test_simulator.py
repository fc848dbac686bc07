"""The simulator against the planner (stability around Lambda_max), hand-timed small cases, and
the adaptive threshold under a bandwidth drop."""
import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from services.planner.inputs import parse_plan_inputs
from services.planner.profiles import PiecewiseLinear
from services.simulator.arrivals import make_arrivals
from services.simulator.bandwidth import TraceError, parse_trace
from services.simulator.capacity import mean_length_overstatement
from services.simulator.engine import simulate
from services.simulator.setup import RunSpec, make_controller, topology_for, workload_of
from support.planner_inputs import CASE_STUDY


def spec_for(case, policy, load_factor, num_requests, **kwargs):
    inputs, plan = case
    return RunSpec(policy, topology_for(policy, inputs, plan), workload_of(inputs),
                   load_factor * plan.prfaas.lambda_max, num_requests, plan.prfaas.threshold_tokens, **kwargs)


def run(case, policy, load_factor, num_requests, **kwargs):
    inputs, plan = case
    controller = make_controller(inputs, plan) if policy == "adaptive" else None
    return simulate(spec_for(case, policy, load_factor, num_requests, **kwargs), controller)


def late_vs_early_queue(result):
    """Mean total queue over the last quarter of the arrival window minus the second quarter."""
    totals = [(s[0], sum(s[1:])) for s in result.samples]
    end = result.arrival_window_s
    window = lambda a, b: [q for t, q in totals if a * end <= t < b * end]  # noqa: E731
    early, late = window(0.25, 0.5), window(0.75, 1.0)
    return sum(late) / len(late) - sum(early) / len(early)


@pytest.mark.parametrize("seed", [0, 1])
def test_mean_length_mode_is_stable_at_95_percent_of_lambda_max(case, seed):
    result = run(case, "static", 0.95, 20_000, mean_length_mode=True, seed=seed)
    summary = result.summary()
    assert summary["throughput"] == pytest.approx(summary["realized_rate"], rel=0.05)
    assert summary["backlog_at_last_arrival"] < 200
    assert late_vs_early_queue(result) < 50


@pytest.mark.parametrize("seed", [0, 1])
def test_mean_length_mode_is_unstable_at_110_percent_of_lambda_max(case, seed):
    result = run(case, "static", 1.10, 20_000, mean_length_mode=True, seed=seed)
    summary = result.summary()
    assert summary["throughput"] < 0.95 * summary["realized_rate"]
    assert summary["backlog_at_last_arrival"] > 1000
    assert late_vs_early_queue(result) > 500


def test_mean_length_mode_capacity_matches_the_planner(case):
    _, plan = case
    result = run(case, "static", 1.0, 20_000, mean_length_mode=True)
    assert result.capacity() == pytest.approx(plan.prfaas.lambda_max, rel=0.02)


def test_sampled_lengths_show_the_mean_length_model_overstates_capacity(case):
    inputs, plan = case
    rows = mean_length_overstatement(inputs, plan, num_requests=20_000)
    for name in ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous"):
        row = rows[name]
        assert row["overstatement"] > 0.01, name
        assert row["overstatement"] == pytest.approx(row["overstatement_exact_model"], abs=0.015), name
        assert row["simulated_capacity_mean_length"] == pytest.approx(row["planner_lambda_max"], rel=0.02), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_keeps_p90_ttft_below_static_when_the_link_drops(case, seed):
    _, plan = case
    load_factor, num_requests = 0.85, 40_000
    duration = num_requests / (load_factor * plan.prfaas.lambda_max)
    trace = parse_trace("0:100,33.33%:10,66.67%:100", duration)
    static = run(case, "static", load_factor, num_requests, seed=seed, bandwidth_trace=trace).summary()
    adaptive = run(case, "adaptive", load_factor, num_requests, seed=seed, bandwidth_trace=trace).summary()
    assert adaptive["ttft_s"]["p90"] < static["ttft_s"]["p90"]
    assert adaptive["threshold_range_tokens"][1] > plan.prfaas.threshold_tokens
    assert adaptive["offloaded_fraction"] < static["offloaded_fraction"]


@pytest.mark.parametrize("arrivals", ["onoff", "mmpp"])
def test_adaptive_is_no_worse_than_static_under_bursts(case, arrivals):
    # Bursts overload both prefill clusters at once: the controller must not move the backlog onto
    # local prefill (its queue signal counts only while the PrfaaS queue is the deeper one).
    static = run(case, "static", 0.85, 20_000, arrivals=arrivals).summary()
    adaptive = run(case, "adaptive", 0.85, 20_000, arrivals=arrivals).summary()
    assert adaptive["ttft_s"]["p90"] <= 1.05 * static["ttft_s"]["p90"]
    assert adaptive["throughput"] >= 0.99 * static["throughput"]


def test_adaptive_matches_static_when_the_link_has_room(case):
    static = run(case, "static", 0.8, 5_000).summary()
    adaptive = run(case, "adaptive", 0.8, 5_000).summary()
    assert adaptive["ttft_s"] == static["ttft_s"]
    assert adaptive["threshold_range_tokens"] == [static["threshold_tokens"]] * 2


def naive_single_request(case, trace=()):
    spec = replace(spec_for(case, "naive", 1.0, 1, mean_length_mode=True, bandwidth_trace=trace), rate=1e9)
    result = simulate(spec)
    topo, mean = spec.topology, spec.workload.lengths.mean
    return result, topo.prfaas_latency(mean), topo.prfaas_kv_bytes(mean)


def test_single_request_ttft_is_prefill_plus_transfer(case):
    result, prefill_s, kv_bytes = naive_single_request(case)
    assert result.ttfts[0] == pytest.approx(prefill_s + kv_bytes / (100e9 / 8), rel=1e-6)
    assert result.summary()["slo_attainment"] == 1.0


def test_bandwidth_step_retimes_the_transfer_in_flight(case):
    _, prefill_s, kv_bytes = naive_single_request(case)
    half_at_100 = kv_bytes / 2 / (100e9 / 8)
    result, _, _ = naive_single_request(case, trace=((0.0, 100.0), (prefill_s + half_at_100, 1.0)))
    assert result.ttfts[0] == pytest.approx(prefill_s + half_at_100 + kv_bytes / 2 / (1e9 / 8), rel=1e-6)


def test_decode_slots_cap_throughput(case):
    spec = spec_for(case, "homogeneous", 1.0, 3_000, mean_length_mode=True)
    quick = PiecewiseLinear((1.0, 2.0), (0.01, 0.01))
    topology = replace(spec.topology, num_local_prefill=50, local_latency=quick, num_decode=1, max_batch_size=4)
    result = simulate(replace(spec, topology=topology, rate=1.0))
    decode_s = spec.workload.output_tokens * topology.decode_step_s
    assert result.throughput == pytest.approx(4 / decode_s, rel=0.03)
    assert result.summary()["queues"]["decode"]["max"] > 2000
    assert max(result.ttfts) > 10_000


@pytest.mark.parametrize("kind", ["poisson", "onoff", "mmpp"])
def test_arrival_processes_keep_the_mean_rate(kind):
    arrivals = make_arrivals(kind, 2.0, random.Random(7), burst_seconds=5.0)
    t = 0.0
    for _ in range(100_000):
        t = arrivals.next_after(t)
    assert 100_000 / t == pytest.approx(2.0, rel=0.03)


def test_same_seed_same_run_other_seed_other_run(case):
    a, b = (run(case, "static", 0.9, 2_000, seed=3).summary() for _ in range(2))
    c = run(case, "static", 0.9, 2_000, seed=4).summary()
    assert a["ttft_s"] == b["ttft_s"] and a["ttft_s"] != c["ttft_s"]


def test_trace_parsing(tmp_path):
    assert parse_trace("0:100,300:10,600:100") == ((0.0, 100.0), (300.0, 10.0), (600.0, 100.0))
    assert parse_trace("0:100, 50%:10", duration_s=1000) == ((0.0, 100.0), (500.0, 10.0))
    trace_file = tmp_path / "trace.txt"
    trace_file.write_text("# time gbps\n0 100\n120 25\n")
    assert parse_trace(str(trace_file)) == ((0.0, 100.0), (120.0, 25.0))
    for bad in ("0:100,0:10", "abc", "0:x", "5:-1"):
        with pytest.raises(TraceError):
            parse_trace(bad)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--config", str(CASE_STUDY), *args],
                          capture_output=True, text=True)


def test_simulate_cli_json():
    result = run_cli("--policy", "static", "--requests", "3000", "--load-factor", "0.8", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    static = out["policies"]["static"]
    assert set(static) >= {"throughput", "ttft_s", "slo_attainment", "decode_tokens_per_s", "egress_gbps", "queues"}
    assert set(static["ttft_s"]) == {"mean", "p50", "p90", "p99"}
    assert out["load_factor"] == pytest.approx(0.8)


@pytest.mark.parametrize("args, message", [
    (("--requests", "0"), "--requests: must be at least 1"),
    (("--rate", "-1"), "--rate: must be positive"),
    (("--bandwidth-trace", "0:fast"), "bandwidth trace: expected numbers"),
    (("--reoptimize-interval", "0"), "--reoptimize-interval: must be positive"),
])
def test_simulate_cli_rejects_bad_arguments(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"prfaas simulate: error: {message}")


def test_simulate_cli_plots_queue_lengths(tmp_path):
    pytest.importorskip("matplotlib")
    result = run_cli("--policy", "static", "--requests", "2000", "--plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "queues.png").read_bytes().startswith(b"\x89PNG")


def test_prefix_hits_shorten_the_uncached_prompt_used_for_routing(case):
    inputs, plan = case
    raw = yaml.safe_load(CASE_STUDY.read_text())
    raw["workload"]["prefix_hit"] = {"probability": 1.0, "min_fraction": 0.5, "max_fraction": 0.5}
    with_hits = parse_plan_inputs(raw)
    spec = replace(spec_for(case, "static", 0.5, 20_000), workload=workload_of(with_hits))
    t = plan.prfaas.threshold_tokens
    offloaded = simulate(spec).summary()["offloaded_fraction"]
    assert offloaded == pytest.approx(spec.workload.lengths.sf(2 * t), abs=0.01)
    assert offloaded < spec.workload.lengths.sf(t) - 0.1
