"""Cross-field checks of the `cache_pools` section; errors name the key, like the loader's."""
from __future__ import annotations

from services.config.errors import ConfigError
from services.config.schema import CachePoolConfig, DeploymentConfig

Endpoint = tuple[str, int]


def check_cache_pools(config: DeploymentConfig) -> None:
    taken: set[Endpoint] = {(config.router.host, config.router.port)}
    taken |= {(w.host, port) for w in config.workers
              for port in (w.port, w.kv_port, w.health_port) if port is not None}
    names: set[str] = set()
    clusters: set[str] = set()
    for i, pool in enumerate(config.cache_pools):
        path = f"cache_pools[{i}]"
        if pool.name in names:
            raise ConfigError(f"{path}.name: duplicate cache pool name {pool.name!r}")
        if pool.cluster in clusters:
            raise ConfigError(f"{path}.cluster: cluster {pool.cluster!r} already has a cache pool")
        names.add(pool.name)
        clusters.add(pool.cluster)
        for key in ("port", "metrics_port", "kv_port", "health_port"):
            _check_port(pool, key, path, taken)
        for key in ("memory_budget_gib", "ssd_budget_gib", "lease_timeout_s", "arena_slot_kib"):
            value = getattr(pool, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{path}.{key}: must be positive, got {value!r}")


def _check_port(pool: CachePoolConfig, key: str, path: str, taken: set[Endpoint]) -> None:
    port = getattr(pool, key)
    if port is None:
        return
    if not 0 < port < 65536:
        raise ConfigError(f"{path}.{key}: {port} is not a TCP port")
    if (pool.host, port) in taken:
        raise ConfigError(f"{path}.{key}: {pool.host}:{port} is already used")
    taken.add((pool.host, port))
