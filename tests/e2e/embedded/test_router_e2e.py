"""The walking skeleton end to end: `prfaas up` processes (the embedded deployment,
tests/e2e/embedded/conftest.py, whose teardown checks that SIGTERM stops every service), real vLLM,
the official openai client."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from services.models import smollm2
from support.baseline import greedy_token_texts
from support.deployment import wait_until
from support.embedded import API_KEY, MODEL

pytestmark = pytest.mark.e2e

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def deployment(embedded):
    return embedded


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_up_prints_endpoint_and_sample_curl(deployment):
    output = deployment.child("up").log_path.read_text()
    assert deployment.base_url + "/v1" in output
    assert "curl " in output
    assert "Authorization: Bearer" in output


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=24, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 24


def test_text_completion_respects_max_tokens_and_stop(client):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    words = reply.choices[0].text.split()
    stopped = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                        stop=[words[2]])
    assert stopped.choices[0].finish_reason == "stop"
    assert words[2] not in stopped.choices[0].text


def test_greedy_output_matches_vllm_called_directly(client):
    """Router path vs the same engine settings through vLLM's own offline API, token for token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.prepare())
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    direct = _direct_vllm_greedy(prompts, max_tokens=32)
    for question, expected in zip(QUESTIONS, direct):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                               max_tokens=32, temperature=0)
        streamed = _stream_chat(client, question)
        assert reply.choices[0].message.content == expected["text"]
        assert reply.usage.completion_tokens == len(expected["token_ids"])
        assert streamed["text"] == expected["text"]
        assert streamed["usage"].completion_tokens == len(expected["token_ids"])
        assert streamed["usage"].prompt_tokens == reply.usage.prompt_tokens
        assert streamed["num_content_chunks"] <= streamed["usage"].completion_tokens


def _stream_chat(client, question: str) -> dict:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[0].choices[0].delta.role == "assistant"
    return {"text": "".join(content), "usage": chunks[-1].usage, "num_content_chunks": len(content)}


def _direct_vllm_greedy(prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """vLLM's offline API with decode-0's engine settings (one OpenMP thread on CPU 1, chunks of the
    default budget, EOS honoured); cached by support/baseline.py."""
    answers = greedy_token_texts(str(smollm2.prepare()), prompts, [2048] * len(prompts), max_tokens, cpu=1,
                                 ignore_eos=False)
    return [{"text": text, "token_ids": tokens} for text, tokens in answers]


def test_eight_concurrent_streams_complete(deployment):
    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason

    async def run():
        async with openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key=API_KEY,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert asyncio.run(run()) == [(16, "length")] * 8


def test_client_disconnect_aborts_the_request_on_the_worker(deployment):
    stats = deployment.worker_stats  # with the token `prfaas up` generated
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", deployment.base_url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            assert stats("decode-0").num_active_requests == 1
    assert wait_until(lambda: stats("decode-0").num_active_requests == 0, timeout_s=15)
    assert wait_until(lambda: stats("decode-0").num_running_requests == 0, timeout_s=15)


BAD_INPUTS = [
    ("malformed JSON", "/v1/chat/completions", b"{not json", {}, 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", {}, 400, None),
    ("missing model", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, {}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    ("bad temperature", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, {}, 400,
     "temperature"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, {}, 404, "model"),
    ("context exceeded", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4000}, {}, 400, "prompt"),
    ("n > 1 greedy", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3,
                                               "temperature": 0}, {}, 400, "n"),
    ("n above 16", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17},
     {}, 400, "n"),
    ("missing API key", "/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": None}, 401, None),
    ("wrong API key", "/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401,
     None),
    ("unknown path", "/v1/embeddings", {"model": MODEL}, {}, 404, None),
]


@pytest.mark.parametrize("name, path, body, headers, status, param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(deployment, name, path, body, headers, status, param):
    all_headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **headers}
    all_headers = {k: v for k, v in all_headers.items() if v is not None}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(deployment.base_url + path, content=content, headers=all_headers, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_openai_client_sees_typed_errors_and_server_keeps_serving(client, deployment):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x " * 2100, max_tokens=2)
    bad_key = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).usage.completion_tokens > 0


def test_health_and_metrics_are_public(deployment):
    health = httpx.get(deployment.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["workers"] == {"prefill-0": True, "decode-0": True}
    metrics = httpx.get(deployment.base_url + "/metrics", timeout=10).text
    for name in ("prfaas_router_requests_total", "prfaas_router_time_to_first_token_seconds_bucket",
                 "prfaas_router_inter_token_latency_seconds_bucket", "prfaas_router_e2e_request_latency_seconds",
                 "prfaas_router_prompt_tokens_total", "prfaas_router_generation_tokens_total"):
        assert name in metrics
    assert 'status="401"' in metrics and 'status="200"' in metrics
