"""The deployment configuration tree. Every field's ``help`` is its documentation."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from services.config.errors import ConfigError

_T = TypeVar("_T")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _opt(default: _T, help: str) -> _T:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.copy(default), metadata=_help(help))
    return field(default=default, metadata=_help(help))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str = _opt("smollm2-135m-instruct", "Model name clients pass as `model` in API calls.")
    path: str = _opt(
        "builtin:smollm2-135m-instruct",
        "Checkpoint directory (Hugging Face layout), or `builtin:smollm2-135m-instruct` / "
        "`builtin:tiny-qwen3-next` to prepare an embedded model on first use.",
    )
    max_model_len: int = _opt(2048, "Context window in tokens (prompt + output).")
    dtype: str = _opt("auto", "Weight and activation dtype passed to vLLM. `auto`: the checkpoint's on GPUs; on "
                      "CPUs bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX) or the model has "
                      "linear-attention layers, float32 elsewhere (emulated bfloat16 runs ~8x slower).")
    tool_parser: str | None = _opt(
        None, "vLLM tool parser that reads the model's own tool calls for `tool_choice` `auto` (vLLM's "
        "`--tool-call-parser`; e.g. `hermes` for `<tool_call>{...}</tool_call>`, `llama3_json`, `mistral`, "
        "`qwen3_xml`; `prfaas up` refuses a name this vLLM does not offer and lists those it does). Null: `auto` "
        "returns the text as content. Named and `required` tool choices work either way.")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    enforce_eager: bool = _opt(True, "Skip torch.compile and CUDA graphs (fast start; slower steps on GPU).")
    cpu_kvcache_space_gib: int = _opt(1, "KV cache size in GiB on CPU hosts (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory vLLM may use on GPU hosts.")
    tensor_parallel_size: int = _opt(1, "GPUs one engine shards the model across (vLLM tensor parallelism); "
                                     "give each worker pod as many `nvidia.com/gpu`.")
    max_num_seqs: int = _opt(64, "Most requests one engine runs at once.")
    max_num_batched_tokens: int | None = _opt(None, "Tokens per engine step (chunked-prefill budget); vLLM's "
                                              "default when null.")
    enable_prefix_caching: bool = _opt(True, "Reuse KV of shared prompt prefixes inside one engine.")
    block_size: int | None = _opt(None, "Tokens per KV-cache block (vLLM's `block_size`); null: vLLM's default "
                                  "(128 on CPU hosts). A prefill worker and a decode worker may use different "
                                  "sizes and KV cache layouts: the decode worker re-blocks and converts what it "
                                  "receives. Layouts mapped: vLLM's CPU kernels `vec` and `vec16` "
                                  "(`cpu-k-transposed`), `amx` (`cpu-amx`: bfloat16 on Intel hosts with AMX, "
                                  "blocks a multiple of 32 tokens), and GPU backends' strided views "
                                  "(`kv-token-rows`); between `cpu-amx` and another layout, the two block sizes "
                                  "must share a multiple of 16 tokens. Other kernels (`cpu-neon`, ...), MLA and "
                                  "split kernel blocks: the router refuses the pair, naming both layouts, and "
                                  "prefills its prompts elsewhere (docs/gpu.md, docs/deployment.md).")
    enable_chunked_prefill: bool = _opt(True, "Split a prompt across engine steps when the step's token budget "
                                        "is short (vLLM's chunked prefill). Off: each prompt is prefilled "
                                        "in one step, so `max_num_batched_tokens` must be at least "
                                        "`model.max_model_len`.")
    seed: int = _opt(0, "Engine random seed (sampling without a per-request seed).")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    name: str = field(metadata=_help("Unique worker name, used in logs, metrics and `prfaas <service> --name`."))
    service: Literal["prefill_worker", "decode_worker"] = _opt(
        "decode_worker",
        "`prefill_worker`: a PrfaaS-cluster prefill worker; `decode_worker`: a local PD-cluster worker.",
    )
    role: Literal["prefill", "decode", "both"] = _opt(
        "both", "For decode workers: `prefill` (PD-P), `decode` (PD-D) or `both`."
    )
    cluster: Literal["prfaas", "local"] = _opt("local", "Which cluster the worker belongs to.")
    host: str = _opt("127.0.0.1", "Address the worker's gRPC server binds and the router dials.")
    port: int = field(metadata=_help("gRPC port of the worker."))
    kv_port: int | None = _opt(
        None, "KV data-plane port (TCP) where the worker receives streamed KV; needed on workers that "
        "decode requests prefilled elsewhere (the PrfaaS and PD-P paths). An engine of several TP ranks "
        "uses the ports after it too: rank r receives at `kv_port + r`.")
    health_port: int | None = _opt(
        None, "Plaintext port serving only `grpc.health.v1`, for probes that cannot do TLS (Kubernetes gRPC "
        "probes); it tells whether the worker is SERVING and nothing else. Null: health on `port` only.")
    engine: dict[str, object] = _opt({}, "Per-worker overrides of the top-level `engine` keys.")
    dtype: str | None = _opt(None, "Overrides `model.dtype` for this worker's engine. A prefill worker and a decode "
                             "worker whose KV dtypes differ exchange no KV: the router refuses the pair (see "
                             "`/health` `layouts`) and prefills its prompts elsewhere. Null: `model.dtype`.")
    env: dict[object, object] = _opt({}, "Environment variables set in the worker process before its engine "
                                     "starts (e.g. `VLLM_CPU_OMP_THREADS_BIND` to give colocated CPU engines their "
                                     "own cores: a CPU list there, all TP ranks' lists together, also keeps the "
                                     "worker's other processes on those CPUs; `VLLM_ENABLE_V1_MULTIPROCESSING: "
                                     "\"1\"` gives a TP-1 CPU engine's model a process of its own, as vLLM's CPU "
                                     "backend does, instead of vLLM's engine-core process).")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = _opt("127.0.0.1", "Address the OpenAI-compatible HTTP endpoint binds.")
    port: int = _opt(8000, "HTTP port of the endpoint (`/v1/*`, `/health`, `/metrics`).")
    api_keys: tuple[str, ...] = _opt((), "Accepted bearer tokens; empty (and no env keys) means no authentication.")
    api_keys_env: str = _opt("PRFAAS_API_KEYS", "Environment variable with more accepted keys, comma-separated.")
    connect_timeout_s: float = _opt(5.0, "Deadline for reaching a worker before trying another.")
    first_token_timeout_s: float = _opt(300.0, "Deadline for a worker's first token.")
    request_timeout_s: float = _opt(1800.0, "Deadline for a whole request on a worker.")
    stats_interval_s: float = _opt(
        1.0, "How often the router polls worker stats and health. Between these polls, a worker that is down "
        "and carries no request is re-checked every `scheduler.worker_backoff_s` (at least 0.25 s).")
    max_attempts: int = _opt(3, "Workers tried per request when they fail before the first token.")
    max_migrations: int = _opt(
        2, "Times one request may move to another worker after its first token, when its decode worker fails "
        "mid-stream (connection lost, or two polls in a row unanswered): the router sends the prompt and the "
        "tokens generated so far to another worker and the client's stream goes on. 0: such a request ends "
        "with an error.")
    max_handoffs_per_prefill_worker: int = _opt(
        8, "Hand-offs (a prompt prefilled on one worker, its KV streamed to a decode worker) one prefill worker is "
        "given at once, counted until the decode worker's first token. More wait at the router: a decode worker "
        "reserves KV cache for a hand-off as soon as it is given the request, so a backlog at a slow prefill "
        "worker would otherwise fill decode workers' caches with space for KV still far off and stall their "
        "local requests. A waiting request is prefilled locally if its prefill worker stops answering health "
        "checks. 0: no limit.")
    drain_timeout_s: float = _opt(
        30.0, "On SIGTERM or SIGINT (as `prfaas up` stops it) the router answers new requests 503 with "
        "`Retry-After` and gives the requests in flight this long to finish; a stream still going then ends with "
        "an OpenAI-shaped error event before `[DONE]`, and a non-streamed request gets a 503 with an error body.")
    role_decisions: Literal["replica-0", "kubernetes-lease"] = _opt(
        "replica-0", "Which of several routers in front of the same workers makes role-flip decisions "
        "(`scheduler.role_flips`); the others follow the workers' reported roles. `replica-0`: the router "
        "started with `--replica 0` (the default; `prfaas up --routers N` numbers its routers 0..N-1). "
        "`kubernetes-lease`: whichever router pod holds the coordination.k8s.io Lease `lease_name` in its "
        "namespace (RBAC: deploy/kubernetes/base/local-cluster/router.yaml).")
    lease_name: str = _opt("prfaas-router-roles", "The Lease that `role_decisions: kubernetes-lease` holds.")
    lease_duration_s: float = _opt(
        15.0, "With `kubernetes-lease`: a Lease not renewed for this long may be taken by another router; the "
        "holder renews it every third of it and stops deciding once a renewal is this old.")
    max_sequences_per_request: int = _opt(
        16, "Most sequences one API request may ask for: a completion's prompts times `n` (each is one worker "
        "request, admitted on its own); more is answered 400 naming `n`.")
    max_structured_output_bytes: int = _opt(
        64 << 10, "Largest structured-output spec (a `response_format` JSON schema, or `structured_outputs` regex, "
        "choice list or grammar) a request may carry; larger is answered 400.")
    max_body_bytes: int | None = _opt(
        None, "Largest HTTP request body; larger ones are answered 413 before they are read or parsed. Null: "
        "32 bytes per token of `model.max_model_len` plus 1 MiB (room for the longest prompt as JSON text or "
        "token ids, and the message structure around it).")

    def body_limit(self, max_model_len: int) -> int:
        return self.max_body_bytes if self.max_body_bytes is not None else 32 * max_model_len + (1 << 20)

    @property
    def accepted_api_keys(self) -> frozenset[str]:
        """``api_keys`` and those in ``api_keys_env``."""
        import os

        from_env = os.environ.get(self.api_keys_env, "")
        return frozenset(k.strip() for k in (*self.api_keys, *from_env.split(",")) if k.strip())


@dataclass(frozen=True, slots=True, kw_only=True)
class QosClassConfig:
    name: str = field(metadata=_help("Class name, as clients send it in the `X-PrfaaS-QoS` header."))
    priority: int = _opt(0, "Higher is more important: lower-priority classes are rejected first as load grows.")
    reserved_fraction: float = _opt(
        0.0, "Fraction of the admission capacity kept for this class and higher ones (0..1); lower classes "
        "cannot use it.")
    ttft_slo_ms: float = _opt(0.0, "Time-to-first-token SLO; a request whose predicted TTFT exceeds it is "
                              "rejected with 429. 0: no TTFT check.")
    api_keys: tuple[str, ...] = _opt((), "API keys mapped to this class: their requests get it by default and "
                                     "may not ask for a higher-priority class by header.")


@dataclass(frozen=True, slots=True)
class RoleFlipsConfig:
    enabled: bool = _opt(
        False, "Flip local PD workers between `prefill` (PD-P) and `decode` (PD-D) when one stage binds. Only "
        "`decode_worker`s of the `local` cluster with role `prefill` or `decode` and a `kv_port` flip; the "
        "router drains a worker (no new work in its old role) before it takes the other role.")
    min_dwell_s: float = _opt(300.0, "Least time between two flips.")
    sustain_s: float = _opt(60.0, "How long one stage must bind before a flip starts.")
    max_drain_s: float = _opt(120.0, "A drain that has not finished after this long is cancelled (the worker "
                              "keeps its role).")
    prefill_queue_high: float = _opt(4.0, "Waiting requests per PD-P worker (in its engine, in its hand-off queue "
                                     "from every router, and at the deciding router for a hand-off slot) at or above "
                                     "which prefill binds (when decode utilization is low).")
    prefill_queue_low: float = _opt(1.0, "Waiting requests per PD-P worker (counted as for prefill_queue_high) at "
                                    "or below which prefill keeps up.")
    decode_utilization_high: float = _opt(
        0.85, "Mean PD-D utilization (max of running / `max_num_seqs` and KV usage) at or above which decode "
        "binds (when prefill keeps up).")
    decode_utilization_low: float = _opt(0.5, "Mean PD-D utilization at or below which decode has room.")
    min_workers_per_role: int = _opt(1, "Workers each role keeps at least.")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    offload_threshold_tokens: int = _opt(
        1024, "Prompts whose uncached part is longer than this prefill on the PrfaaS cluster."
    )
    admission_control: bool = _opt(
        False, "Reject requests early (429 with `Retry-After`) when the predicted TTFT exceeds their class's "
        "SLO or the router is at capacity, and 503 when no worker can serve; turns on QoS classes.")
    max_in_flight_requests: int = _opt(
        0, "Admission capacity: requests the router runs at once. 0: `engine.max_num_seqs` per healthy "
        "generating worker.")
    prefill_tokens_per_s: dict[str, float] = _opt(
        {}, "Prefill rate per path (`local`, `pd`, `prfaas`) in tokens/s for TTFT prediction until the router "
        "has measured it from finished prefills; paths without a rate or measurement skip the TTFT check.")
    retry_after_s: int = _opt(1, "`Retry-After` seconds of capacity and 503 rejections (TTFT rejections "
                              "use the predicted excess, at least this).")
    qos_classes: tuple[QosClassConfig, ...] = _opt(
        (), "QoS classes for admission control; empty: one class `default` without a TTFT SLO.")
    default_qos_class: str = _opt("default", "Class of requests without an `X-PrfaaS-QoS` header or mapped key.")
    adaptive_threshold: bool = _opt(
        False, "Adjust the offload threshold every stats interval from the PrfaaS prefill workers' KV link "
        "telemetry, and stop offloading while no PrfaaS prefill worker is healthy with a working link.")
    link_capacity_gbps: float = _opt(10.0, "Capacity of the link from the PrfaaS cluster, Gbit/s (egress "
                                     "utilization = measured egress rate / this).")
    max_offload_threshold_tokens: int | None = _opt(
        None, "Highest threshold the adaptive controller may set; null: `model.max_model_len`.")
    threshold_raise_utilization: float = _opt(0.85, "Egress utilization above which the threshold is raised.")
    threshold_lower_utilization: float = _opt(
        0.6, "Egress utilization below which (without congestion) the threshold is lowered toward the base.")
    threshold_step: float = _opt(1.5, "Factor by which one adjustment raises (or lowers) the threshold.")
    threshold_hold_s: float = _opt(5.0, "Least time between two threshold changes, and before offloading "
                                   "resumes after a link failure.")
    congestion_retransmit_ratio: float = _opt(
        0.01, "Retransmitted share of sent segments in one stats interval that counts as congestion.")
    congestion_rtt_increase_ms: float = _opt(
        20.0, "RTT rise over the lowest RTT seen on a link that counts as congestion.")
    congestion_queue_depth: int = _opt(
        8, "Waiting requests per healthy PrfaaS prefill worker that count as congestion (those queued on the "
        "worker and those the router holds back for a hand-off slot, `router.max_handoffs_per_prefill_worker`).")
    reoptimize_interval_s: float = _opt(
        300.0, "With `adaptive_threshold`: every this many seconds, re-derive the threshold's base (the floor it "
        "returns to) and ceiling (the most it may be raised) from the planner's model with profiles measured "
        "online: recent prompt lengths and arrival rate, KV bytes per token sent by the PrfaaS prefill workers, "
        "the local prefill rate; skipped while there is too little data. 0: never.")
    cache_block_size: int = _opt(
        128, "Tokens per KV block in the cache pools' block hashes; must match the engines' block size (vLLM's "
        "CPU build defaults to 128, its CUDA build to 16; hybrid models use larger blocks). Used "
        "when `cache_pools` are configured: the router then hashes each prompt, asks every cluster's pool for "
        "its cached prefix and offloads on the uncached (incremental) length.")
    cache_model_key: str | None = _opt(None, "Model key of cache-pool entries (names the model); the engines "
                                       "add their KV layout's fingerprint to it. null: `model.name`.")
    cache_kv_groups: tuple[Literal["full", "linear"], ...] = _opt(
        ("full",), "KV cache groups of the model in group-id order (`full` attention or `linear` attention "
        "state) for cache-pool lookups; a hybrid model such as tiny-qwen3-next lists its linear groups too.")
    cache_lookup_timeout_ms: float = _opt(50.0, "Deadline of one cache-pool lookup; a slow or failed pool "
                                          "counts as nothing cached.")
    kv_high_watermark: float = _opt(
        0.9, "Decode workers at or above this KV usage (0..1) get new requests only when no other worker can.")
    worker_backoff_s: float = _opt(
        1.0, "Back-off after a worker failed a call: it is skipped this long, doubled per further failure "
        "(health checks alone do not end it); a successful request resets it.")
    max_worker_backoff_s: float = _opt(30.0, "Longest back-off of a failing worker.")
    decode_load_admission: bool = _opt(
        False, "With `admission_control`: also reject (429, reason `decode_load`) when no decode worker could "
        "hold the request at its completion: running requests within `engine.max_num_seqs` and predicted KV "
        "usage (committed prompt + max_tokens of its requests, plus this one's) within `decode_kv_limit`.")
    decode_kv_capacity_tokens: int = _opt(
        0, "KV capacity of one decode worker in tokens, for the predicted KV usage; 0: unknown, judge on "
        "running requests only.")
    decode_kv_limit: float = _opt(0.95, "Highest predicted KV usage (0..1) at a request's completion.")
    role_flips: RoleFlipsConfig = _opt(RoleFlipsConfig(), "Long-timescale flips of local PD worker roles.")


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePoolConfig:
    name: str = field(metadata=_help(
        "Unique cache pool name, used in logs, metrics and `prfaas cache-pool --name`."))
    cluster: Literal["prfaas", "local"] = _opt("local", "Which cluster the pool serves (at most one pool per cluster).")
    host: str = _opt("127.0.0.1", "Address the pool's gRPC server binds and clients dial.")
    port: int = field(metadata=_help("gRPC port of the pool (CachePool service in proto/prfaas/v1/cache_pool.proto, "
                                     "grpc.health.v1)."))
    metrics_port: int | None = _opt(None, "HTTP port of the pool's Prometheus `/metrics`; none when null.")
    health_port: int | None = _opt(
        None, "Plaintext port serving only `grpc.health.v1`, for probes that cannot do TLS (Kubernetes gRPC "
        "probes). Null: health on `port` only.")
    memory_budget_gib: float = _opt(
        4.0, "Host memory for block data in GiB, counted exactly; the process' own overhead comes on top.")
    ssd_dir: str | None = _opt(None, "Directory of the SSD tier (its block files are removed at start); no SSD "
                               "tier when null.")
    ssd_budget_gib: float = _opt(16.0, "Size the SSD tier's files may take in GiB.")
    kv_port: int | None = _opt(
        None, "Port of the pool's KV transport listener (on `host`, with the deployment's `transport` settings "
        "and secret): cross-cluster cache copies move block bytes pool to pool over it instead of through the "
        "router. Copies use it when both pools have one. Null: no listener.")
    shared_memory_dir: str | None = _opt(
        "/dev/shm", "A tmpfs directory for the pool's shared-memory arena: one file of `memory_budget_gib`, "
        "allocated and resident from the pool's start, that workers on the pool's host map once and copy block "
        "bytes into and out of (once each) instead of sending them inside gRPC messages. Clients elsewhere, or "
        "that cannot open the arena, send bytes inline; so does every client when the tmpfs has no room for the "
        "arena (give containers a /dev/shm larger than the budget). Null: no arena, always inline.")
    arena_slot_kib: int | None = _opt(
        None, "Size of one arena slot in KiB (rounded up to a multiple of 4). Null: the largest block of the "
        "first Put, at least 64 KiB, so that each of an engine's full-attention blocks fills one slot; a block of "
        "another size takes as many slots as it needs.")
    lease_timeout_s: float = _opt(
        30.0, "Seconds a client has between reserving arena slots for a Put and committing it; the slots of a Put "
        "never committed (its client died) are freed after this.")

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.memory_budget_gib * 2**30)

    @property
    def ssd_budget_bytes(self) -> int:
        return int(self.ssd_budget_gib * 2**30)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    token: str = _opt("", "Shared bearer token every gRPC caller sends (router -> workers, workers -> cache pools, "
                      "router -> pools) and every gRPC server checks; empty: read it from `token_env`. "
                      "`prfaas up` generates one when neither is set.")
    token_env: str = _opt("PRFAAS_GRPC_TOKEN", "Environment variable with the gRPC bearer token.")
    previous_tokens: tuple[str, ...] = _opt(
        (), "Tokens servers still accept while a new `token` is rolled out (callers send only `token`); remove "
        "them once every caller runs with the new one.")
    previous_tokens_env: str = _opt("PRFAAS_GRPC_PREVIOUS_TOKENS",
                                    "Environment variable with more previous tokens, comma-separated.")
    insecure: bool = _opt(
        False, "Lab opt-out: allow non-loopback listeners without credentials (no gRPC token or TLS, no KV "
        "secret or TLS, no router API keys). Every service logs a warning at start while it is set.")
    grpc_max_message_bytes: int = _opt(64 << 20, "Largest gRPC message any service sends or accepts.")
    grpc_max_concurrent_streams: int = _opt(256, "Most concurrent gRPC calls one client connection may open.")

    @property
    def token_value(self) -> str:
        import os

        return self.token or os.environ.get(self.token_env, "")

    @property
    def accepted_tokens(self) -> tuple[str, ...]:
        import os

        extra = [t.strip() for t in os.environ.get(self.previous_tokens_env, "").split(",") if t.strip()]
        return tuple(t for t in (self.token_value, *self.previous_tokens, *extra) if t)


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    restart: Literal["on-failure", "always", "never"] = _opt(
        "on-failure", "What `prfaas up` does when a service exits without being asked to: `on-failure` restarts "
        "it after a non-zero exit status or a signal (a clean exit, status 0, stops the deployment), `always` "
        "restarts it after any exit, `never` stops the deployment. The other services keep serving meanwhile. "
        "Only `prfaas up` reads this section (under Kubernetes the pod's `restartPolicy` does this).")
    restart_backoff_s: float = _opt(1.0, "Wait before the first restart of a service; it doubles with each "
                                    "further restart within `crash_loop_window_s`.")
    max_restart_backoff_s: float = _opt(30.0, "Longest wait before a restart.")
    crash_loop_restarts: int = _opt(
        5, "A service that exits again after this many restarts within `crash_loop_window_s` is in a crash "
        "loop: `prfaas up` stops the deployment and prints that service's last log lines.")
    crash_loop_window_s: float = _opt(60.0, "The window, in seconds, that `crash_loop_restarts` counts in.")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = _opt("info", "Log level of every service.")
    json: bool = _opt(False, "One JSON object per log line instead of plain text.")
    dir: str = _opt("logs", "Directory of per-service log files written by `prfaas up`.")


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    model: ModelConfig = _opt(ModelConfig(), "The served model.")
    engine: EngineConfig = _opt(EngineConfig(), "vLLM engine settings shared by all workers.")
    router: RouterConfig = _opt(RouterConfig(), "The OpenAI-compatible router.")
    workers: tuple[WorkerConfig, ...] = _opt((), "The prefill and decode workers.")
    cache_pools: tuple[CachePoolConfig, ...] = _opt(
        (), "Hybrid prefix cache pools (`prfaas cache-pool`), at most one per cluster.")
    scheduler: SchedulerConfig = _opt(SchedulerConfig(), "Where each request's prefill runs.")
    supervisor: SupervisorConfig = _opt(SupervisorConfig(), "How `prfaas up` restarts a service that exits.")
    logging: LoggingConfig = _opt(LoggingConfig(), "Logging of every service.")
    security: SecurityConfig = _opt(
        SecurityConfig(), "Who may call each port: the gRPC bearer token (mutual TLS with `transport.tls_*`, "
        "which secure gRPC and the KV data plane alike), and the lab-only `insecure` opt-out. See "
        "docs/deployment.md, \"Threat model\".")
    transport: dict[str, object] = _opt({}, "KV data-plane transport: `connections_per_peer` (8), `io_threads` "
                                        "(1), `secret` or `secret_env` (PRFAAS_KV_SECRET), `tls_cert`/`tls_key`/"
                                        "`tls_ca`, `frame_bytes` (0: each receiver announces its device's), "
                                        "`max_frame_bytes`, `max_inflight_bytes`, `max_staging_bytes`, timeouts; see "
                                        "services/kv_transport/settings.py.")

    def worker(self, name: str) -> WorkerConfig:
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise ConfigError(f"no worker named {name!r} (configured: {', '.join(w.name for w in self.workers)})")

    def cache_pool(self, name: str) -> CachePoolConfig:
        for pool in self.cache_pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"no cache pool named {name!r} (configured: "
                          f"{', '.join(p.name for p in self.cache_pools) or 'none'})")

    def model_for(self, worker: WorkerConfig) -> ModelConfig:
        from dataclasses import replace

        return self.model if worker.dtype is None else replace(self.model, dtype=worker.dtype)

    def engine_for(self, worker: WorkerConfig) -> EngineConfig:
        from dataclasses import replace

        overrides: dict[str, Any] = dict(worker.engine)  # keys checked on load, values as the YAML gave them
        return replace(self.engine, **overrides)
