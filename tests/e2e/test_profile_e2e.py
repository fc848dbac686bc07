"""`prfaas profile --quick` on the embedded model (a real vLLM engine), its profile fed to plan and simulate."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = pytest.mark.e2e

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def prfaas(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    directory = tmp_path_factory.mktemp("profile")
    output, cache = directory / "profile.yaml", directory / "cache"
    started = time.monotonic()
    result = prfaas("profile", "--quick", "--output", str(output), "--cache-dir", str(cache))
    wall_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    return output, cache, yaml.safe_load(output.read_text()), result, wall_s


def test_quick_profile_measures_the_engine(profiled):
    from services.models import smollm2

    _, _, profile, result, wall_s = profiled
    print(f"prfaas profile --quick took {wall_s:.1f} s")
    assert "ETA" in result.stderr and "engine ready" in result.stderr
    prefill = profile["profiles"]["prefill"]
    assert prefill["lengths"] == sorted(prefill["lengths"]) and len(prefill["lengths"]) >= 2
    assert prefill["latency_s"][-1] > prefill["latency_s"][0] > 0
    for point in profile["prefill"]["points"]:  # hits come from vLLM's own prefix cache
        assert point["cached_tokens"] == int(point["input_tokens"] * point["hit_ratio"]) // 128 * 128
    checkpoint = json.loads((smollm2.prepare() / "config.json").read_text())
    head_dim = checkpoint["hidden_size"] // checkpoint["num_attention_heads"]
    per_token = (2 * checkpoint["num_key_value_heads"] * head_dim * DTYPE_BYTES[profile["engine"]["dtype"]]
                 * checkpoint["num_hidden_layers"])
    assert profile["kv_cache"]["bytes_per_token"] == per_token
    assert [g["kind"] for g in profile["kv_cache"]["groups"]] == ["full_attention"]
    decode = profile["decode"]
    assert decode["max_batch_size"] == profile["profiles"]["decode"]["max_batch_size"] >= 1
    measured = {p["batch_size"]: p["step_time_s"] for p in decode["points"]
                if p["context_tokens"] == decode["reference_context_tokens"] and "step_time_s" in p}
    if decode["meets_target"]:
        assert measured[decode["max_batch_size"]] <= decode["tpot_target_s"]
    assert profile["simulation"]["chunk_tokens"] == profile["engine"]["chunk_tokens"] > 0


def test_plan_and_simulate_use_the_measured_profile(profiled):
    output, _, profile, _, _ = profiled
    plan = prfaas("plan", "--profile", str(output), "--json")
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    prefill, decode = profile["profiles"]["prefill"], profile["profiles"]["decode"]
    table = out["phi_kv"]["h200_prefill"]
    assert [row["length_tokens"] for row in table] == prefill["lengths"]
    assert [row["latency_s"] for row in table] == pytest.approx(prefill["latency_s"])
    output_tokens = 1024  # the case study's workload
    assert out["prfaas_pd"]["theta_pd_d"] == pytest.approx(
        out["prfaas_pd"]["n_d"] * decode["max_batch_size"] / (decode["step_time_s"] * output_tokens))
    sim = prfaas("simulate", "--profile", str(output), "--requests", "500", "--policy", "static", "--json")
    assert sim.returncode == 0, sim.stderr
    simulated = json.loads(sim.stdout)
    assert simulated["planner"]["lambda_max"] == pytest.approx(out["prfaas_pd"]["lambda_max"])
    assert simulated["runtime"]["chunk_tokens"] == profile["engine"]["chunk_tokens"]
    assert simulated["policies"]["static"]["throughput"] > 0


def test_rerun_resumes_from_the_cache(profiled, tmp_path):
    output, cache, profile, _, _ = profiled
    again = tmp_path / "again.yaml"
    result = prfaas("profile", "--quick", "--output", str(again), "--cache-dir", str(cache), "--no-plot")
    assert result.returncode == 0, result.stderr[-3000:]
    rerun = yaml.safe_load(again.read_text())
    assert "engine ready" not in result.stderr  # every point cached: no engine started
    assert rerun["measured"]["points_measured"] == 0
    assert rerun["profiles"] == profile["profiles"]
