"""A dead decode worker: the router moves requests to a live one, then answers 503 fast."""
from __future__ import annotations

import time

import openai
import pytest

from support.deployment import deployment_config

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def deployment(start_deployment):
    config = deployment_config([{"name": "decode-0", "service": "decode_worker"},
                                {"name": "decode-1", "service": "decode_worker"}],
                               router={"stats_interval_s": 30.0})
    return start_deployment(config, "failure")


def test_killed_worker_is_routed_around_then_503(deployment):
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    deployment.kill("decode-0")
    for _ in range(3):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens > 0
    deployment.kill("decode-1")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert excinfo.value.status_code == 503
    assert "No worker is available" in excinfo.value.response.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    assert deployment.child("router").process.poll() is None
