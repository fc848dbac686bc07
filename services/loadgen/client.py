"""A small streaming OpenAI client on aiohttp that times every chunk it receives."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

REJECTED_STATUSES = (429, 503)
CONNECTION_ERROR = "connection"
TIMEOUT_ERROR = "timeout"
STREAM_ERROR = "stream"


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked at all (unreachable, unknown model, refused the listing)."""


@dataclass(slots=True)
class RequestOutcome:
    """What one request measured. Times are `time.perf_counter()` seconds; latencies in seconds."""

    index: int
    input_len: int
    output_len_wanted: int
    start: float = 0.0
    ok: bool = False
    status: int | str | None = None
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    num_chunks: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    text: str = ""

    @property
    def rejected(self) -> bool:
        return self.status in REJECTED_STATUSES

    @property
    def output_len(self) -> int:
        """Output tokens: the server's usage when it sent one, else the number of streamed chunks with text."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.num_chunks

    @property
    def usage_mismatch(self) -> bool:
        return self.usage_completion_tokens is not None and self.usage_completion_tokens != self.num_chunks


class OpenAIClient:
    """One aiohttp session to `root_url`; `/v1/...` paths are appended to it."""

    def __init__(self, root_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 0) -> None:
        self.root_url = root_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(10.0, timeout_s))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAIClient":
        connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout,
                                              read_bufsize=1 << 20)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._session.close()

    async def list_models(self) -> list[str]:
        url = f"{self.root_url}/v1/models"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
                if response.status != 200:
                    detail = _error_message(await response.text())
                    raise EndpointError(f"GET {url} answered {response.status}: {detail}")
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EndpointError(f"cannot reach {url}: {_describe(exc)}") from None
        except json.JSONDecodeError:
            raise EndpointError(f"GET {url} did not answer JSON; is this an OpenAI-compatible server?") from None
        return [str(card.get("id")) for card in body.get("data", []) if isinstance(card, dict)]

    async def get_text(self, path: str) -> str | None:
        """The body of GET root+path, or None when it is not there."""
        try:
            async with self._session.get(self.root_url + path, timeout=aiohttp.ClientTimeout(total=10)) as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def stream(self, path: str, payload: dict, outcome: RequestOutcome) -> RequestOutcome:
        """POST a streaming request and fill `outcome`; errors are recorded in it, never raised."""
        outcome.start = time.perf_counter()
        try:
            async with self._session.post(self.root_url + path, json=payload) as response:
                outcome.status = response.status
                if response.status != 200:
                    outcome.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                    return outcome
                await _read_events(response, outcome)
        except asyncio.TimeoutError:
            outcome.status, outcome.error = TIMEOUT_ERROR, "timed out"
        except (aiohttp.ClientError, OSError) as exc:
            outcome.status, outcome.error = CONNECTION_ERROR, _describe(exc)
        finally:
            outcome.e2el = time.perf_counter() - outcome.start
        return outcome


async def _read_events(response: aiohttp.ClientResponse, outcome: RequestOutcome) -> None:
    pieces: list[str] = []
    try:
        done = await _read_chunks(response, outcome, pieces)
    finally:
        outcome.text = "".join(pieces)
    if outcome.error:
        return
    if not done:
        outcome.status, outcome.error = STREAM_ERROR, "the stream ended before [DONE]"
        return
    outcome.ok = outcome.num_chunks > 0 or outcome.usage_completion_tokens == 0
    if not outcome.ok:
        outcome.status, outcome.error = STREAM_ERROR, "the stream carried no tokens"


async def _read_chunks(response: aiohttp.ClientResponse, outcome: RequestOutcome, pieces: list[str]) -> bool:
    """Time each chunk with text into `outcome`; True when the stream ended with [DONE]."""
    last = outcome.start
    async for line in _sse_data(response):
        if line == "[DONE]":
            return True
        try:
            chunk = json.loads(line)
        except json.JSONDecodeError:
            outcome.status, outcome.error = STREAM_ERROR, f"bad stream chunk: {line[:200]}"
            return False
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            outcome.status, outcome.error = STREAM_ERROR, f"error in stream: {error.get('message', error)}"
            return False
        if chunk.get("usage"):
            outcome.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
            outcome.usage_completion_tokens = chunk["usage"].get("completion_tokens")
        text = _chunk_text(chunk)
        if text:
            now = time.perf_counter()
            if outcome.num_chunks == 0:
                outcome.ttft = now - outcome.start
            else:
                outcome.itl.append(now - last)
            last = now
            outcome.num_chunks += 1
            pieces.append(text)
    return False


async def _sse_data(response: aiohttp.ClientResponse):
    buffer = b""
    async for data in response.content.iter_any():
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (json.JSONDecodeError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror or str(exc.os_error)
        return f"cannot connect to {exc.host}:{exc.port} ({reason}); is the server running?"
    return str(exc) or type(exc).__name__
