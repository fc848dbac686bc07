"""Admission control end to end: a real router in front of the embedded deployment's workers, the
official openai client.

Capacity is 2 requests in flight, half of it reserved for the `premium` class, so `standard`
requests get one slot: concurrent ones beyond it are refused with 429 and `Retry-After`, while
a `premium` request still gets in. An unknown class in `X-PrfaaS-QoS` is a 400.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from support.deployment import wait_until

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SCHEDULER = {
    "admission_control": True,
    "max_in_flight_requests": 2,
    "retry_after_s": 2,
    "default_qos_class": "standard",
    "qos_classes": [{"name": "premium", "priority": 10, "reserved_fraction": 0.5},
                    {"name": "standard", "priority": 0}],
}


@pytest.fixture(scope="module")
def deployment(embedded, tmp_path_factory):
    """A router of its own with admission control, in front of the embedded deployment's workers."""
    router = embedded.start_router(tmp_path_factory.mktemp("admission"), scheduler=SCHEDULER)
    yield router
    router.stop()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, qos: str | None = None, max_tokens: int = 24):
    headers = {"X-PrfaaS-QoS": qos} if qos else None
    return client.completions.create(model=MODEL, prompt="Tell me about the sea.", max_tokens=max_tokens,
                                     temperature=0, extra_headers=headers, extra_body={"ignore_eos": True})


def outcome(client, qos: str | None = None):
    try:
        return ask(client, qos)
    except openai.RateLimitError as exc:
        return exc


def metrics(deployment) -> str:
    return httpx.get(deployment.base_url + "/metrics", timeout=10).text


def test_concurrent_requests_beyond_capacity_get_429_with_retry_after(deployment, client):
    barrier = threading.Barrier(5)

    def send(_):
        barrier.wait()
        return outcome(client)

    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(send, range(5)))
    completed = [r for r in results if not isinstance(r, Exception)]
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(completed) + len(rejected) == 5
    assert completed and rejected
    assert all(r.usage.completion_tokens == 24 for r in completed)
    for error in rejected:
        assert error.status_code == 429
        assert error.response.headers["retry-after"] == "2"
        body = error.response.json()["error"]
        assert body["type"] == "rate_limit_error" and body["code"] == "capacity"
    text = metrics(deployment)
    assert f'prfaas_router_rejected_requests_total{{qos_class="standard",reason="capacity"}} {len(rejected)}.0' in text
    assert 'prfaas_router_in_flight_requests{qos_class="standard"} 0.0' in text


def test_reserved_capacity_admits_premium_while_standard_is_refused(deployment, client):
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(ask, client, None, 96)
        assert wait_until(lambda: 'in_flight_requests{qos_class="standard"} 1.0' in metrics(deployment), 30)
        assert isinstance(outcome(client, "standard"), openai.RateLimitError)
        assert ask(client, "premium").usage.completion_tokens == 24
        assert running.result().usage.completion_tokens == 96


def test_unknown_qos_class_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        ask(client, "platinum")
    error = excinfo.value.response.json()["error"]
    assert error["code"] == "unknown_qos_class" and error["param"] == "X-PrfaaS-QoS"
    assert "premium, standard" in error["message"]
