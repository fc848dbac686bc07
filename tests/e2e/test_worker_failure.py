"""A dead decode worker: a request it was streaming moves to a live one and its client's stream goes
on; new requests are routed around it; with no worker left, the router answers 503 fast."""
from __future__ import annotations

import re
import time

import openai
import pytest

from support.deployment import deployment_config

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
# A prompt whose greedy continuation is confident token by token (a count), so that the text after a
# move does not hinge on a near-tie that a prefill and a decode step might break differently.
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
NUM_TOKENS = 300  # long enough that the worker is still generating when it is killed


@pytest.fixture(scope="module")
def deployment(start_deployment):
    config = deployment_config([{"name": "decode-0", "service": "decode_worker"},
                                {"name": "decode-1", "service": "decode_worker"}],
                               router={"stats_interval_s": 30.0})
    deployment = start_deployment(config, "failure")
    deployment.dead = set()
    return deployment


def _client(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _serving(deployment) -> str | None:
    return next((name for name in ("decode-0", "decode-1")
                 if deployment.worker_stats(name).num_active_requests > 0), None)


def test_a_stream_whose_worker_is_killed_goes_on_elsewhere_token_exact(deployment):
    client = _client(deployment)
    request = {"model": MODEL, "prompt": COUNT, "max_tokens": NUM_TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**request).choices[0].text
    stream = client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks, victim = [], None
    for chunk in stream:
        chunks.append(chunk)
        if victim is None and len(chunks) == 6:
            victim = _serving(deployment)
            assert victim is not None, "no worker reports the request in flight"
            deployment.kill(victim)
            deployment.dead.add(victim)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert chunks[-1].usage.prompt_tokens == client.completions.create(model=MODEL, prompt=COUNT,
                                                                       max_tokens=1).usage.prompt_tokens
    moves = re.findall(r'^prfaas_router_migrations_total\{(.*)\} (\S+)$', deployment.metrics_text(), re.MULTILINE)
    assert sum(float(count) for labels, count in moves if 'outcome="resumed"' in labels) == 1, moves


def test_killed_worker_is_routed_around_then_503(deployment):
    client = _client(deployment)
    if not deployment.dead:
        deployment.kill("decode-0")
        deployment.dead.add("decode-0")
    for _ in range(3):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens > 0
    for name in {"decode-0", "decode-1"} - deployment.dead:
        deployment.kill(name)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert excinfo.value.status_code == 503
    assert "No worker is available" in excinfo.value.response.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    assert deployment.child("router").process.poll() is None
