"""Measured workloads: fits recover known parameters; plan and simulate take a workload file."""
import csv
import json
import math
import random
import subprocess
import sys

import pytest

from services.planner.inputs import PlanInputError
from services.planner.measured_workload import load_workload
from services.planner.workload_fit import FitError, arrival_stats, fit_lengths
from services.simulator.arrivals import make_arrivals
from services.simulator.measured import arrival_process_for, modulated_cv2


def lognormal_lengths(mu, sigma, lo, hi, n, seed=1):
    rng, lengths = random.Random(seed), []
    while len(lengths) < n:
        length = round(math.exp(rng.gauss(mu, sigma)))
        if lo <= length <= hi:
            lengths.append(length)
    return lengths


def arrival_times(kind, rate, n, burst_seconds=30.0, seed=3):
    arrivals, t, times = make_arrivals(kind, rate, random.Random(seed), burst_seconds), 0.0, []
    for _ in range(n):
        t = arrivals.next_after(t)
        times.append(t)
    return times


@pytest.mark.parametrize("mu, sigma, lo, hi, fitted_lo, fitted_hi", [
    (9.9, 1.0, 128, 131072, None, 131072),   # the paper's workload: ~3% of the mass cut off at the top
    (6.0, 0.8, 16, 2048, None, 2048),
    (7.0, 2.0, 100, 3000, 100, 3000),         # heavy truncation on both sides
])
def test_length_fit_recovers_truncated_lognormal(mu, sigma, lo, hi, fitted_lo, fitted_hi):
    lengths = lognormal_lengths(mu, sigma, lo, hi, 20_000)
    spec = fit_lengths(lengths)
    assert spec.mu == pytest.approx(mu, abs=0.05)
    assert spec.sigma == pytest.approx(sigma, rel=0.05)
    assert (spec.min_tokens, spec.max_tokens) == (min(lengths) - 0.5, max(lengths) + 0.5)
    for fitted, bound in ((spec.min_tokens, fitted_lo), (spec.max_tokens, fitted_hi)):
        if bound is not None:  # a bound that cuts off mass shows in the sample (here 128 lies 5.8 sigma out)
            assert fitted == pytest.approx(bound, rel=0.05)


def test_length_fit_of_one_repeated_length_stays_on_it():
    spec = fit_lengths([500] * 10)
    assert (spec.min_tokens, spec.max_tokens) == (499.5, 500.5)


def test_length_fit_needs_two_lengths():
    with pytest.raises(FitError, match="at least 2"):
        fit_lengths([10])


@pytest.mark.parametrize("kind, rate, burst", [("poisson", 3.0, 30.0), ("onoff", 2.0, 5.0), ("mmpp", 1.0, 3.0)])
def test_arrival_rate_and_cv_match_the_generating_process(kind, rate, burst):
    stats = arrival_stats(arrival_times(kind, rate, 100_000, burst))
    expected_cv2 = 1.0 if kind == "poisson" else modulated_cv2(kind, rate, burst)
    assert stats.rate == pytest.approx(rate, rel=0.05)
    assert stats.interarrival_cv ** 2 == pytest.approx(expected_cv2, rel=0.05)


def test_onoff_cv_is_the_interrupted_poisson_formula():
    assert modulated_cv2("onoff", 2.0, 5.0) == pytest.approx(1 + 2.0 * 5.0)


@pytest.mark.parametrize("kind, rate, burst", [("poisson", 3.0, None), ("onoff", 2.0, 5.0), ("mmpp", 1.0, 3.0),
                                               ("onoff", 0.2, 100.0)])
def test_arrival_process_fit_recovers_kind_and_state_length(kind, rate, burst):
    times = arrival_times(kind, rate, 100_000, burst or 30.0)
    stats = arrival_stats(times)
    fit = arrival_process_for(stats.rate, stats.interarrival_cv, len(times) - 1)
    assert fit.kind == kind
    if burst is not None:
        assert fit.burst_seconds == pytest.approx(burst, rel=0.15)
        assert fit.model_cv == pytest.approx(stats.interarrival_cv, rel=1e-6)


def test_few_poisson_arrivals_are_not_called_bursty():
    for seed in range(20):
        times = arrival_times("poisson", 1.0, 100, seed=seed)
        stats = arrival_stats(times)
        assert arrival_process_for(stats.rate, stats.interarrival_cv, 99).kind == "poisson"


def write_trace(path, fmt, n=2000, seed=2):
    rng = random.Random(seed)
    times = arrival_times("onoff", 2.0, n, 5.0, seed)
    lengths = lognormal_lengths(7.0, 0.7, 32, 8000, n, seed)
    rows = [{"t": t, "input": length, "output": rng.randint(50, 150)} for t, length in zip(times, lengths)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"timestamp": r["t"] * 1000, "input_length": r["input"],
                                            "output_length": r["output"]}) + "\n" for r in rows))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["arrival_s", "prompt_tokens"])
            writer.writerows([r["t"], r["input"]] for r in rows)
    else:  # a `prfaas bench` result
        path.write_text(json.dumps({"input_lens": [r["input"] for r in rows],
                                    "output_lens": [r["output"] for r in rows],
                                    "start_times": [r["t"] - times[0] for r in rows],
                                    "statuses": [200] * n, "completed": n}))
    return rows


@pytest.mark.parametrize("fmt, suffix, kind", [("jsonl", ".jsonl", "trace"), ("csv", ".csv", "trace"),
                                               ("loadgen", ".json", "load-generator result")])
def test_workload_files_are_fitted(tmp_path, fmt, suffix, kind):
    path = tmp_path / f"workload{suffix}"
    rows = write_trace(path, fmt)
    workload = load_workload(path)
    assert workload.kind == kind
    assert workload.arrivals.num_requests == len(rows)
    assert workload.arrivals.rate == pytest.approx(2.0, rel=0.15)
    assert workload.arrivals.interarrival_cv > 2.0
    assert workload.input_length.mu == pytest.approx(7.0, abs=0.1)
    if fmt == "csv":
        assert workload.output_tokens is None
    else:
        assert workload.output_tokens == round(sum(r["output"] for r in rows) / len(rows))


@pytest.mark.parametrize("text, message", [
    ('{"timestamp": 1, "input_length": 5}\n{"input_length": 7}\n', r"trace.jsonl:2: no arrival time"),
    ('{"timestamp": 1, "input_length": 5}\nnot json\n', r"trace.jsonl:2: not a JSON object"),
    ('{"timestamp": 1, "input_length": 0.5}\n', r"trace.jsonl:1: input_length: expected a whole number"),
    ('{"timestamp": 1, "input_length": 5}\n{"timestamp": 1, "input_length": 6}\n', r"need at least 3 arrival"),
])
def test_bad_workload_files_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(PlanInputError, match=message):
        load_workload(path)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True)


def test_plan_reports_the_measured_workload(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, "jsonl")
    fitted = load_workload(path)
    out = json.loads(run_cli("plan", "--workload", str(path), "--json").stdout)
    measured = out["measured_workload"]
    assert measured["input_length"]["mu"] == pytest.approx(fitted.input_length.mu)
    assert measured["output_tokens"] == fitted.output_tokens
    assert measured["load_factor"] == pytest.approx(fitted.arrivals.rate / out["prfaas_pd"]["lambda_max"])
    text = run_cli("plan", "--workload", str(path)).stdout
    assert text.startswith(f"workload: measured from {path}")
    assert f"mu = {fitted.input_length.mu:.3f}" in text


def test_simulate_runs_the_measured_workload(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, "jsonl")
    fitted = load_workload(path)
    out = json.loads(run_cli("simulate", "--workload", str(path), "--requests", "300", "--policy", "static",
                             "--json").stdout)
    assert out["offered_rate"] == pytest.approx(fitted.arrivals.rate)
    assert out["arrivals"] == out["measured_workload"]["fitted_arrivals"]["kind"] == "onoff"
    assert out["measured_workload"]["fitted_arrivals"]["used"] is True
    explicit = json.loads(run_cli("simulate", "--workload", str(path), "--requests", "300", "--policy", "static",
                                  "--arrivals", "poisson", "--load-factor", "0.5", "--json").stdout)
    assert explicit["arrivals"] == "poisson" and explicit["load_factor"] == pytest.approx(0.5)
    assert explicit["measured_workload"]["fitted_arrivals"]["used"] is False


def test_unreadable_workload_exits_2(tmp_path):
    result = run_cli("plan", "--workload", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2
    assert "missing.jsonl: cannot read" in result.stderr


def test_a_sample_spread_like_a_uniform_fits_a_usable_distribution():
    """Five lengths spread over a decade: the maximum-likelihood sigma runs off to infinity; the capped
    fit keeps the sample's moments and every expectation the planner takes stays finite."""
    from services.planner.distribution import TruncatedLogNormal

    spec = fit_lengths([30_000, 4_000, 60_000, 12_000, 90_000])
    dist = TruncatedLogNormal.from_spec(spec)
    assert spec.sigma <= 2 * (math.log(spec.max_tokens) - math.log(spec.min_tokens)) + 1e-9
    assert 4_000 < dist.mean_above(20_000) <= 90_000.5 and 4_000 <= dist.mean_below(20_000) < 20_000
    assert math.isfinite(dist.mean)
