"""Plain domain types that cross the worker's gRPC conversion layer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """This request's KV is streamed: ``produce`` it to ``peer``, or ``consume`` it from a producer."""

    mode: str
    transfer_id: str
    peer: str = ""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    kv_transfer: KvTransfer | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output of one engine step; ``finish_reason`` is set on the last one."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class EngineStats:
    """Engine-reported load (updated each engine step) and the worker's own count of open requests."""

    num_active_requests: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    num_finished_requests: int = 0
    kv_transport: dict | None = None  # the connector's latest ``KVTransport.snapshot()``
