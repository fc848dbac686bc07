"""`prfaas bench serve` against the real embedded deployment (router, prefill worker, decode worker, vLLM)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.deployment import Deployment, deployment_config

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
NUM_PROMPTS = 8
OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    config = deployment_config([{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas"},
                                {"name": "decode-0", "service": "decode_worker", "role": "both"}])
    deployment = Deployment(config, tmp_path_factory.mktemp("bench")).start()
    yield deployment
    deployment.stop()


def bench(deployment, tmp_path, *args) -> dict:
    path = tmp_path / "result.json"
    command = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", deployment.base_url,
               "--model", MODEL, "--num-prompts", str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN),
               "--ignore-eos", "--temperature", "0", "--max-concurrency", "4", "--no-progress", "--fail-on-error",
               "--result-file", str(path), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{deployment.logs()}"
    assert "Serving Benchmark Result" in run.stdout
    print(run.stdout)
    return json.loads(path.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_measures_what_the_server_reports(deployment, tmp_path, endpoint):
    result = bench(deployment, tmp_path, "--endpoint", endpoint, "--input-len", "64", "--warmup", "1")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0 and result["rejected"] == 0
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["streamed_chunks"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["usage_mismatches"] == 0 and result["usage_missing"] == 0
    if endpoint == "completions":
        assert result["usage_prompt_tokens"] == [64] * NUM_PROMPTS
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    router = result["router_metrics"]
    assert sum(router["routed_requests"].values()) == NUM_PROMPTS
    assert router["requests_by_status"] == {f"/v1/{'chat/' if endpoint == 'chat' else ''}completions 200":
                                            NUM_PROMPTS}
    assert router["generation_tokens"] == NUM_PROMPTS * OUTPUT_LEN


def test_long_prompts_are_routed_and_accounted(deployment, tmp_path):
    """Prompts over the offload threshold; whether they go to the PrfaaS cluster is the router's business."""
    result = bench(deployment, tmp_path, "--input-len", "1500", "--request-rate", "4")
    assert result["completed"] == NUM_PROMPTS and result["usage_mismatches"] == 0
    assert result["usage_prompt_tokens"] == [1500] * NUM_PROMPTS
    router = result["router_metrics"]
    assert sum(router["routed_requests"].values()) == NUM_PROMPTS
    assert 0.0 <= router["offloaded_fraction"] <= 1.0
