"""Plain domain types that cross the worker's gRPC conversion layer."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.kv_connector.params import KvTransfer
from services.kv_connector.snapshot import ConnectorSnapshot


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output, compiled by vLLM's structured-output backend (xgrammar by default):
    ``kind`` "json" (``spec``: a JSON schema, as JSON text), "json_object" (any JSON object; ``spec``
    empty), "regex", "choice" (``spec``: a JSON list of strings), "grammar" (EBNF / Lark text) or
    "structural_tag" (vLLM's structural tag as JSON text: what its tool parsers constrain calls with)."""

    kind: str
    spec: str = ""


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # the most likely tokens to report at each generated position (MAX_TOP_LOGPROBS)
    logprobs: bool = False  # report each generated token's own log probability (with top_logprobs: those too)
    prompt_logprobs: int | None = None  # per prompt token: its log probability and this many most likely
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structured: StructuredOutput | None = None
    # The prompt's last this-many tokens were generated for this request by an earlier worker (a request
    # that moved, services/router/continuation.py): penalties, min_tokens and the grammar count them as
    # output, as an uninterrupted run would (services/worker_api/resume.py).
    num_output_prompt_tokens: int = 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


MAX_TOP_LOGPROBS = 20  # vLLM's default `max_logprobs`
# The longest a ReserveHandoff call waits for a hand-off slot (its wait_s).
MAX_RESERVE_WAIT_S = 3600.0


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    kv_transfer: KvTransfer | None = None


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One token's natural-log probability at a position, under the model's raw distribution (before
    penalties, temperature or top_p, as vLLM reports it), with the engine's text of the token."""

    token_id: int
    logprob: float
    token: str | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output of one engine step; ``finish_reason`` is set on the last one."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # per token in ``token_ids`` when asked for (``Sampling.wants_logprobs``): the position's entries in
    # vLLM's order (the sampled token first, then the most likely by rank; the sampled token once)
    top_logprobs: tuple[tuple[LogprobEntry, ...], ...] = ()
    # per prompt token, on the first delta only, when asked for (``Sampling.prompt_logprobs``); the first
    # position has none (an empty tuple)
    prompt_logprobs: tuple[tuple[LogprobEntry, ...], ...] = ()


@dataclass(slots=True)
class EngineStats:
    """Engine-reported load (updated each engine step) and the worker's own count of open requests."""

    num_active_requests: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    num_finished_requests: int = 0
    kv_connector: ConnectorSnapshot | None = None  # the connector's latest report


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Congestion telemetry of one KV link a worker sends on (sums over its TCP connections)."""

    peer: str
    connections: int = 0
    bytes_sent: int = 0
    transfers_sent: int = 0
    transfers_failed: int = 0
    goodput_bps: float = 0.0  # of the last completed transfer
    retransmits: int = 0
    rtt_ms: float = 0.0
    cwnd_segments: int = 0
    delivery_rate_bps: float = 0.0
    send_cpu_s: float = 0.0   # the sender's I/O thread's CPU time so far


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One ``GetStats`` answer as the router keeps it (converted once, where it polls)."""

    worker_name: str = ""
    service: str = ""
    role: str = ""
    model: str = ""
    max_model_len: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    num_finished_requests: int = 0
    num_active_requests: int = 0
    kv_links: tuple[LinkStats, ...] = ()
    kv_bytes_received: int = 0
    kv_frames_rejected: int = 0
    kv_connections_refused: int = 0
    kv_pool_tokens_loaded: int = 0
    kv_pool_tokens_stored: int = 0
    kv_pool_loads_failed: int = 0
    kv_pool_stores_failed: int = 0
    grpc_rejected: Mapping[str, int] = field(default_factory=dict)
    layout_spec: bytes = b""  # the rank-0 LayoutSpec as announced (services/kv_connector/layouts/spec.py)
    kv_protocol_version: int = 0  # the KV wire protocol the worker speaks; 0: not announced
    kv_transfers_receiving: int = 0  # KV transfers begun and not ended (0 at rest)
    kv_transfers_sending: int = 0
    draining: bool = False  # the run-time role state the worker holds (SetRole)
    role_generation: int = 0  # 0: an older worker that does not hold its role
    num_handoffs: int = 0  # hand-offs open at the worker now, of at most max_handoffs (0: no limit)
    max_handoffs: int = 0
    peak_handoffs: int = 0  # the most held at once since the worker started
    num_handoffs_queued: int = 0  # ReserveHandoff calls waiting for a slot, every router's


@dataclass(frozen=True, slots=True)
class PrefixUpdate:
    """A change of what a worker's engine holds in its prefix cache (``WatchPrefixCache``): full blocks by
    their chained hash (``vllm_block_hashes`` at ``block_size``); ``reset``: forget the rest first."""

    reset: bool = False
    block_size: int = 0
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
