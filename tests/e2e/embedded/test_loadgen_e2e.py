"""`prfaas bench serve` against the real embedded deployment (router, prefill worker, decode worker,
vLLM; tests/e2e/embedded/conftest.py), which logs JSON lines: one request id must follow a request
through every service."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import openai
import pytest

from support.deployment import wait_until
from support.embedded import API_KEY

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
NUM_PROMPTS = 8
OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def deployment(embedded):
    return embedded


def bench(deployment, tmp_path, *args) -> dict:
    path = tmp_path / "result.json"
    command = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", deployment.base_url,
               "--model", MODEL, "--num-prompts", str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN),
               "--ignore-eos", "--temperature", "0", "--max-concurrency", "4", "--no-progress", "--fail-on-error",
               "--result-file", str(path), "--api-key", API_KEY, *args]
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
    result = bench(deployment, tmp_path, "--input-len", "640", "--request-rate", "4")
    assert result["completed"] == NUM_PROMPTS and result["usage_mismatches"] == 0
    assert result["usage_prompt_tokens"] == [640] * NUM_PROMPTS
    router = result["router_metrics"]
    assert sum(router["routed_requests"].values()) == NUM_PROMPTS
    assert 0.0 <= router["offloaded_fraction"] <= 1.0


def _tagged(deployment, service: str, request_id: str) -> bool:
    """Whether ``service`` wrote a JSON log line tagged with ``request_id``."""
    for line in (deployment.directory / f"{service}.log").read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("request_id") == request_id:
            return True
    return False


def test_one_request_id_follows_a_request_through_every_service(deployment):
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    prompt = [1000 + i % 5000 for i in range(1500)]  # over the offload threshold: prefilled on prefill-0
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True},
                                      extra_headers={"X-Request-Id": request_id})
    assert reply.id == request_id
    for service in ("router", "prefill-0", "decode-0"):
        # wait_until calls the lambda before the loop moves on
        assert wait_until(lambda: _tagged(deployment, service, request_id), 10), \
            f"{service} has no line for it"  # noqa: B023
