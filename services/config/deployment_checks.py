"""Cross-field checks of a whole deployment, run once the loader has built it; errors name the key,
like the loader's. The `cache_pools` and `scheduler` sections have checks of their own."""
from __future__ import annotations

import re

from services.config.cache_pool_checks import check_cache_pools
from services.config.errors import ConfigError
from services.config.scheduler_checks import check_scheduler
from services.config.schema import DeploymentConfig, EngineConfig, WorkerConfig
from services.kv_transport.settings import SettingsError, TransportSettings

PORT_KEYS = ("port", "kv_port", "health_port")


def check_deployment(config: DeploymentConfig) -> None:
    try:
        TransportSettings.of(config.transport)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    check_cache_pools(config)
    if config.router.max_body_bytes is not None and config.router.max_body_bytes <= 0:
        raise ConfigError(f"router.max_body_bytes: must be positive, got {config.router.max_body_bytes!r}")
    for name in ("max_sequences_per_request", "max_structured_output_bytes"):
        if getattr(config.router, name) < 1:
            raise ConfigError(f"router.{name}: must be at least 1, got {getattr(config.router, name)!r}")
    if config.router.max_handoffs_per_prefill_worker < 0:
        raise ConfigError("router.max_handoffs_per_prefill_worker: must be 0 (no limit) or positive, got "
                          f"{config.router.max_handoffs_per_prefill_worker!r}")
    if config.router.max_migrations < 0:
        raise ConfigError(f"router.max_migrations: must be 0 (never) or positive, got {config.router.max_migrations!r}")
    for key in ("grpc_max_message_bytes", "grpc_max_concurrent_streams"):
        if getattr(config.security, key) <= 0:
            raise ConfigError(f"security.{key}: must be positive, got {getattr(config.security, key)!r}")
    check_scheduler(config.scheduler)
    _check_workers(config)
    _check_stop_and_restart(config)


def _check_stop_and_restart(config: DeploymentConfig) -> None:
    if not config.router.lease_duration_s >= 3:
        raise ConfigError(f"router.lease_duration_s: must be at least 3, got {config.router.lease_duration_s!r}")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", config.router.lease_name):
        raise ConfigError(f"router.lease_name: must be a Kubernetes object name (lower-case letters, digits, '-' "
                          f"and '.'), got {config.router.lease_name!r}")
    if not config.router.drain_timeout_s >= 0:
        raise ConfigError(f"router.drain_timeout_s: must be 0 or positive, got {config.router.drain_timeout_s!r}")
    supervisor = config.supervisor
    for key in ("restart_backoff_s", "max_restart_backoff_s", "crash_loop_window_s"):
        if not getattr(supervisor, key) >= 0:
            raise ConfigError(f"supervisor.{key}: must be 0 or positive, got {getattr(supervisor, key)!r}")
    if supervisor.max_restart_backoff_s < supervisor.restart_backoff_s:
        raise ConfigError(f"supervisor.max_restart_backoff_s: {supervisor.max_restart_backoff_s!r} is below "
                          f"supervisor.restart_backoff_s ({supervisor.restart_backoff_s!r})")
    if supervisor.crash_loop_restarts < 0:
        raise ConfigError("supervisor.crash_loop_restarts: must be 0 (stop at the first exit) or positive, got "
                          f"{supervisor.crash_loop_restarts!r}")


def _check_workers(config: DeploymentConfig) -> None:
    names = [w.name for w in config.workers]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"workers[{i}].name: duplicate worker name {name!r}")
    seen = {(config.router.host, config.router.port)}
    for i, worker in enumerate(config.workers):
        for key in PORT_KEYS:
            first = getattr(worker, key)
            if first is None:
                continue
            # an engine's TP rank r receives KV at kv_port + r
            ranks = _tp_size(config, worker) if key == "kv_port" else 1
            for endpoint in ((worker.host, first + rank) for rank in range(ranks)):
                if endpoint in seen:
                    what = f" (TP rank {endpoint[1] - first}'s KV port)" if endpoint[1] != first else ""
                    raise ConfigError(f"workers[{i}].{key}: {endpoint[0]}:{endpoint[1]}{what} is already used")
                seen.add(endpoint)
    if not any(w.service == "decode_worker" and w.role != "prefill" for w in config.workers):
        raise ConfigError("workers: at least one decode_worker with role `decode` or `both` is required")
    for i, worker in enumerate(config.workers):
        for key in PORT_KEYS:
            value = getattr(worker, key)
            if value is not None and not 0 < value < 65536:
                raise ConfigError(f"workers[{i}].{key}: {value} is not a TCP port")
        if worker.kv_port is not None and worker.kv_port + _tp_size(config, worker) - 1 > 65535:
            raise ConfigError(f"workers[{i}].kv_port: {worker.kv_port} leaves no port for each of the engine's "
                              f"{_tp_size(config, worker)} TP ranks (rank r receives at kv_port + r)")
        unknown = set(worker.engine) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"workers[{i}].engine.{sorted(unknown)[0]}: unknown engine key")
        overridden = {"max_num_batched_tokens", "enable_chunked_prefill"} & set(worker.engine)
        _check_whole_prompt_steps(config, config.engine_for(worker), f"workers[{i}].engine" if overridden else "engine")
        tp_size = config.engine_for(worker).tensor_parallel_size
        if type(tp_size) is not int or tp_size < 1:
            where = f"workers[{i}].engine" if "tensor_parallel_size" in worker.engine else "engine"
            raise ConfigError(f"{where}.tensor_parallel_size: {tp_size!r} is not a positive number of ranks")
        block_size = config.engine_for(worker).block_size
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            where = f"workers[{i}].engine" if "block_size" in worker.engine else "engine"
            raise ConfigError(f"{where}.block_size: {block_size!r} is not a positive number of tokens")


def _tp_size(config: DeploymentConfig, worker: WorkerConfig) -> int:
    size = worker.engine.get("tensor_parallel_size", config.engine.tensor_parallel_size)
    return size if type(size) is int and size > 0 else 1


def _check_whole_prompt_steps(config: DeploymentConfig, engine: EngineConfig, where: str) -> None:
    """Without chunked prefill a prompt runs in one step, so a step must hold the longest prompt."""
    budget = engine.max_num_batched_tokens
    if not engine.enable_chunked_prefill and budget is not None and budget < config.model.max_model_len:
        raise ConfigError(f"{where}.max_num_batched_tokens: {budget} is below model.max_model_len "
                          f"({config.model.max_model_len}); with enable_chunked_prefill off a step must hold "
                          "a whole prompt")
