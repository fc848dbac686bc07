"""`prfaas cache-pool`: run one cluster's hybrid prefix cache pool."""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "cache-pool",
        help="run a cluster's hybrid prefix cache pool",
        description="Run one entry of `cache_pools:` from the deployment config: the CachePool gRPC service "
        "(proto/prfaas/v1/cache_pool.proto) with gRPC health checking, and Prometheus /metrics on "
        "`metrics_port` when set.",
    )
    parser.add_argument("--config", required=True, help="deployment YAML file (see deploy/local.yaml)")
    parser.add_argument("--name", required=True, help="which entry of `cache_pools:` in the config to run")
    parser.add_argument("--host", help="override the pool's bind address from the config")
    parser.add_argument("--port", type=int, help="override the pool's gRPC port from the config")
    parser.add_argument("--metrics-port", type=int, help="override the pool's metrics_port from the config")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override logging.level")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from services.config import ConfigError, load_config
    from services.logs import setup_logging

    try:
        config = load_config(args.config)
        pool_config = config.cache_pool(args.name)
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("metrics_port", args.metrics_port))
                 if v is not None}
    pool_config = dataclasses.replace(pool_config, **overrides)
    setup_logging(pool_config.name, args.log_level or config.logging.level, config.logging.json)
    from services.security import check_listeners
    from services.security.exposure import pool_listeners

    try:
        check_listeners(config, pool_listeners(config, pool_config))
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    try:
        serve_cache_pool(pool_config, config)
    except OSError as exc:
        logger.error("cache pool %s cannot start: %s", pool_config.name, exc)
        return 1
    return 0


def serve_cache_pool(config, deployment, grace_s: float = 5.0) -> None:
    """Serve ``config`` (one of ``deployment.cache_pools``) until SIGTERM or SIGINT, then give
    in-flight calls ``grace_s`` to finish."""
    from services.cache_pool.pool import CachePool
    from services.cache_pool.server import PoolIdentity, start_pool_server
    from services.cache_pool.slots import open_arena
    from services.cache_pool.ssd import SsdTier
    from services.kv_transport.settings import TransportSettings
    from services.security import GrpcSecurity
    from services.security.peers import pool_kv_targets

    ssd = SsdTier(config.ssd_dir, config.ssd_budget_bytes) if config.ssd_dir else None
    slot_bytes = config.arena_slot_kib << 10 if config.arena_slot_kib else None
    arena = open_arena(config.shared_memory_dir, config.name, config.memory_budget_bytes, slot_bytes)
    pool = CachePool(config.memory_budget_bytes, ssd, arena, lease_timeout_s=config.lease_timeout_s)
    running = start_pool_server(pool, PoolIdentity(config.name, config.cluster), config.host, config.port,
                                kv_port=config.kv_port,
                                transport=TransportSettings.of(deployment.transport),
                                security=GrpcSecurity.of(deployment), peers=pool_kv_targets(deployment, config.name),
                                health_port=config.health_port)
    if config.metrics_port is not None:
        running.servicer.metrics.start_http_server(config.host, config.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("cache pool %s (cluster %s) listening on %s:%d; memory budget %d B, SSD %s, shared-memory arena %s, "
                "KV port %s", config.name, config.cluster, config.host, running.port, config.memory_budget_bytes,
                f"{config.ssd_dir} ({config.ssd_budget_bytes} B)" if ssd else "off",
                running.servicer.arena_path or "off", running.servicer.kv_port or "off")
    stop.wait()
    logger.info("cache pool %s stopping", config.name)
    running.stop(grace_s)
