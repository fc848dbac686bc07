"""The OpenAI-compatible HTTP endpoint (aiohttp on uvloop)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.worker_api.types import GenerateInput, TokenDelta
from services.logs import bind_request_id
from services.router.admission import QOS_HEADER, AdmissionControl
from services.router.choices import ChoiceWriter, choice_sampling
from services.router.dispatch import Dispatcher, NoWorkerAvailable, Plan
from services.router.drain import Drain, RouterStopping, stopping_error
from services.router.errors import ApiError, bad_request, invalid_api_key, unavailable
from services.router.metrics import RouterMetrics
from services.router.openai_api import ApiRequest, parse_request, with_max_tokens
from services.router.responses import ResponseShape, Usage
from services.router.tokenizer import PromptTokenizer
from services.router.tools import ToolCalls
from services.router.workers import WorkerError, WorkerFailed, WorkerPool, WorkerRejected
from services.scheduling.admission import QosClass

logger = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/metrics", "/openapi.json")


class RouterApp:
    def __init__(self, *, model_name: str, max_model_len: int, api_keys: frozenset[str],
                 tokenizer: PromptTokenizer, pool: WorkerPool, dispatcher: Dispatcher,
                 metrics: RouterMetrics, admission: AdmissionControl | None = None,
                 max_body_bytes: int = 64 << 20, max_sequences: int = 16,
                 max_structured_bytes: int = 64 << 10, tool_calls: ToolCalls | None = None) -> None:
        """``tool_calls``: how tool-call requests are answered (default: no tool parser, ``model.tool_parser``
        unset)."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes
        self.max_sequences = max_sequences
        self.max_structured_bytes = max_structured_bytes
        self.tool_calls = tool_calls or ToolCalls(None, Path())
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
        api_request = parse_request(await _json_body(request), kind, self.model_name, self.tokenizer.vocab_size,
                                    self.max_structured_bytes)
        if api_request.num_sequences > self.max_sequences:
            num_prompts = max(1, len(api_request.prompts))
            raise bad_request(f"This request asks for {api_request.num_sequences} sequences ({num_prompts} "
                              f"prompt(s) x n={api_request.n}); at most {self.max_sequences} "
                              "(router.max_sequences_per_request)", param="n")
        qos = self.admission.qos_class(request.headers.get(QOS_HEADER), _bearer_token(request)) \
            if self.admission else None
        request_id = _request_id(request, api_request.kind)
        bind_request_id(request_id)
        if api_request.kind == "chat" and api_request.uses_tools:
            structured = await asyncio.to_thread(self.tool_calls.structured, api_request.body, api_request.tools,
                                                 api_request.tool_choice)
            if structured is not None:
                api_request = dataclasses.replace(api_request, sampling=dataclasses.replace(
                    api_request.sampling, structured=structured))
        jobs = await self._jobs(api_request, request_id)
        shape = ResponseShape(kind, request_id, self.model_name, int(time.time()))
        for job in jobs:
            job.plan = await self.drain.until_stopped(self.dispatcher.plan(job.input))
        with contextlib.ExitStack() as admitted:
            for job in jobs:
                admitted.enter_context(self._admitted(job.input, qos, job.plan))
            try:
                usage = Usage(sum(job.num_prompt_tokens for job in jobs if job.sample_index == 0))
                if api_request.stream:
                    return await self._stream(request, api_request, jobs, shape, usage, started)
                return await self._complete(api_request, jobs, shape, usage, started)
            finally:
                self.metrics.e2e.observe(time.monotonic() - started)

    def _admitted(self, generate_input: GenerateInput, qos: QosClass | None, plan: Plan):
        if self.admission is None:
            return contextlib.nullcontext()
        return self.admission.admitted(generate_input.request_id, qos, plan.route,
                                       len(generate_input.prompt_token_ids), generate_input.sampling.max_tokens)

    async def _jobs(self, api_request: ApiRequest, request_id: str) -> list[_Job]:
        """One worker request per choice: each prompt (one for chat) times ``n``."""
        prompts = api_request.prompts or (None,)
        jobs = []
        for prompt_index, prompt in enumerate(prompts):
            one = api_request if prompt is None else dataclasses.replace(api_request, prompt=prompt)
            prompt_ids = await self.tokenizer.encode(one)
            self._check_context(api_request, len(prompt_ids))
            room = self.max_model_len - len(prompt_ids)
            max_tokens = api_request.max_tokens if api_request.max_tokens is not None else room
            sampling = with_max_tokens(api_request.sampling, max(max_tokens, 1))  # echo only: one token, not sent
            prompt_text = "" if not api_request.echo else prompt if isinstance(prompt, str) else \
                self.tokenizer.decode(prompt_ids)
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            for sample_index in range(api_request.n):
                index = prompt_index * api_request.n + sample_index
                sub_id = request_id if api_request.num_sequences == 1 else f"{request_id}-{index}"
                generate_input = GenerateInput(sub_id, prompt_ids, choice_sampling(sampling, sample_index))
                writer = ChoiceWriter(index, api_request, prompt_ids, prompt_text, self.tokenizer.token_text)
                jobs.append(_Job(generate_input, writer, sample_index, len(prompt_ids)))
        return jobs

    def _check_context(self, api_request: ApiRequest, num_prompt_tokens: int) -> None:
        room = self.max_model_len - num_prompt_tokens
        wanted = api_request.max_tokens or 1
        if room < 1 or wanted > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, {wanted} for the "
                "completion).",
                param="messages" if api_request.kind == "chat" else "prompt", code="context_length_exceeded")

    async def _complete(self, api_request: ApiRequest, jobs: list[_Job], shape: ResponseShape, usage: Usage,
                        started: float) -> web.Response:
        async def collect(job: _Job) -> None:
            async for delta in _Timed(self.dispatcher.generate(job.input, job.plan), self.metrics, started, usage):
                job.writer.piece(delta)

        try:
            await self.drain.until_stopped(_all([collect(job) for job in jobs]))
        except WorkerFailed as exc:
            raise ApiError(503, str(exc), type="service_unavailable", code="worker_failed") from None
        choices = []
        for job in jobs:
            writer, message, finish_reason = job.writer, None, job.writer.finish_reason
            if api_request.kind == "chat" and api_request.uses_tools:
                content, calls, finish_reason = await self._parse_tool_calls(api_request, writer)
                message = {"role": "assistant", "content": content, "tool_calls": [call.body() for call in calls]}
            choices.append(shape.choice(writer.index, writer.text, finish_reason, writer.logprobs, message=message))
        return web.json_response(shape.full(choices, usage))

    async def _parse_tool_calls(self, api_request: ApiRequest, writer: ChoiceWriter):
        """(content, calls, finish_reason) of a finished tool-call choice (services/router/tools.py)."""
        return await asyncio.to_thread(self.tool_calls.parse, writer.text, writer.token_ids, writer.finish_reason,
                                       api_request.body, api_request.tool_choice, api_request.tools)

    async def _stream(self, request: web.Request, api_request: ApiRequest, jobs: list[_Job], shape: ResponseShape,
                      usage: Usage, started: float) -> web.StreamResponse:
        include_usage = api_request.include_usage
        streams = [_Timed(self.dispatcher.generate(job.input, job.plan), self.metrics, started, usage).__aiter__()
                   for job in jobs]
        try:  # every choice's first delta before the response starts: a refusal is still an HTTP status
            firsts = await self.drain.until_stopped(_all([stream.__anext__() for stream in streams]))
        except BaseException:
            await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)
            raise
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if api_request.kind == "chat":
            for job in jobs:
                await _send(response, shape.chunk(None, None, include_usage, first=True, index=job.writer.index))
        merged = _Merged(jobs, streams, firsts)
        tool_streams = await self._tool_streams(api_request, jobs)
        try:
            while (item := await self.drain.until_stopped(merged.next())) is not None:
                job, delta = item
                text, logprobs = job.writer.piece(delta)
                if job.writer.index in tool_streams:  # vLLM's parser makes the deltas
                    message, finish_reason = tool_streams[job.writer.index].feed(text, list(delta.token_ids),
                                                                                 delta.finish_reason)
                    if message is not None or finish_reason or logprobs is not None:
                        await _send(response, shape.chunk(None, finish_reason, include_usage, index=job.writer.index,
                                                          logprobs=logprobs, delta=message or {}))
                    continue
                if api_request.kind == "chat" and api_request.uses_tools:  # no parser: sent whole once read
                    if delta.finish_reason:
                        await _send(response, await self._tool_call_chunk(api_request, job.writer, shape,
                                                                          include_usage))
                    continue
                if text or delta.finish_reason or (logprobs is not None and delta.token_ids):
                    await _send(response, shape.chunk(text, delta.finish_reason, include_usage, index=job.writer.index,
                                                      logprobs=logprobs))
        except WorkerFailed as exc:
            await _send(response, ApiError(503, str(exc), type="service_unavailable", code="worker_failed").body())
        except RouterStopping:  # past router.drain_timeout_s: the client learns its answer is cut
            await _send(response, stopping_error().body())
        finally:
            await merged.close()
        if include_usage:
            await _send(response, shape.usage_chunk(usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


    async def _tool_streams(self, api_request: ApiRequest, jobs: list[_Job]) -> dict:
        if api_request.kind != "chat" or not api_request.uses_tools:
            return {}
        streams = {}
        for job in jobs:
            stream = await asyncio.to_thread(self.tool_calls.streaming, api_request.body,
                                             job.input.prompt_token_ids, api_request.tool_choice)
            if stream is not None:
                streams[job.writer.index] = stream
        return streams

    async def _tool_call_chunk(self, api_request: ApiRequest, writer: ChoiceWriter, shape: ResponseShape,
                               include_usage: bool) -> dict:
        content, calls, finish_reason = await self._parse_tool_calls(api_request, writer)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [call.body(index=i) for i, call in enumerate(calls)]
        return shape.chunk(None, finish_reason, include_usage, index=writer.index, logprobs=writer.logprobs,
                           delta=delta)


@dataclasses.dataclass(slots=True)
class _Job:
    """One choice's worker request, its writer, and its routing decision (``Dispatcher.plan``)."""

    input: GenerateInput
    writer: ChoiceWriter
    sample_index: int
    num_prompt_tokens: int
    plan: Plan | None = None


class _Merged:
    """The choices' delta streams as one, in arrival order; each stream's first delta is given."""

    def __init__(self, jobs: list[_Job], streams: list, firsts: list[TokenDelta]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(jobs)
        self._tasks = [asyncio.ensure_future(self._pump(job, stream, first))
                       for job, stream, first in zip(jobs, streams, firsts)]
        self._streams = streams

    async def _pump(self, job: _Job, stream, first: TokenDelta) -> None:
        delta = first
        try:
            while True:
                self._queue.put_nowait((job, delta, None))
                if delta.finish_reason:
                    break
                delta = await stream.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as exc:  # handed to the reader, which raises it
            self._queue.put_nowait((job, None, exc))
            return
        self._queue.put_nowait((job, None, None))

    async def next(self) -> tuple[_Job, TokenDelta] | None:
        """The next delta of any choice; None once every choice has ended."""
        while self._open:
            job, delta, error = await self._queue.get()
            if error is not None:
                raise error
            if delta is None:
                self._open -= 1
                continue
            return job, delta
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(stream.aclose() for stream in self._streams), return_exceptions=True)


async def _all(awaitables: list) -> list:
    """Every result, or the first error with the rest cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _request_id(request: web.Request, kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"


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
