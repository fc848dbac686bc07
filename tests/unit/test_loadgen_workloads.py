"""Workload generators and arrival processes of `prfaas bench serve` (embedded SmolLM2 tokenizer, no server)."""
import itertools
import json
import math

import numpy as np
import pytest

from services.loadgen.arrivals import gamma_arrivals, onoff_arrivals, replayed_arrivals, to_wall_time
from services.loadgen.config import ConfigError, WorkloadConfig
from services.loadgen.prompts import prompt_builder, tokenizer_source
from services.loadgen.workloads import load_trace, lognormal_length, make_workload


@pytest.fixture(scope="module")
def builder():
    return prompt_builder(tokenizer_source(None))


def take(config, builder, count, seed=0):
    return list(itertools.islice(make_workload(config, builder, np.random.default_rng(seed), count), count))


@pytest.mark.parametrize("length", [1, 2, 7, 64, 300, 1024, 4000])
def test_prompts_have_the_exact_token_length(builder, length):
    rng = np.random.default_rng(length)
    for _ in range(5):
        assert builder.count(builder.build(length, rng)) == length


def test_random_dataset_fixed_and_uniform_lengths(builder):
    fixed = take(WorkloadConfig(input_len=100, output_len=20), builder, 10)
    assert [s.input_len for s in fixed] == [100] * 10
    assert all(builder.count(s.prompt) == 100 and s.output_len == 20 for s in fixed)
    uniform = take(WorkloadConfig(input_len=100, output_len=20, range_ratio=0.5), builder, 40)
    assert all(50 <= s.input_len <= 150 and 10 <= s.output_len <= 30 for s in uniform)
    assert len({s.input_len for s in uniform}) > 10
    assert all(abs(builder.count(s.prompt) - s.input_len) <= 1 for s in uniform)


@pytest.mark.parametrize("dataset", ["random", "lognormal", "shared-prefix", "multi-turn"])
def test_a_seed_reproduces_the_workload(builder, dataset):
    config = WorkloadConfig(dataset=dataset, input_len=40, prefix_len=30, length_scale=0.01, range_ratio=0.2)
    first, again = take(config, builder, 6, seed=7), take(config, builder, 6, seed=7)
    other = take(config, builder, 6, seed=8)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]


def test_lognormal_is_the_truncated_paper_shape_scaled():
    config = WorkloadConfig(dataset="lognormal")
    rng = np.random.default_rng(0)
    full = np.array([lognormal_length(config, rng) for _ in range(20000)])
    assert full.min() >= 128 and full.max() <= 131072
    assert np.median(full) == pytest.approx(math.exp(9.90), rel=0.05)
    assert np.log(full).std() == pytest.approx(truncated_normal_std(math.log(131072) - 9.90), rel=0.03)
    scaled_config = WorkloadConfig(dataset="lognormal", length_scale=0.01)
    rng = np.random.default_rng(0)
    scaled = np.array([lognormal_length(scaled_config, rng) for _ in range(20000)])
    assert scaled.min() >= 1 and scaled.max() <= 1311
    assert np.median(scaled) == pytest.approx(np.median(full) * 0.01, rel=0.02)


def truncated_normal_std(upper: float) -> float:
    """Std of a standard normal cut at `upper` (the lower cut, 5 sigma below, is negligible)."""
    density = math.exp(-upper * upper / 2) / math.sqrt(2 * math.pi)
    mass = 0.5 * (1 + math.erf(upper / math.sqrt(2)))
    return math.sqrt(1 - upper * density / mass - (density / mass) ** 2)


def test_lognormal_prompts_match_their_sampled_lengths(builder):
    specs = take(WorkloadConfig(dataset="lognormal", length_scale=0.005), builder, 8)
    assert all(abs(builder.count(s.prompt) - s.input_len) <= 1 for s in specs)


def test_shared_prefix_requests_reuse_a_few_system_prompts(builder):
    config = WorkloadConfig(dataset="shared-prefix", num_prefixes=3, prefix_len=50, input_len=20)
    specs = take(config, builder, 30)
    assert len({s.system for s in specs}) == 3
    assert len({s.prompt for s in specs}) == 30
    for spec in specs:
        assert builder.count(spec.system) == 51  # 50 tokens and the newline separator
        assert abs(builder.count(spec.system + spec.prompt) - spec.input_len) <= 1
        assert spec.input_len == 71


def test_multi_turn_interleaves_conversations_turn_by_turn(builder):
    config = WorkloadConfig(dataset="multi-turn", num_turns=3, input_len=10)
    specs = take(config, builder, 12)
    assert [(s.conversation, s.turn) for s in specs[:5]] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
    assert [(s.conversation, s.turn) for s in specs[-1:]] == [(3, 2)]
    assert all(builder.count(s.prompt) == 10 for s in specs)


def test_trace_rows_keep_timestamps_and_lengths(builder, tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 10.5, "input_length": 30, "output_length": 4},
            {"timestamp": 10.0, "prompt": "Hello there, how are you?", "output_length": 3},
            {"timestamp": 12.0, "input_length": 200, "output_length": 5}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = take(WorkloadConfig(dataset="trace", trace_path=str(path), length_scale=0.5), builder, 10)
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 2.0]
    assert specs[0].prompt == "Hello there, how are you?"
    assert [s.input_len for s in specs[1:]] == [15, 100]
    assert [s.output_len for s in specs] == [3, 4, 5]


@pytest.mark.parametrize("content, message", [
    ('{"timestamp": 1, "output_length": 4}', "input_length"),
    ('{"timestamp": 1, "input_length": 4}', "output_length"),
    ("not json", "trace.jsonl:1"),
    ("", "no requests"),
])
def test_bad_traces_are_named(tmp_path, content, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_trace(path)


def test_gamma_arrivals_have_the_rate_and_burstiness():
    for burstiness in (1.0, 0.25):
        times = np.array(list(itertools.islice(gamma_arrivals(20.0, burstiness, np.random.default_rng(1)), 20001)))
        gaps = np.diff(times)
        assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert list(itertools.islice(gamma_arrivals(math.inf, 1.0, np.random.default_rng(0)), 5)) == [0.0] * 5


def test_onoff_arrivals_leave_the_off_periods_empty():
    times = list(itertools.islice(onoff_arrivals(50.0, 1.0, 2.0, 3.0, np.random.default_rng(0)), 2000))
    assert all((t % 5.0) < 2.0 for t in times)
    assert to_wall_time(4.5, 2.0, 3.0) == pytest.approx(10.5)


def test_replayed_arrivals_start_at_zero():
    assert list(replayed_arrivals([5.0, 5.5, 7.0])) == [0.0, 0.5, 2.0]
