"""`prfaas bench serve` against vLLM's own OpenAI server on the same model as the embedded default."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine.args import resolve_dtype
from services.launcher.supervisor import router_healthy
from support.deployment import wait_until
from support.ports import free_port

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
NUM_PROMPTS = 8
OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    from services.models import smollm2

    port = free_port()
    log = (tmp_path_factory.mktemp("vllm") / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2.prepare()),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
         "--dtype", resolve_dtype("auto", smollm2.prepare()), "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        # vLLM's /health, like the router's, answers 200 once the engine can serve.
        assert wait_until(lambda: server.poll() is None and router_healthy("127.0.0.1", port), 300, interval_s=1), \
            f"vLLM's server did not start (exit code {server.poll()}); see {log.name}"
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def _bench(url: str, tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", url, "--num-prompts",
         str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--temperature", "0",
         "--max-concurrency", "4", "--no-progress", "--result-file", str(path), *args],
        capture_output=True, text=True, timeout=600)
    return run, json.loads(path.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_matches_what_vllm_reports(vllm_server, tmp_path, endpoint):
    run, result = _bench(vllm_server, tmp_path, "--model", MODEL, "--endpoint", endpoint, "--input-len", "64",
                         "--fail-on-error")
    assert run.returncode == 0, run.stdout + run.stderr
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["output_lens"] == result["streamed_chunks"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["usage_mismatches"] == 0 and result["usage_missing"] == 0
    if endpoint == "completions":
        assert result["usage_prompt_tokens"] == [64] * NUM_PROMPTS  # exact-length prompts from the tokenizer
    assert result["median_ttft_ms"] > 0 and result["output_throughput"] > 0
    assert not result.get("router_metrics")  # vLLM's server is not a PrfaaS router


def test_a_wrong_model_is_a_clear_error_with_a_result_file(vllm_server, tmp_path):
    run, result = _bench(vllm_server, tmp_path, "--model", "no-such-model")
    assert run.returncode == 0  # errors alone exit 0 unless --fail-on-error
    assert "no-such-model" in result["fatal_error"] and MODEL in result["fatal_error"]  # names what is served
    assert "no-such-model" in run.stdout + run.stderr and "Traceback" not in run.stderr
    assert result["completed"] == 0
    run, _ = _bench(vllm_server, tmp_path, "--model", "no-such-model", "--fail-on-error")
    assert run.returncode != 0
