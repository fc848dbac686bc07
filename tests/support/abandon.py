"""Requests a client abandons at a chosen moment, and the check that nothing stays held after them.

A client that goes away must free the prefill worker's work, the pending KV receive and the decode
worker's blocks at once. The three moments: while the prompt is prefilled on the PrfaaS cluster
(``prefill``: the prefill worker has the request), while its KV arrives at the decode worker
(``transfer``: the decode worker's received bytes grew), and while it decodes (``decode``: the
client has its first chunk). The client hangs up with a TCP reset, as a crashed client would.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

MOMENTS = ("prefill", "transfer", "decode")


@dataclass(frozen=True)
class Held:
    """What one worker holds, as its stats say."""

    active: int
    kv_cache_usage: float
    receiving: int
    sending: int

    @classmethod
    def of(cls, stats) -> "Held":
        return cls(stats.num_active_requests, stats.kv_cache_usage, stats.kv_transfers_receiving,
                   stats.kv_transfers_sending)

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.kv_cache_usage == 0.0 and self.receiving == 0 and self.sending == 0


def step_seconds(base_url: str, api_key: str, body: dict, timeout_s: float = 300.0) -> float:
    """Seconds the deployment takes to answer ``body`` (a completion, sent here with one token and
    unstreamed; its prompt must not be cached): about the longest engine step that a request of that
    prompt, abandoned, can leave running. An engine finishes the step it is computing before it sees
    an abort, and the prefill worker's KV send stays pending until then: a settle check allows this
    on top of its own bound, which a slower host (float32 engines, AVX2) would miss otherwise."""
    started = time.monotonic()
    response = httpx.post(base_url.rstrip("/") + "/v1/completions", json={**body, "max_tokens": 1, "stream": False},
                          headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s)
    response.raise_for_status()
    return time.monotonic() - started


def abandon(base_url: str, api_key: str, body: dict, hang_up: Callable[[bytes], bool],
            timeout_s: float = 120.0) -> bool:
    """Sends ``body`` to /v1/completions and resets the connection once ``hang_up(received so far)``
    says so (polled every 10 ms). False when the response ended first (the moment was missed)."""
    url = urlsplit(base_url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=timeout_s)
    try:
        sock.sendall(head + payload)
        sock.settimeout(0.01)
        received, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if hang_up(received):
                return True
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk or b"data: [DONE]" in received + chunk:
                return False
            received += chunk
            status = received.split(b" ", 2)[1] if received.count(b" ") >= 2 else b""
            if status and status != b"200":
                raise RuntimeError(f"the router refused the request: {received[:500]!r}")
        raise TimeoutError(f"the moment to hang up did not come in {timeout_s:.0f} s")
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        sock.close()


def moment(name: str, stats: Callable[[str], object], prefill: str, decode: str) -> Callable[[bytes], bool]:
    """The ``hang_up`` test of one moment (``stats(worker)``: that worker's GetStats answer now)."""
    if name == "prefill":
        return lambda received: stats(prefill).num_active_requests > 0
    if name == "transfer":
        before = stats(decode).kv_bytes_received
        return lambda received: stats(decode).kv_bytes_received > before
    if name == "decode":
        return lambda received: b"data: " in received
    raise ValueError(f"unknown moment {name!r}; one of {MOMENTS}")


def settled(stats: Callable[[str], object], workers: tuple[str, ...], timeout_s: float) -> tuple[bool, float, dict]:
    """Waits until every worker is idle; (all idle, seconds it took, what each held last)."""
    started = time.monotonic()
    while True:
        held = {name: Held.of(stats(name)) for name in workers}
        elapsed = time.monotonic() - started
        if all(h.idle for h in held.values()) or elapsed >= timeout_s:
            return all(h.idle for h in held.values()), elapsed, held
        time.sleep(0.05)
