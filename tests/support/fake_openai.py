"""An in-process OpenAI-compatible SSE server on 127.0.0.1 port 0, standing in for a real one in unit tests."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeOpenAI:
    """Streams `max_tokens` one-token chunks, `token_delay_s` apart; `status` != 200 answers every request with it."""

    model: str = "fake-model"
    token_delay_s: float = 0.0
    status: int = 200
    send_usage: bool = True
    extra_usage_tokens: int = 0
    error_after_tokens: int | None = None
    metrics_text: "str | Callable[[FakeOpenAI], str] | None" = None
    in_flight: int = 0
    max_in_flight: int = 0
    num_served: int = 0
    received: list[dict] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeOpenAI":
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            raise web.HTTPNotFound()
        text = self.metrics_text(self) if callable(self.metrics_text) else self.metrics_text
        return web.Response(text=text)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        except ConnectionResetError:  # the client went away mid-stream (a stopped benchmark)
            return web.Response(status=499)
        finally:
            self.in_flight -= 1
            self.num_served += 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.received_at.append(time.perf_counter())
        if self.status != 200:
            error = {"error": {"message": f"fake error {self.status}", "type": "service_unavailable", "code": None}}
            return web.json_response(error, status=self.status)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        num_tokens = body.get("max_tokens", 16)
        for index in range(num_tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if index == self.error_after_tokens:
                await _send(response, {"error": {"message": "worker failed", "type": "service_unavailable"}})
                break
            finish = "length" if index == num_tokens - 1 else None
            choice = {"index": 0, "delta": {"content": f" t{index}"}} if chat else {"index": 0, "text": f" t{index}"}
            await _send(response, {"choices": [{**choice, "finish_reason": finish}]})
        if self.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": num_tokens + self.extra_usage_tokens}
            await _send(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")


class FakeOpenAIThread:
    """A FakeOpenAI on its own event loop in a background thread, for code that runs its own loop (the CLI)."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        self._loop = asyncio.new_event_loop()
        self._thread = None

    def __enter__(self) -> FakeOpenAI:
        import threading

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fake.start(), self._loop).result(10)
        return self.fake

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
