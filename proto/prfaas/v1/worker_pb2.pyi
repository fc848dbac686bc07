from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "top_logprobs", "logprobs", "prompt_logprobs", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "structured_output", "num_output_prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_logprobs: int
    logprobs: bool
    prompt_logprobs: int
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    num_output_prompt_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., num_output_prompt_tokens: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_source: KvSource
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "top_logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "kv_target", "transfer_id", "kv_target_tp_size", "handoff_reservation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_RESERVATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_target: str
    transfer_id: str
    kv_target_tp_size: int
    handoff_reservation: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., kv_target: _Optional[str] = ..., transfer_id: _Optional[str] = ..., kv_target_tp_size: _Optional[int] = ..., handoff_reservation: _Optional[str] = ...) -> None: ...

class ReserveHandoffRequest(_message.Message):
    __slots__ = ("request_id", "wait_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_s: float
    def __init__(self, request_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class HandoffReservation(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_cached_tokens", "prefill_seconds")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_seconds: float
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("expected_generation", "role", "draining")
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    expected_generation: int
    role: str
    draining: bool
    def __init__(self, expected_generation: _Optional[int] = ..., role: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class RoleState(_message.Message):
    __slots__ = ("role", "draining", "generation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    role: str
    draining: bool
    generation: int
    def __init__(self, role: _Optional[str] = ..., draining: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class WatchPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefixCacheUpdate(_message.Message):
    __slots__ = ("reset", "block_size", "stored", "removed")
    RESET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    block_size: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reset: _Optional[bool] = ..., block_size: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_name", "service", "role", "model", "max_model_len", "num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_finished_requests", "num_active_requests", "kv_links", "kv_bytes_received", "kv_frames_rejected", "kv_connections_refused", "kv_pool_tokens_loaded", "kv_pool_tokens_stored", "kv_pool_loads_failed", "kv_pool_stores_failed", "grpc_rejected", "layout_spec", "kv_protocol_version", "kv_transfers_receiving", "kv_transfers_sending", "draining", "role_generation", "num_handoffs", "max_handoffs", "peak_handoffs", "num_handoffs_queued")
    class GrpcRejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_LINKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOADS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_STORES_FAILED_FIELD_NUMBER: _ClassVar[int]
    GRPC_REJECTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SPEC_FIELD_NUMBER: _ClassVar[int]
    KV_PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_RECEIVING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_SENDING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROLE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    MAX_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    PEAK_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    service: str
    role: str
    model: str
    max_model_len: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_finished_requests: int
    num_active_requests: int
    kv_links: _containers.RepeatedCompositeFieldContainer[KvLinkStats]
    kv_bytes_received: int
    kv_frames_rejected: int
    kv_connections_refused: int
    kv_pool_tokens_loaded: int
    kv_pool_tokens_stored: int
    kv_pool_loads_failed: int
    kv_pool_stores_failed: int
    grpc_rejected: _containers.ScalarMap[str, int]
    layout_spec: bytes
    kv_protocol_version: int
    kv_transfers_receiving: int
    kv_transfers_sending: int
    draining: bool
    role_generation: int
    num_handoffs: int
    max_handoffs: int
    peak_handoffs: int
    num_handoffs_queued: int
    def __init__(self, worker_name: _Optional[str] = ..., service: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_finished_requests: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., kv_links: _Optional[_Iterable[_Union[KvLinkStats, _Mapping]]] = ..., kv_bytes_received: _Optional[int] = ..., kv_frames_rejected: _Optional[int] = ..., kv_connections_refused: _Optional[int] = ..., kv_pool_tokens_loaded: _Optional[int] = ..., kv_pool_tokens_stored: _Optional[int] = ..., kv_pool_loads_failed: _Optional[int] = ..., kv_pool_stores_failed: _Optional[int] = ..., grpc_rejected: _Optional[_Mapping[str, int]] = ..., layout_spec: _Optional[bytes] = ..., kv_protocol_version: _Optional[int] = ..., kv_transfers_receiving: _Optional[int] = ..., kv_transfers_sending: _Optional[int] = ..., draining: _Optional[bool] = ..., role_generation: _Optional[int] = ..., num_handoffs: _Optional[int] = ..., max_handoffs: _Optional[int] = ..., peak_handoffs: _Optional[int] = ..., num_handoffs_queued: _Optional[int] = ...) -> None: ...

class KvLinkStats(_message.Message):
    __slots__ = ("peer", "connections", "bytes_sent", "transfers_sent", "transfers_failed", "goodput_bps", "retransmits", "rtt_ms", "cwnd_segments", "delivery_rate_bps", "send_cpu_seconds")
    PEER_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_BPS_FIELD_NUMBER: _ClassVar[int]
    RETRANSMITS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    CWND_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_RATE_BPS_FIELD_NUMBER: _ClassVar[int]
    SEND_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    connections: int
    bytes_sent: int
    transfers_sent: int
    transfers_failed: int
    goodput_bps: float
    retransmits: int
    rtt_ms: float
    cwnd_segments: int
    delivery_rate_bps: float
    send_cpu_seconds: float
    def __init__(self, peer: _Optional[str] = ..., connections: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., transfers_sent: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., goodput_bps: _Optional[float] = ..., retransmits: _Optional[int] = ..., rtt_ms: _Optional[float] = ..., cwnd_segments: _Optional[int] = ..., delivery_rate_bps: _Optional[float] = ..., send_cpu_seconds: _Optional[float] = ...) -> None: ...
