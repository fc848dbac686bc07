"""The OpenAI-compatible HTTP endpoint (aiohttp on uvloop)."""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.worker_api.types import GenerateInput
from services.logs import bind_request_id
from services.router.admission import QOS_HEADER, AdmissionControl
from services.router.dispatch import Dispatcher, NoWorkerAvailable, Plan
from services.router.drain import Drain, RouterStopping, stopping_error
from services.router.errors import ApiError, bad_request, invalid_api_key, unavailable
from services.router.metrics import RouterMetrics
from services.router.openai_api import ApiRequest, parse_request, with_max_tokens
from services.router.responses import ResponseShape, Usage
from services.router.tokenizer import PromptTokenizer
from services.router.workers import WorkerError, WorkerFailed, WorkerPool, WorkerRejected
from services.scheduling.admission import QosClass

logger = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/metrics", "/openapi.json")


class RouterApp:
    def __init__(self, *, model_name: str, max_model_len: int, api_keys: frozenset[str],
                 tokenizer: PromptTokenizer, pool: WorkerPool, dispatcher: Dispatcher,
                 metrics: RouterMetrics, admission: AdmissionControl | None = None,
                 max_body_bytes: int = 64 << 20) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes
        self.api_keys = api_keys
        self.tokenizer = tokenizer
        self.pool = pool
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.admission = admission
        self.created = int(time.time())
        self.drain = Drain()

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_and_auth], client_max_size=self.max_body_bytes)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        response = await self._handle(request, handler)
        if request.path.startswith("/v1/"):
            self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    async def _handle(self, request: web.Request, handler):
        try:
            if (request.content_length or 0) > self.max_body_bytes:
                raise self._too_large()  # before authenticating, reading or parsing anything
            if self.api_keys and request.path not in PUBLIC_PATHS:
                self._authenticate(request)
            if not request.path.startswith("/v1/"):
                return await handler(request)
            if self.drain.draining:
                raise stopping_error()
            with self.drain.tracked():
                return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit while read
            return _error_response(self._too_large())
        except ApiError as exc:
            return _error_response(exc)
        except RouterStopping:
            return _error_response(stopping_error())
        except (NoWorkerAvailable, WorkerRejected, WorkerError) as exc:
            return _error_response(_dispatch_error(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(ApiError(exc.status, exc.reason or "error", code=str(exc.status)))
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return _error_response(ApiError(500, "Internal server error", type="server_error"))

    def _too_large(self) -> ApiError:
        return ApiError(413, f"The request body is larger than this server accepts ({self.max_body_bytes} bytes, "
                        "router.max_body_bytes).", code="request_too_large")

    async def openapi(self, request: web.Request) -> web.Response:
        from services.router.openapi import document

        return web.json_response(document(self.model_name, self.max_body_bytes))

    def _authenticate(self, request: web.Request) -> None:
        if _bearer_token(request) not in self.api_keys:
            raise invalid_api_key()

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "prfaas",
                "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        workers = {h.name: h.healthy for h in self.pool.handles}
        layouts = [pair.as_dict() for pair in self.pool.layouts.pairs]
        ok = self.pool.any_healthy() and not self.drain.draining
        status = "draining" if self.drain.draining else "ok" if ok else "unavailable"
        return web.json_response({"status": status, "workers": workers, "layouts": layouts},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        started = time.monotonic()
        api_request = parse_request(await _json_body(request), kind, self.model_name)
        qos = self.admission.qos_class(request.headers.get(QOS_HEADER), _bearer_token(request)) \
            if self.admission else None
        generate_input = await self._generate_input(api_request, request)
        bind_request_id(generate_input.request_id)
        shape = ResponseShape(kind, generate_input.request_id, self.model_name, int(time.time()))
        plan = await self.drain.until_stopped(self.dispatcher.plan(generate_input))
        with self._admitted(generate_input, qos, plan):
            try:
                if api_request.stream:
                    return await self._stream(request, api_request, generate_input, plan, shape, started)
                return await self._complete(generate_input, plan, shape, started)
            finally:
                self.metrics.e2e.observe(time.monotonic() - started)

    def _admitted(self, generate_input: GenerateInput, qos: QosClass | None, plan: Plan):
        if self.admission is None:
            return contextlib.nullcontext()
        return self.admission.admitted(generate_input.request_id, qos, plan.route,
                                       len(generate_input.prompt_token_ids), generate_input.sampling.max_tokens)

    async def _generate_input(self, api_request: ApiRequest, request: web.Request) -> GenerateInput:
        prompt_ids = await self.tokenizer.encode(api_request)
        room = self.max_model_len - len(prompt_ids)
        if room < 1 or (api_request.max_tokens or 1) > room:
            wanted = api_request.max_tokens or 1
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the prompt, {wanted} for the completion).",
                param="messages" if api_request.kind == "chat" else "prompt", code="context_length_exceeded")
        prefix = "chatcmpl" if api_request.kind == "chat" else "cmpl"
        request_id = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        sampling = with_max_tokens(api_request.sampling, api_request.max_tokens or room)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return GenerateInput(request_id, prompt_ids, sampling)

    async def _complete(self, generate_input: GenerateInput, plan: Plan, shape: ResponseShape,
                        started: float) -> web.Response:
        usage = Usage(len(generate_input.prompt_token_ids))
        stream = _Timed(self.dispatcher.generate(generate_input, plan), self.metrics, started, usage)

        async def collect() -> tuple[str, str | None]:
            texts, finish_reason = [], None
            async for delta in stream:
                texts.append(delta.text)
                finish_reason = delta.finish_reason or finish_reason
            return "".join(texts), finish_reason

        try:
            text, finish_reason = await self.drain.until_stopped(collect())
        except WorkerFailed as exc:
            raise ApiError(503, str(exc), type="service_unavailable", code="worker_failed") from None
        return web.json_response(shape.full(text, finish_reason, usage))

    async def _stream(self, request: web.Request, api_request: ApiRequest, generate_input: GenerateInput,
                      plan: Plan, shape: ResponseShape, started: float) -> web.StreamResponse:
        usage = Usage(len(generate_input.prompt_token_ids))
        include_usage = api_request.include_usage
        deltas = _Timed(self.dispatcher.generate(generate_input, plan), self.metrics, started, usage).__aiter__()
        first = await self.drain.until_stopped(deltas.__anext__())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if api_request.kind == "chat":
            await _send(response, shape.chunk(None, None, include_usage, first=True))
        try:
            delta = first
            while True:
                if delta.text or delta.finish_reason:
                    await _send(response, shape.chunk(delta.text, delta.finish_reason, include_usage))
                if delta.finish_reason:
                    break
                delta = await self.drain.until_stopped(deltas.__anext__())
        except WorkerFailed as exc:
            await _send(response, ApiError(503, str(exc), type="service_unavailable", code="worker_failed").body())
        except RouterStopping:  # past router.drain_timeout_s: the client learns its answer is cut
            await _send(response, stopping_error().body())
        finally:
            await deltas.aclose()
        if include_usage:
            await _send(response, shape.usage_chunk(usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Timed:
    """Wraps a delta stream to count usage and record TTFT and inter-token latency."""

    def __init__(self, deltas, metrics: RouterMetrics, started: float, usage: Usage) -> None:
        self._deltas = deltas
        self._metrics = metrics
        self._last = started
        self._usage = usage

    async def __aiter__(self):
        try:
            async for delta in self._deltas:
                if delta.token_ids:
                    now = time.monotonic()
                    histogram = self._metrics.itl if self._usage.completion_tokens else self._metrics.ttft
                    histogram.observe(now - self._last)
                    self._last = now
                    self._usage.completion_tokens += len(delta.token_ids)
                    self._usage.cached_tokens = delta.num_cached_tokens
                    self._metrics.generation_tokens.inc(len(delta.token_ids))
                yield delta
        finally:
            await self._deltas.aclose()


def _bearer_token(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def _json_body(request: web.Request):
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None


async def _send(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")


def _dispatch_error(exc: Exception) -> ApiError:
    """What a client sees of a request the workers could not start."""
    if isinstance(exc, WorkerRejected):
        return bad_request(str(exc))
    if isinstance(exc, WorkerError):
        return ApiError(500, str(exc), type="server_error")
    return unavailable(str(exc))


def _error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
