"""Bad planner inputs: `prfaas plan` exits 2 with one line naming the key."""
import subprocess
import sys

import pytest
from support.planner_inputs import synthetic_raw, write_yaml

from services.planner.inputs import PlanInputError, parse_plan_inputs

BAD_INPUTS = [
    ({"profiles.fast.lengths": [1000, 1000]}, "profiles.fast.lengths: must be strictly increasing"),
    ({"profiles.fast.lengths": [2000, 1000]}, "profiles.fast.lengths: must be strictly increasing"),
    ({"profiles.slow.latency_s": [2.0, 1.0]}, "profiles.slow.latency_s: must be non-decreasing"),
    ({"profiles.fast.kv_size_mib": [200.0, 100.0]}, "profiles.fast.kv_size_mib: must be non-decreasing"),
    ({"profiles.fast.latency_s": [0.5]}, "profiles.fast.latency_s: must have 2 entries like lengths, got 1"),
    ({"workload.input_length.mu": None}, "workload.input_length.mu: required key is missing"),
    ({"workload.output_tokens": None}, "workload.output_tokens: required key is missing"),
    ({"deployments.prfaas_pd": None}, "deployments.prfaas_pd: required key is missing"),
    ({"deployments.prfaas_pd.prfaas_instances.count": 0},
     "deployments.prfaas_pd.prfaas_instances.count: must be positive, got 0"),
    ({"deployments.naive_heterogeneous.decode_instances.count": -3},
     "deployments.naive_heterogeneous.decode_instances.count: must be positive, got -3"),
    ({"deployments.prfaas_pd.local_pd_instances.count": 1},
     "deployments.prfaas_pd.local_pd_instances.count: must be at least 2, got 1"),
    ({"deployments.prfaas_pd.cross_cluster_gbps": 0}, "deployments.prfaas_pd.cross_cluster_gbps: must be positive"),
    ({"workload.input_length.distribution": "normal"},
     "workload.input_length.distribution: 'normal' is not supported (allowed: truncated_lognormal)"),
    ({"interpolation": "cubic"}, "interpolation: 'cubic' is not supported (allowed: piecewise_linear)"),
    ({"workload.input_length.sigma": -1.0}, "workload.input_length.sigma: must be positive"),
    ({"workload.input_length.max_tokens": 50}, "workload.input_length.max_tokens: must be greater than min_tokens"),
    ({"deployments.prfaas_pd.prfaas_instances.profile": "nope"},
     "deployments.prfaas_pd.prfaas_instances.profile: unknown prefill profile 'nope'"),
    ({"deployments.prfaas_pd.prfaas_instances.profile": "slow"},
     "deployments.prfaas_pd.prfaas_instances.profile: profile 'slow' has no kv_size_mib"),
    ({"workload.output_tokens": "many"}, "workload.output_tokens: expected an integer, got 'many'"),
    ({"workload.extra": 1}, "workload.extra: unknown key"),
]


@pytest.mark.parametrize("changes, message", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_key(changes, message):
    with pytest.raises(PlanInputError) as info:
        parse_plan_inputs(synthetic_raw(**changes))
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def run_plan_cli(path):
    return subprocess.run([sys.executable, "-m", "services.cli", "plan", "--config", path],
                          capture_output=True, text=True)


@pytest.mark.parametrize("changes, message", [BAD_INPUTS[i] for i in (0, 2, 5, 8, 12, 13)])
def test_cli_exits_2_with_one_line(tmp_path, changes, message):
    result = run_plan_cli(write_yaml(tmp_path / "bad.yaml", synthetic_raw(**changes)))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"prfaas plan: error: {message}")


@pytest.mark.parametrize("text, message", [
    ("workload: [1, 2\n", "invalid YAML"),
    ("- 1\n- 2\n", "config: expected a mapping, got list"),
    ("", "config: expected a mapping, got nothing"),
])
def test_cli_rejects_unusable_files(tmp_path, text, message):
    result = run_plan_cli(write_yaml(tmp_path / "bad.yaml", text))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


def test_cli_rejects_missing_file(tmp_path):
    result = run_plan_cli(str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr


def test_synthetic_input_is_valid(tmp_path):
    result = run_plan_cli(write_yaml(tmp_path / "ok.yaml", synthetic_raw()))
    assert result.returncode == 0, result.stderr
    assert "threshold t =" in result.stdout


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from services.cli import main; "
            f"sys.exit(main(['plan', '--plot', {str(tmp_path)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "prfaas plan: error: matplotlib is required for --plot (pip install matplotlib)"
