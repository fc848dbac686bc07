"""bench/sim_vs_real.py in short (a light load of 20 s, or of 6 requests where the machine's knee is low,
run once, and two independent runs of 10 s past the knee, after two calibration loads of 6 s, the quick
profile from the shared point cache), so the benchmark cannot rot. The full comparison is
`python bench/sim_vs_real.py` (22-29 minutes with its profile).

Not its targets (20 s of load is too little for them), but what must hold at any length: the router
and the simulator route the very same requests, so their offloaded fractions are equal; below the
knee neither queue grows and both complete requests alike; past it both queues grow. (Whether a few
requests of a light load complete inside its window is an edge effect: on a slow machine 9 requests
in a minute completed at 74% of their arrival rate on both sides.)
"""
import json
import sys
from pathlib import Path

import pytest

from support.netns import available
from support.procs import run_to_end

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")
def test_sim_vs_real_runs_and_routes_like_the_router(tmp_path):
    run = run_to_end([sys.executable, str(ROOT / "bench" / "sim_vs_real.py"), "--seconds", "20",
                          "--min-requests", "6", "--max-runs", "1", "--loads",
                          "0.3,2.0", "--overload-runs", "2", "--max-overload-runs", "2",
                          "--calibration-seconds", "6", "--interference-pairs", "1", "--quick",
                          "--shared-profile-cache",
                          "--out", str(tmp_path)],
                         timeout=900)
    errors = [line for line in run.stderr.splitlines() if "Error" in line][-5:]  # ahead of the services' logs
    said = "\n".join([run.stdout[-3000:], *errors, run.stderr[-3000:]])
    assert run.returncode in (0, 1), said
    assert run.stdout.strip().splitlines()[-1].startswith("sim_vs_real: worst error"), said
    result = json.loads((tmp_path / "sim_vs_real.json").read_text())
    rows = result["rows"]
    assert len(rows) == 2 and (tmp_path / "sim_vs_real.png").exists()
    # The CPU outside the engines is fitted over the two calibration loads and the three measured runs.
    fitted = result["host_cpu_fit"]
    assert len(fitted["loads"]) == 5 and result["host_cpu_s_per_request"] == fitted["cpu_s"] >= 0, fitted
    assert "over every load the engines' cores spend" in run.stdout, said
    # The PrfaaS prefill worker's speed against the profile, from the calibration loads' offloaded requests.
    measured = result["prfaas_speed"]
    assert 0.5 <= measured["factor"] <= 2.0 and measured["profiled_s"] > 0, measured
    assert result["knee_req_s"] > 0 and result["profiled_knee_req_s"] > 0, result
    assert "the PrfaaS prefill worker runs at" in run.stdout, said
    # What slows the PrfaaS prefill beyond its profile, from one round of long prompts: alone, beside decoding
    # requests; and back to back, the check of the layer-wise transfer model (recorded, not charged).
    slowdown = result["interference"]
    assert slowdown["colocated"] >= 0 and slowdown["kv_mib"] > 0 and slowdown["exposed_s"] >= 0, slowdown
    assert len(slowdown["behind_samples"]) == len(slowdown["colocated_samples"]) == 1, slowdown
    alone, behind = slowdown["alone_s"][0], slowdown["behind_s"][0]
    assert 0 < alone < behind and slowdown["beside_s"][0] > 0, slowdown   # the second waits for the first
    assert "the colocated worker's decoding slows the prefill" in run.stdout, said
    assert "a prefill queued behind another loses" in run.stdout, said
    assert "layerwise=True" in result["runtime"], result["runtime"]
    # The sender's own threads, from prefill-0's telemetry over the calibration loads: some CPU for every
    # MiB sent, and well under what a MiB's prefill costs (a 1,536-token prompt's KV is tens of MiB).
    threads = result["sender_threads_cpu_ms_per_mib"]
    assert threads is not None and 0 < threads < 50, threads
    assert "prefill-0's KV sender threads used" in run.stdout, said
    for row in rows:
        real, sim = row["measured"], row["predicted"]
        assert sim["offloaded_fraction"] == pytest.approx(real["offloaded_fraction"], abs=1e-9), row
    light, overload = rows
    assert (light["segments"], light["throughput_interval"]) == (1, "block bootstrap"), light
    assert (overload["segments"], overload["throughput_interval"]) == (2, "t over runs"), overload
    assert light["predicted"]["throughput"] == pytest.approx(light["measured"]["throughput"], rel=0.25), light
    for side in ("measured", "predicted"):
        assert light[side]["queue_growth"] < 1.0, light
        assert overload[side]["queue_growth"] > 0, overload
