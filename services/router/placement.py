"""Per request: what is cached of the prompt, where it goes, and the decision's metrics and log line.

The prompt's chained block hashes (``prompt_block_hashes``) go to the cache pools' global index
(when ``cache_pools`` are configured) for the usable prefix per cluster, and to the router's
prefix-affinity estimate for the cached tokens per worker. The decision itself is
``services.scheduling.placement.choose_route``.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool_client.index import GlobalCacheIndex
from services.cache_pool_client.transfer import CrossClusterCopier
from services.cache_pool_client.types import GroupKind, KvCacheGroup, LookupQuery
from services.config import DeploymentConfig
from services.router.metrics import RouterMetrics
from services.router.prefix_index import PrefixIndex
from services.router.workers import WorkerPool
from services.scheduling.affinity import PrefixAffinity
from services.scheduling.congestion import FixedThreshold, OffloadThreshold
from services.scheduling.offload import CacheTransfer, bandwidth_scarce
from services.scheduling.placement import PromptCache, Route

logger = logging.getLogger(__name__)

OFFLOAD_WINDOW = 100


class CacheTransferIssuer(Protocol):
    """The hook for moving decided cross-cluster cache transfers (with cache pools:
    ``services.cache_pool_client.transfer.CrossClusterCopier``). Called by :class:`Placement` on the
    event loop right after the decision; must not block (start the copy in the background). The
    prefill may start before the copy lands: it then recomputes the missing blocks."""

    def issue(self, request_id: str, transfer: CacheTransfer, block_hashes: Sequence[bytes]) -> None: ...


class Placement:
    def __init__(self, config: DeploymentConfig, pool: WorkerPool, metrics: RouterMetrics,
                 index: GlobalCacheIndex | None = None, transfers: CacheTransferIssuer | None = None,
                 threshold: OffloadThreshold | None = None) -> None:
        """``threshold``: the offload threshold's one owner (the router's controller), whose value
        routes and whose base tells scarce bandwidth from abundant; a fixed one at
        ``scheduler.offload_threshold_tokens`` if None. Without ``index`` (no cache pools) nothing is
        known to be cached in any cluster."""
        scheduler = config.scheduler
        self._threshold = threshold or FixedThreshold(scheduler.offload_threshold_tokens)
        self.block_size = scheduler.cache_block_size
        self._model_key = scheduler.cache_model_key or config.model.name
        self._groups = tuple(KvCacheGroup(i, GroupKind(kind)) for i, kind in enumerate(scheduler.cache_kv_groups))
        self._pool = pool
        self._metrics = metrics
        self._index = index
        # without pools nothing is cached anywhere, so no transfer is ever decided
        self._transfers = transfers or (self._copier(index) if index is not None else None)
        self.affinity = PrefixAffinity()
        self.prefix_index = PrefixIndex(metrics)
        self._recent_offloads: deque[bool] = deque(maxlen=OFFLOAD_WINDOW)

    def _copier(self, index: GlobalCacheIndex) -> CrossClusterCopier:
        metrics = self._metrics

        def copied(source: str, target: str, num_blocks: int, num_bytes: int) -> None:
            metrics.cache_transfer_blocks.labels(source, target).inc(num_blocks)
            metrics.cache_transfer_bytes.labels(source, target).inc(num_bytes)

        def failed(source: str, target: str) -> None:
            metrics.cache_transfer_failures.labels(source, target).inc()

        return CrossClusterCopier(index.clients, self._model_key, self.block_size, self._groups, copied, failed)

    async def close(self) -> None:
        if isinstance(self._transfers, CrossClusterCopier):
            await self._transfers.close()

    async def prompt_cache(self, token_ids: Sequence[int]) -> tuple[PromptCache, list[bytes]]:
        """Cached prefix per cluster and per worker; may wait up to the index's lookup deadline."""
        block_hashes = prompt_block_hashes(token_ids, self.block_size)
        cluster_tokens: dict[str, int] = {}
        if self._index is not None and block_hashes:
            query = LookupQuery(self._model_key, self.block_size, tuple(block_hashes), self._groups)
            results = await self._index.lookup(query)
            cluster_tokens = {cluster: result.num_usable_tokens for cluster, result in results.items()}
            for cluster, num_tokens in cluster_tokens.items():
                self._metrics.cached_prefix_tokens.labels(cluster).inc(num_tokens)
        workers = [h.name for h in self._pool.handles if h.prefill is not None or h.decode is not None]
        # exact where the worker streams its prefix cache; the estimate only for workers that do not
        worker_tokens = self.affinity.cached_tokens(workers, block_hashes, self.block_size)
        worker_tokens.update(self.prefix_index.cached_tokens(workers, token_ids))
        return PromptCache(len(token_ids), cluster_tokens, worker_tokens), block_hashes

    @property
    def threshold_tokens(self) -> float:
        """The offload threshold now, read from its one owner."""
        return self._threshold.threshold_tokens

    def route(self, request_id: str, cache: PromptCache, block_hashes: Sequence[bytes],
              exclude: frozenset[str] = frozenset()) -> Route | None:
        """Where the request goes (None: no worker can take it), logged and counted once here."""
        threshold_tokens = self.threshold_tokens
        scarce = bandwidth_scarce(threshold_tokens, self._threshold.base_tokens)
        route = self._pool.route(cache.num_prompt_tokens, threshold_tokens, exclude, cache=cache, scarce=scarce)
        if route is None:
            return None
        logger.debug("request %s: route %s decode=%s prefill=%s prompt_tokens=%d cached_local=%d cached_prfaas=%d "
                     "reused=%d incremental_prompt_tokens=%d threshold=%s bandwidth=%s transfer=%s", request_id,
                     route.path, route.decode, route.prefill, cache.num_prompt_tokens,
                     cache.cluster_tokens.get("local", 0), cache.cluster_tokens.get("prfaas", 0),
                     route.num_cached_tokens, cache.num_prompt_tokens - route.num_cached_tokens, threshold_tokens,
                     "scarce" if scarce else "abundant", _describe(route.transfer))
        self._record(request_id, route, block_hashes, scarce, cache.num_prompt_tokens - route.num_cached_tokens)
        return route

    def _record(self, request_id: str, route: Route, block_hashes: Sequence[bytes], scarce: bool,
                num_uncached_tokens: int) -> None:
        self._metrics.decisions.labels(route.path).inc()
        self._metrics.decision_prompt_tokens.labels(route.path).observe(num_uncached_tokens)
        self._metrics.bandwidth_scarce.set(1 if scarce else 0)
        self._metrics.reused_prefix_tokens.inc(route.num_cached_tokens)
        self._recent_offloads.append(route.path == "prfaas")
        self._metrics.offloaded_fraction.set(sum(self._recent_offloads) / len(self._recent_offloads))
        self.affinity.record(route.prefill or route.decode, block_hashes)
        if route.transfer is not None:
            self._metrics.cross_cluster_transfers.labels(route.transfer.source, route.transfer.target).inc()
            self._metrics.cross_cluster_transfer_tokens.inc(route.transfer.num_tokens)
            if self._transfers is not None:
                num_blocks = route.transfer.num_tokens // self.block_size
                self._transfers.issue(request_id, route.transfer, block_hashes[:num_blocks])


def _describe(transfer: CacheTransfer | None) -> str:
    return "none" if transfer is None else f"{transfer.source}->{transfer.target}:{transfer.num_tokens}"
