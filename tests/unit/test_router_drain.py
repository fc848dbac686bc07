"""The router's stop (services/router/drain.py) on its real HTTP app: new requests get 503 with
Retry-After, requests in flight finish within the bound, and a stream still going past it ends with an
OpenAI-shaped error event before [DONE], never a finish_reason of its own."""
from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession, web

from services.router.app import RouterApp
from services.router.metrics import RouterMetrics
from services.worker_api.types import TokenDelta
from support.ports import free_port


class _Tokenizer:
    vocab_size = 100

    async def encode(self, request) -> list[int]:
        return [1, 2, 3]

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"


class _Dispatcher:
    """Streams one token every ``interval_s``, ``num_tokens`` in all."""

    def __init__(self, num_tokens: int, interval_s: float) -> None:
        self.num_tokens = num_tokens
        self.interval_s = interval_s
        self.num_closed = 0

    async def plan(self, request):
        return None

    async def generate(self, request, plan):
        try:
            for i in range(self.num_tokens):
                await asyncio.sleep(self.interval_s)
                last = i == self.num_tokens - 1
                yield TokenDelta(f"t{i} ", (i,), "length" if last else None, 3, 0)
        finally:
            self.num_closed += 1


class _Layouts:
    pairs = ()


class _Pool:
    handles = ()
    layouts = _Layouts()

    def any_healthy(self) -> bool:
        return True


async def _serve(dispatcher: _Dispatcher):
    router = RouterApp(model_name="m", max_model_len=2048, api_keys=frozenset(), tokenizer=_Tokenizer(),
                       pool=_Pool(), dispatcher=dispatcher, metrics=RouterMetrics())
    runner = web.AppRunner(router.build(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return router, runner, f"http://127.0.0.1:{port}/v1/completions"


BODY = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}


async def _read_stream(session: ClientSession, url: str, started: asyncio.Event) -> list[str]:
    async with session.post(url, json=BODY) as reply:
        assert reply.status == 200
        events = []
        async for line in reply.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
        return events


def _run(dispatcher: _Dispatcher, drain_timeout_s: float):
    async def body():
        router, runner, url = await _serve(dispatcher)
        try:
            async with ClientSession() as session:
                started = asyncio.Event()
                stream = asyncio.create_task(_read_stream(session, url, started))
                await started.wait()
                drain = asyncio.create_task(router.drain.run(drain_timeout_s, ending_s=2))
                await asyncio.sleep(0.05)
                async with session.post(url, json=BODY) as refused:
                    refusal = (refused.status, refused.headers.get("Retry-After"), await refused.json())
                async with session.get(url.replace("/v1/completions", "/health")) as health:
                    health_status = health.status
                await drain
                return await stream, refusal, health_status, router.drain.num_in_flight
        finally:
            await runner.cleanup()
    return asyncio.run(body())


def test_a_stream_in_flight_finishes_within_the_bound_and_new_requests_are_refused():
    dispatcher = _Dispatcher(num_tokens=10, interval_s=0.05)
    events, refusal, health_status, num_left = _run(dispatcher, drain_timeout_s=10)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"t{i} " for i in range(10))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    status, retry_after, body = refusal
    assert (status, retry_after, body["error"]["code"]) == (503, "5", "server_stopping")
    assert health_status == 503
    assert num_left == 0


def test_a_stream_past_the_bound_ends_with_an_error_event_before_done():
    dispatcher = _Dispatcher(num_tokens=1000, interval_s=0.05)
    events, refusal, _, num_left = _run(dispatcher, drain_timeout_s=0.5)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "service_unavailable" and last["error"]["code"] == "server_stopping"
    finish_reasons = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-2])]
    assert 3 < len(finish_reasons) < 1000 and set(finish_reasons) == {None}
    assert refusal[0] == 503
    assert num_left == 0 and dispatcher.num_closed == 1
