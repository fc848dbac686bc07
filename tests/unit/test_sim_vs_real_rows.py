"""bench/sim_vs_real.py's pieces that need no deployment: the host-CPU calibration's choice, the
intervals of the prediction's error, a load's runs pooled into one row."""
import random

import pytest
from support.bench import bench_module

host_cpu, intervals, rows = bench_module("_host_cpu"), bench_module("_intervals"), bench_module("_sim_rows")
Reading, Load, fit = host_cpu.Reading, host_cpu.Load, host_cpu.fit
paired_error_interval, proportion_interval = intervals.paired_error_interval, intervals.proportion_interval
Interval, replication_interval = intervals.Interval, intervals.replication_interval
PerRequest, Segment, pooled_row, too_wide = rows.PerRequest, rows.Segment, rows.pooled_row, rows.too_wide


def two(low: Reading, high: Reading, sent: tuple[int, int]) -> list:
    return [Load(low, 66.0, sent[0]), Load(high, 66.0, sent[1])]


@pytest.mark.parametrize("loads, expected_ms, says", [
    (two(Reading(2.0, 1.0), Reading(4.0, 2.0), (20, 60)), 50.0, "the cores' fit"),
    (two(Reading(5.0, 1.0), Reading(4.0, 2.5), (20, 60)), 37.5, "fell below"),        # was silently 0
    (two(Reading(0.5, 1.0), Reading(4.0, 2.5), (20, 60)), 50.0, "exceeds"),      # the lighter load's 1.0 / 20
    (two(Reading(1.0, 1.0), Reading(1.5, 1.2), (30, 30)), 40.0, "too few to tell apart"),
    # both fits below 0 (measured once: cores' -5.5 ms, own processes' below 0): the larger load's own 2.5 / 60
    (two(Reading(5.0, 3.0), Reading(4.5, 2.5), (20, 60)), 41.7, "both fits came out at or below 0"),
])
def test_host_cpu_is_never_silently_zero(loads, expected_ms, says):
    choice = fit(loads)
    assert choice.cpu_s * 1e3 == pytest.approx(expected_ms, abs=0.1)
    assert says in choice.reason and says in choice.describe()


def test_every_load_pins_down_what_two_light_ones_cannot():
    """10 s of idle CPU per load that varies by a second, 30 ms per request: two light loads 33 requests
    apart read nothing (as measured once), the fit over them and three measured loads reads 30 ms."""
    rng = random.Random(5)

    def load(seconds: float, requests: int, idle_noise_s: float) -> Load:
        cores = 1.5 + 0.13 * seconds + 0.030 * requests + idle_noise_s
        own = 1.2 + 0.12 * seconds + 0.026 * requests + 0.9 * idle_noise_s + rng.gauss(0, 0.1)
        return Load(Reading(cores, own), seconds, requests)

    calibration = [load(66.0, 14, +0.5), load(66.0, 47, -0.5)]
    assert fit(calibration).cores_s < 0.005
    measured = [load(seconds, n, rng.gauss(0, 0.5)) for seconds, n in ((124, 70), (125, 137), (160, 334),
                                                                        (123, 72), (124, 140))]
    choice = fit(calibration + measured)
    assert choice.cpu_s == pytest.approx(0.030, abs=0.008) and choice.reason == "the cores' fit"
    assert 0 < choice.stderr_s < 0.008 and len(choice.loads) == 7
    assert choice.ceiling_s == pytest.approx(min(lo.used.cores_s / lo.requests for lo in calibration + measured))


def test_the_paired_interval_holds_the_error_and_narrows_with_requests():
    rng = random.Random(3)
    real = [rng.expovariate(1.0) for _ in range(2000)]
    predicted = [t * 1.2 + rng.gauss(0, 0.3) for t in real]
    few, many = paired_error_interval(real[:100], predicted[:100]), paired_error_interval(real, predicted)
    assert few.low < 0.2 < few.high and many.low < 0.2 < many.high
    assert many.half_width < few.half_width / 2
    share = proportion_interval(0.3, 200)
    assert share.low < 0.3 < share.high and proportion_interval(0.3, 2000).half_width < share.half_width


def segment(ttfts_real, ttfts_sim, done_real, done_sim) -> Segment:
    n = len(ttfts_real)
    measured = {"requests": n, "offloaded_fraction": 0.5, "queue_growth": 0.0}
    per = [PerRequest(list(t), list(d), 10.0, 9.0) for t, d in ((ttfts_real, done_real), (ttfts_sim, done_sim))]
    return Segment(measured, {"offloaded_fraction": 0.5, "queue_growth": 0.0}, *per)


def test_a_load_pools_its_runs_request_by_request():
    first = segment([1.0] * 20, [1.1] * 20, [1] * 18 + [0, 0], [1] * 18 + [0, 0])
    second = segment([3.0] * 20, [3.3] * 20, [1] * 20, [1] * 20)
    row = pooled_row(0.7, 2.0, [first, second])
    assert row["segments"] == 2 and row["measured"]["requests"] == 40
    assert row["measured"]["ttft_mean"] == pytest.approx(2.0) and row["predicted"]["ttft_mean"] == pytest.approx(2.2)
    assert row["intervals"]["ttft_mean"]["estimate"] == pytest.approx(0.1)
    assert row["measured"]["throughput"] == pytest.approx(38 / 18) == row["predicted"]["throughput"]
    assert too_wide(row, ["throughput", "offloaded_fraction", "ttft_mean"]) == []


def test_past_the_knee_the_throughput_interval_is_over_independent_runs():
    """Past the knee the requests done inside the window are the earliest to arrive: the request-by-
    request bootstrap resamples a step, and pooling runs did not narrow it (measured: +-9% for one run,
    +-8% for four). The overload point's runs are independent replications, and its interval is over
    their errors: it narrows with runs and holds the true error."""
    rng = random.Random(11)

    def run(bias: float) -> Segment:
        real_done = 60 + rng.randint(-6, 6)
        sim_done = round(real_done * (1 + bias + rng.gauss(0, 0.03)))
        done = [[1] * k + [0] * (100 - k) for k in (real_done, sim_done)]
        return segment([1.0] * 100, [1.0] * 100, *done)

    runs = [run(0.02) for _ in range(8)]
    assert pooled_row(1.5, 3.0, runs)["throughput_interval"] == "block bootstrap"
    few, many = (pooled_row(1.5, 3.0, runs[:k], replications=True) for k in (3, 8))
    assert few["throughput_interval"] == many["throughput_interval"] == "t over runs"
    narrow, wide = (Interval(**row["intervals"]["throughput"]) for row in (many, few))
    assert narrow.half_width < wide.half_width and narrow.low < 0.02 < narrow.high
    assert too_wide(many, ["throughput"]) == []
    # one run is no replication: the request-by-request interval, not a t over one error
    assert pooled_row(1.5, 3.0, runs[:1], replications=True)["throughput_interval"] == "block bootstrap"


def test_the_replication_interval_holds_its_level():
    """Over many draws of six runs whose errors scatter by 3% around +2%, the 95% interval holds +2%
    about 95% of the time."""
    rng = random.Random(2)
    held = 0
    for _ in range(400):
        measured = [rng.uniform(50, 70) for _ in range(6)]
        predicted = [m * (1.02 + rng.gauss(0, 0.03)) for m in measured]
        interval = replication_interval(measured, predicted)
        held += interval.low < 0.02 < interval.high
    assert 0.90 <= held / 400 <= 0.99
    with pytest.raises(ValueError, match="at least two"):
        replication_interval([60.0], [61.0])


def test_the_overload_point_runs_on_while_its_interval_is_wide():
    """Six runs at least; more while the throughput's interval is wider than half its tolerance; a cap.
    Runs that scatter by 6% (as measured on a 2-core host) need about nine for +-5%, runs that scatter by
    2% stop at six, runs that scatter by 20% stop at the cap."""
    enough_runs = rows.enough_runs
    assert not enough_runs(5, [], 6, 10) and enough_runs(6, [], 6, 10)
    assert not enough_runs(6, ["throughput"], 6, 10) and enough_runs(10, ["throughput"], 6, 10)
    assert enough_runs(1, [], 1, 2) and not enough_runs(1, ["ttft_mean"], 1, 2)

    def runs_needed(scatter: float, seed: int) -> int:
        rng, runs = random.Random(seed), []
        while True:
            real_done = 60
            sim_done = round(real_done * (1 + rng.gauss(0, scatter)))
            runs.append(segment([1.0] * 100, [1.0] * 100, [1] * real_done + [0] * (100 - real_done),
                                [1] * sim_done + [0] * (100 - sim_done)))
            row = pooled_row(1.5, 3.0, runs, replications=True)
            if enough_runs(len(runs), too_wide(row, ["throughput"]), 6, 10):
                return len(runs)

    assert [runs_needed(0.02, seed) for seed in range(5)] == [6] * 5
    assert [runs_needed(0.20, seed) for seed in range(5)] == [10] * 5
    middling = [runs_needed(0.06, seed) for seed in range(20)]
    assert min(middling) >= 6 and max(middling) <= 10 and sum(n > 6 for n in middling) >= 5, middling


def test_the_overload_run_count_is_checked():
    sim_vs_real = bench_module("sim_vs_real")
    assert sim_vs_real.parse_args([]).max_overload_runs == sim_vs_real.MAX_OVERLOAD_RUNS
    assert sim_vs_real.parse_args(["--overload-runs", "12"]).max_overload_runs == 12
    assert sim_vs_real.parse_args(["--overload-runs", "2", "--max-overload-runs", "2"]).max_overload_runs == 2
    with pytest.raises(SystemExit):
        sim_vs_real.parse_args(["--overload-runs", "6", "--max-overload-runs", "4"])
