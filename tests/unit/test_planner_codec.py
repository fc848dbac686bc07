"""The planner with a wire codec (`prfaas plan --codec`): the PrfaaS link carries the KV in fewer
bytes, which buys throughput only where the link, not the PrfaaS cluster's compute, binds."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from services.planner.cli import DEFAULT_CONFIG
from services.planner.codec import with_codec
from services.planner.inputs import PlanInputError, load_plan_inputs
from services.planner.report import plan_to_dict, run_plan


def _narrow(gbps: float):
    inputs = load_plan_inputs(DEFAULT_CONFIG)
    return dataclasses.replace(inputs, prfaas_pd=dataclasses.replace(inputs.prfaas_pd, cross_cluster_gbps=gbps))


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_a_codec_about_halves_the_kv_on_the_link_and_none_changes_nothing(codec):
    inputs = load_plan_inputs(DEFAULT_CONFIG)
    assert with_codec(inputs, "none") is inputs
    coded = with_codec(inputs, codec)
    raw_profile = inputs.prefill_profiles[inputs.prfaas_pd.prfaas_profile]
    coded_profile = coded.prefill_profiles[coded.prfaas_pd.prfaas_profile]
    # a byte per value and a 4-byte scale per row of 128 values
    assert coded_profile.kv_size_mib == pytest.approx(tuple(s * 132 / 256 for s in raw_profile.kv_size_mib))
    assert coded.prefill_profiles[inputs.prfaas_pd.prfaas_profile] == raw_profile  # the raw one stays for others
    assert coded.paper_results is None


@pytest.mark.parametrize("gbps, gains", [(100.0, False), (5.0, True)])
def test_a_codec_buys_throughput_only_on_a_link_bound_plan(gbps, gains):
    raw, coded = (plan_to_dict(run_plan(i))["prfaas_pd"] for i in (_narrow(gbps), with_codec(_narrow(gbps), "fp8")))
    assert coded["theta_prfaas_link"] > 1.5 * raw["theta_prfaas_link"]
    assert (coded["lambda_max"] > raw["lambda_max"] * 1.05) is gains
    assert coded["lambda_max"] >= raw["lambda_max"] * (1 - 1e-9)
    assert (coded["threshold_tokens"] < raw["threshold_tokens"]) is gains  # more prompts offloaded


def test_an_unknown_codec_is_refused_by_name():
    with pytest.raises(PlanInputError, match="codec: 'zstd' is not one of none, fp8"):
        with_codec(load_plan_inputs(DEFAULT_CONFIG), "zstd")


def test_plan_reports_the_codec_only_when_given():
    def plan(*extra):
        run = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--json", *extra], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    assert "codec" not in plan()
    assert plan("--codec", "fp8")["codec"] == {"name": "fp8", "wire_ratio": 132 / 256}
