"""The global cache index: for a prompt's block hashes, the usable prefix in every cluster.

An in-process class the router's scheduler queries; it asks each cluster's pool (Lookup over gRPC)
concurrently. A pool that fails or is slower than ``timeout_s`` reports nothing cached (a neutral
answer), never an error: routing must not fail because a cache is down.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from services.cache_pool_client.client import CachePoolClient
from services.cache_pool_client.types import LookupQuery, LookupResult
from services.security import GrpcSecurity

logger = logging.getLogger(__name__)


class GlobalCacheIndex:
    def __init__(self, pool_addresses: Mapping[str, str], timeout_s: float = 0.05,
                 security: GrpcSecurity | None = None) -> None:
        """``pool_addresses``: cluster name → its pool's gRPC address (host:port)."""
        self._clients = {cluster: CachePoolClient(address, security=security)
                         for cluster, address in pool_addresses.items()}
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, config, timeout_s: float = 0.05) -> "GlobalCacheIndex":
        return cls({p.cluster: f"{p.host}:{p.port}" for p in config.cache_pools}, timeout_s,
                   GrpcSecurity.of(config))

    @property
    def clients(self) -> dict[str, CachePoolClient]:
        """Cluster name → its pool's client (shared with cross-cluster cache transfers)."""
        return dict(self._clients)

    @property
    def clusters(self) -> tuple[str, ...]:
        return tuple(self._clients)

    async def lookup(self, query: LookupQuery) -> dict[str, LookupResult]:
        """Usable prefix per cluster; called by the router per request, may wait up to ``timeout_s``."""
        if len(self._clients) == 1:  # one pool: asked directly, without a task to gather
            (cluster,) = self._clients
            return {cluster: await self._lookup_one(cluster, query)}
        results = await asyncio.gather(*(self._lookup_one(cluster, query) for cluster in self._clients))
        return dict(zip(self._clients, results))

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients.values()))

    async def _lookup_one(self, cluster: str, query: LookupQuery) -> LookupResult:
        client = self._clients[cluster]
        try:
            return await client.lookup(query, timeout_s=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("cache pool of cluster %s (%s): lookup failed: %s", cluster, client.address,
                           exc.code().name)
            return LookupResult(0, 0, query.block_size)
