"""From the deployment config to vLLM's engine arguments."""
from __future__ import annotations

import json
import os
from pathlib import Path

from services.config import DeploymentConfig, EngineConfig, ModelConfig, WorkerConfig

BUILTIN_PREFIX = "builtin:"
# Set to 1 in a PrfaaS worker's `env`: its coded sends carry one scale per frame instead of one per
# (block, head, K or V), as an FP8 cache with one static scale per tensor would. Only to measure the
# codec against that anchor (bench/wire_codec_quality.py); docs/wire-codecs.md.
SCALE_PER_TENSOR_ENV = "PRFAAS_CODEC_SCALE_PER_TENSOR"


def resolve_model_path(model: ModelConfig) -> Path:
    """The checkpoint directory; embedded models are prepared on first use."""
    if not model.path.startswith(BUILTIN_PREFIX):
        path = Path(model.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.path: {path} is not a directory")
        return path
    name = model.path.removeprefix(BUILTIN_PREFIX)
    from services.models import registry

    return registry.prepare(name)


def kv_transfer_config(config: DeploymentConfig, worker: WorkerConfig, stats_dir: Path | None = None):
    """Every worker loads the PrfaaS connector: it can produce KV (prefill roles) and, with a
    ``kv_port``, receive it. A failed receive makes vLLM recompute the prompt locally. With a cache
    pool for the worker's cluster, the connector also loads cached prefixes from it and stores
    what the engine prefills. ``stats_dir``: where its ranks write their telemetry (the worker's
    private directory)."""
    from vllm.config import KVTransferConfig

    from services.kv_connector.settings import ConnectorSettings

    settings = ConnectorSettings(listen_host=worker.host, listen_port=worker.kv_port,
                                 transport=config.transport, security=_plain(config.security),
                                 logging={"service": worker.name, "level": config.logging.level,
                                          "json_lines": config.logging.json},
                                 stats_dir=str(stats_dir) if stats_dir is not None else None,
                                 code_sends=worker.cluster == "prfaas", codec_scale_per_tensor=codec_scale_per_tensor(),
                                 **cache_pool_settings(config, worker))
    return KVTransferConfig(
        kv_connector="PrfaasConnector",
        kv_connector_module_path="services.kv_connector.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=settings.to_extra_config(),
    )


def codec_scale_per_tensor() -> bool:
    """Whether ``SCALE_PER_TENSOR_ENV`` asks for the per-tensor anchor; ValueError when it is not 0 or 1."""
    value = os.environ.get(SCALE_PER_TENSOR_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SCALE_PER_TENSOR_ENV}: {value!r} is not 0 or 1")
    return value == "1"


def _plain(section) -> dict:
    """A config section as YAML would give it (lists, not tuples), for vLLM's extra config."""
    import dataclasses

    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(section).items()}


def cache_pool_settings(config: DeploymentConfig, worker: WorkerConfig) -> dict:
    """The connector's pool settings: the ``cache_pools`` entry of the worker's cluster, if any."""
    pool = next((p for p in config.cache_pools if p.cluster == worker.cluster), None)
    if pool is None:
        return {}
    return {"cache_pool_address": f"{pool.host}:{pool.port}",
            "cache_pool_model": config.scheduler.cache_model_key or config.model.name}


def resolve_dtype(dtype: str, model_path: str | Path) -> str:
    """The dtype an engine runs. ``auto`` on a CPU-only host: float32 where the CPU has no native
    bfloat16 arithmetic, for models of attention layers only; bfloat16 otherwise (vLLM's CPU kernels
    for linear-attention layers fail in float32). Measured on an AVX2-only EPYC, one thread, a
    128x576 by 576x1536 matmul: 9.9 GFLOP/s in bfloat16, 84 in float32. On GPU hosts vLLM's ``auto``
    stands."""
    if dtype != "auto" or _has_gpu():
        return dtype
    if _cpu_flags() & {"avx512_bf16", "amx_bf16"} or _has_linear_attention(Path(model_path)):
        return "bfloat16"
    return "float32"


def checkpoint_config(model_path: str | Path) -> dict:
    """The checkpoint's ``config.json`` (its text model's part for multimodal ones); {} if unreadable."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config) if isinstance(config, dict) else {}


def _has_linear_attention(model_path: Path) -> bool:
    return any("linear" in str(kind) for kind in checkpoint_config(model_path).get("layer_types") or ())


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


# oneDNN keeps up to 1024 compiled GEMM primitives per process by default, and vLLM's CPU linear
# layers ask for a new one for every batch size (tokens in a step) they meet: a CPU engine's memory then
# grows for hours, in steps each time the load brings new batch sizes (measured: +105 MiB over 60 batches
# of mixed sizes, still climbing; docs/reliability.md). vLLM keeps its own 32 most recent per weight
# shape, so a small global cache bounds the memory at no measured cost in speed. A worker's ``env``
# (or the environment) overrides it.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 32


def engine_args(model: ModelConfig, engine: EngineConfig, *, kv_transfer_config=None,
                kv_events_endpoint: str | None = None):
    """vLLM ``AsyncEngineArgs`` for one worker. Sets the CPU KV-cache size and oneDNN's primitive
    cache capacity in the environment (inherited by the engine's processes) unless already set.
    ``kv_events_endpoint``: where the engine publishes its KV-cache events (with prefix caching on)."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.cpu_kvcache_space_gib))
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
    path = str(resolve_model_path(model))
    return AsyncEngineArgs(
        model=path,
        tokenizer=path,
        served_model_name=[model.name],
        max_model_len=model.max_model_len,
        dtype=resolve_dtype(model.dtype, path),
        enforce_eager=engine.enforce_eager,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        enable_prefix_caching=engine.enable_prefix_caching,
        block_size=engine.block_size,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        seed=engine.seed,
        kv_transfer_config=kv_transfer_config,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint)
        if kv_events_endpoint and engine.enable_prefix_caching else None,
        disable_log_stats=True,
    )
