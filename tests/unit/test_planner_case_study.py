"""The planner on the paper's case study lands near Table 6 (targets read from the YAML)."""
import json
import subprocess
import sys

import pytest

from services.planner.inputs import load_plan_inputs
from services.planner.report import plan_to_dict, run_plan
from support.planner_inputs import CASE_STUDY


@pytest.fixture(scope="module")
def planned(case):
    inputs, plan = case
    return plan_to_dict(plan), inputs.paper_results


@pytest.mark.parametrize("section, key, tolerance", [
    ("prfaas_pd", "threshold_tokens", 0.05),
    ("prfaas_pd", "lambda_max", 0.05),
    ("prfaas_pd", "theta_prfaas", 0.05),
    ("prfaas_pd", "theta_pd_p", 0.05),
    ("prfaas_pd", "theta_pd_d", 0.05),
    ("prfaas_pd", "offloaded_fraction", 0.05),
    ("prfaas_pd", "egress_gbps", 0.20),
    ("homogeneous_pd", "lambda_max", 0.05),
    ("naive_heterogeneous", "lambda_max", 0.05),
])
def test_matches_table6_within_tolerance(planned, section, key, tolerance):
    out, paper = planned
    assert out[section][key] == pytest.approx(paper[section][key], rel=tolerance)


@pytest.mark.parametrize("section, keys", [("prfaas_pd", ("n_p", "n_d")), ("homogeneous_pd", ("n_p", "n_d"))])
def test_split_matches_table6(planned, section, keys):
    out, paper = planned
    assert tuple(out[section][k] for k in keys) == tuple(paper[section][k] for k in keys)


def test_throughput_ratios_match_the_paper(planned):
    out, paper = planned
    assert out["throughput_ratio_vs_homogeneous"] == pytest.approx(paper["throughput_ratio_vs_homogeneous"], rel=0.05)
    assert out["throughput_ratio_vs_naive"] == pytest.approx(paper["throughput_ratio_vs_naive"], rel=0.05)


def test_cli_json_has_the_documented_keys():
    result = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--config", str(CASE_STUDY), "--json"],
                            capture_output=True, text=True, check=True)
    out = json.loads(result.stdout)
    assert set(out["prfaas_pd"]) >= {"threshold_tokens", "n_p", "n_d", "lambda_max", "theta_prfaas", "theta_pd_p",
                                     "theta_pd_d", "offloaded_fraction", "egress_gbps", "mean_long_tokens",
                                     "mean_short_tokens"}
    assert set(out["homogeneous_pd"]) >= {"n_p", "n_d", "lambda_max"}
    assert "lambda_max" in out["naive_heterogeneous"]
    assert [row["length_tokens"] for row in out["phi_kv"]["h200_prefill"]] == [1024, 8192, 32768, 131072]


def test_exact_mode_prices_convex_latency_higher(planned):
    inputs = load_plan_inputs(CASE_STUDY)
    exact = plan_to_dict(run_plan(inputs, exact=True))
    out, _ = planned
    for section in ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous"):
        assert exact[section]["lambda_max"] < out[section]["lambda_max"]


def test_plot_writes_both_figures(tmp_path):
    pytest.importorskip("matplotlib")
    result = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--config", str(CASE_STUDY),
                             "--plot", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in ("lambda_vs_split.png", "bounds_vs_threshold.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
