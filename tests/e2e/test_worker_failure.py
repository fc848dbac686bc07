"""A dead decode worker: a request it was streaming moves to a live one and its client's stream goes
on, under the same penalties and grammar; a request that cannot go on exactly ends with an error
event; new requests are routed around a dead worker; with no worker left, the router answers 503 fast.

Each test that kills a worker restarts it at once (``_kill``), so that the restart overlaps the rest
of the stream; a test that needs two workers waits for them (``_wait_for_workers``)."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from services.launcher import supervisor
from support.deployment import deployment_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
WORKERS = ("decode-0", "decode-1")
# A prompt whose greedy continuation is confident token by token (a count), so that the text after a
# move does not hinge on a near-tie that a prefill and a decode step might break differently.
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
NUM_TOKENS = 150  # long enough that the worker is still generating when it is killed (after 6 chunks)
# Greedy, this repeats itself ("I'm a big fan of the apple pie, ...") unless frequency_penalty counts
# every token generated so far: the penalty changes the text well after the kill lands.
FRUITS = "My favourite fruits are apples, bananas,"
COLOURS = {"type": "object", "additionalProperties": False, "required": ["colours"], "properties": {
    "colours": {"type": "array", "minItems": 10, "maxItems": 10, "items": {"type": "string", "maxLength": 12}}}}
KILL_AFTER_CHUNKS = 6


@pytest.fixture(scope="module")
def deployment(start_deployment):
    config = deployment_config([{"name": name, "service": "decode_worker"} for name in WORKERS],
                               router={"stats_interval_s": 30.0})
    # float32 (as on a host without native bfloat16): a moved request's earlier tokens are prefilled
    # where the first worker decoded them, and in bfloat16 the two round apart enough to flip the
    # near-ties a penalised or free-text continuation meets
    config["model"]["dtype"] = "float32"
    deployment = start_deployment(config, "failure")
    deployment.dead = set()
    return deployment


def _client(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _serving(deployment) -> str | None:
    """The live worker with a request in flight (a restarting one does not answer yet: skipped)."""
    for name in WORKERS:
        if name in deployment.dead:
            continue
        try:
            if deployment.worker_stats(name).num_active_requests > 0:
                return name
        except grpc.RpcError:  # restarting: not serving yet
            continue
    return None


def _kill(deployment, name: str, restart: bool = True) -> None:
    """SIGKILL the worker's process group; ``restart``: start it again at once (not waited for)."""
    deployment.kill(name)
    if restart:
        deployment.child(name).start()
    else:
        deployment.dead.add(name)


def _wait_for_workers(deployment) -> None:
    """Every worker not killed for good serves, and the router has seen it up."""
    live = [w for w in deployment.config["workers"] if w["name"] not in deployment.dead]

    def up() -> bool:
        return all(supervisor.worker_serving("127.0.0.1", w["port"], deployment.security)
                   and deployment.metric(f'prfaas_router_worker_up{{worker="{w["name"]}"}}') == 1 for w in live)

    assert wait_until(up, 120), deployment.logs()


def _kill_mid_stream(deployment, stream, restart: bool = True) -> list:
    """The stream's chunks; its worker is killed after the first few."""
    chunks, victim = [], None
    for chunk in stream:
        chunks.append(chunk)
        if victim is None and len(chunks) == KILL_AFTER_CHUNKS:
            victim = _serving(deployment)
            assert victim is not None, "no worker reports the request in flight"
            _kill(deployment, victim, restart)
    assert victim is not None, "the stream ended before the kill"
    return chunks


def _migrations(deployment, outcome: str) -> float:
    moves = re.findall(r'^prfaas_router_migrations_total\{(.*)\} (\S+)$', deployment.metrics_text(), re.MULTILINE)
    return sum(float(count) for labels, count in moves if f'outcome="{outcome}"' in labels)


def test_a_stream_whose_worker_is_killed_goes_on_elsewhere_token_exact(deployment):
    client = _client(deployment)
    request = {"model": MODEL, "prompt": COUNT, "max_tokens": NUM_TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**request).choices[0].text
    moved = _migrations(deployment, "resumed")
    chunks = _kill_mid_stream(deployment, client.completions.create(**request, stream=True,
                                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert chunks[-1].usage.prompt_tokens == client.completions.create(model=MODEL, prompt=COUNT,
                                                                       max_tokens=1).usage.prompt_tokens
    assert _migrations(deployment, "resumed") - moved == 1


def test_a_moved_request_keeps_counting_its_earlier_tokens_for_frequency_penalty(deployment):
    _wait_for_workers(deployment)
    client = _client(deployment)
    request = {"model": MODEL, "prompt": FRUITS, "max_tokens": 64, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:  # on both workers at once
        penalised, free = pool.map(lambda penalty: client.completions.create(**request, frequency_penalty=penalty)
                                   .choices[0].text, (1.0, 0.0))
    assert penalised != free, "the penalty changes nothing"
    moved = _migrations(deployment, "resumed")
    chunks = _kill_mid_stream(deployment, client.completions.create(**request, frequency_penalty=1.0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == penalised
    assert _migrations(deployment, "resumed") - moved == 1


def test_a_moved_request_continues_its_json_schema_from_where_it_stood(deployment):
    client = _client(deployment)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "List ten colours as JSON."}],
               "max_tokens": 300, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "colours", "schema": COLOURS}}}
    _wait_for_workers(deployment)
    reference = client.chat.completions.create(**request).choices[0].message.content
    jsonschema.validate(json.loads(reference), COLOURS)
    moved = _migrations(deployment, "resumed")
    chunks = _kill_mid_stream(deployment, client.chat.completions.create(**request, stream=True), restart=False)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    jsonschema.validate(json.loads(text), COLOURS)
    assert _migrations(deployment, "resumed") - moved == 1


def test_killed_worker_is_routed_around_then_a_request_that_cannot_move_exactly_ends_then_503(deployment):
    """One worker killed for good: requests go to the other. Then a request that cannot move exactly
    (presence_penalty) loses that worker mid-stream: its stream ends with an error event saying why
    (before any worker is looked for: none is left). Then every request is a 503."""
    client = _client(deployment)
    if not deployment.dead:
        _kill(deployment, "decode-0", restart=False)
    for _ in range(3):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens > 0
    inexact = _migrations(deployment, "inexact")
    stream = client.completions.create(model=MODEL, prompt=FRUITS, max_tokens=64, temperature=0,
                                       presence_penalty=0.5, stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as excinfo:
        _kill_mid_stream(deployment, stream, restart=False)
    assert "cannot move to another worker exactly" in excinfo.value.message
    assert "presence_penalty" in excinfo.value.message
    assert excinfo.value.body["code"] == "worker_failed"
    assert _migrations(deployment, "inexact") - inexact == 1
    for name in set(WORKERS) - deployment.dead:
        deployment.kill(name)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert excinfo.value.status_code == 503
    assert "No worker is available" in excinfo.value.response.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    assert deployment.child("router").process.poll() is None
