"""Worker choice and prefill path: pure functions of a frozen snapshot (no I/O, no clock).

Decode worker first, load-aware: fewest requests (in flight, active, running + waiting), workers
with KV usage at or above ``kv_high_watermark`` only when no other worker is left (they would
preempt), then lower KV usage. Then the prefill path from :func:`decide_offload` on the prompt's
cached prefixes, and the prefill worker cache-affine: the most cached tokens (the router's
:class:`~services.scheduling.affinity.PrefixAffinity` estimate), least loaded among equals, among
the prefill workers whose KV layout maps to the decode worker's (``cannot_feed``); with none left,
the prompt prefills on the decode worker.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from services.scheduling.offload import CacheTransfer, OffloadDecision, decide_offload

DEFAULT_KV_HIGH_WATERMARK = 0.9


@dataclass(frozen=True, slots=True)
class WorkerView:
    name: str
    healthy: bool
    role: str = "both"
    cluster: str = "local"
    generates: bool = True
    prefills: bool = False
    receives_kv: bool = False
    num_in_flight: int = 0
    num_active: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    cannot_feed: frozenset[str] = frozenset()  # decode workers whose KV layout this worker's cannot map to
    # requests this router sent the worker since its last stats answer: not in ``num_active`` yet, which
    # counts every router's requests as of that answer
    num_started_since_poll: int = 0

    @property
    def load(self) -> int:
        """The worker's reported load (all routers') plus this router's requests since; at least this
        router's own in flight."""
        return max(self.num_in_flight, self.num_active + self.num_started_since_poll,
                   self.num_running + self.num_waiting)


@dataclass(frozen=True, slots=True)
class PromptCache:
    """What is cached of one prompt: per cluster (cache-pool index) and per worker (affinity estimate)."""

    num_prompt_tokens: int
    cluster_tokens: Mapping[str, int] = field(default_factory=dict)
    worker_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Route:
    """``local``: the decode worker prefills itself; ``pd``: a local prefill-role worker streams the
    KV to it; ``prfaas``: a PrfaaS-cluster prefill worker streams the KV across clusters.
    ``num_cached_tokens``: the prefix the chosen prefill reuses; ``transfer``: a cross-cluster cache
    copy decided for it (abundant bandwidth only)."""

    path: Literal["local", "pd", "prfaas"]
    decode: str
    prefill: str | None = None
    num_cached_tokens: int = 0
    transfer: CacheTransfer | None = None


def pick_least_loaded(workers: tuple[WorkerView, ...], exclude: frozenset[str] = frozenset(),
                      kv_high_watermark: float = DEFAULT_KV_HIGH_WATERMARK) -> str | None:
    """The healthy generating worker to decode on (see the module docstring); None if none."""
    candidates = [w for w in workers if w.generates and w.healthy and w.name not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.kv_cache_usage >= kv_high_watermark, w.load, w.kv_cache_usage,
                                          w.name)).name


def pick_prefill(candidates: list[WorkerView], worker_tokens: Mapping[str, int]) -> str | None:
    """Cache-affine: the healthy candidate with the most cached tokens, then the least loaded."""
    healthy = [w for w in candidates if w.healthy]
    if not healthy:
        return None
    return min(healthy, key=lambda w: (-worker_tokens.get(w.name, 0), w.load, w.kv_cache_usage, w.name)).name


def choose_route(workers: tuple[WorkerView, ...], incremental_prefill_tokens: int, threshold_tokens: float,
                 exclude: frozenset[str] = frozenset(), *, cache: PromptCache | None = None, scarce: bool = False,
                 kv_high_watermark: float = DEFAULT_KV_HIGH_WATERMARK) -> Route | None:
    """Decode worker first, then where its prompt is prefilled. None: nothing can serve.
    Without ``cache`` the prompt has nothing cached and is ``incremental_prefill_tokens`` long."""
    cache = cache or PromptCache(incremental_prefill_tokens)
    decode_name = pick_least_loaded(workers, exclude, kv_high_watermark)
    if decode_name is None:
        return None
    decode = next(w for w in workers if w.name == decode_name)
    prfaas_workers = [w for w in workers if w.prefills and w.cluster == "prfaas" and w.healthy
                      and decode_name not in w.cannot_feed]
    prfaas_available = decode.receives_kv and bool(prfaas_workers)
    decision = decide_offload(cache.num_prompt_tokens, cache.cluster_tokens, threshold_tokens, prfaas_available,
                              scarce)
    if decision.site == "prfaas":
        return _route("prfaas", decode_name, pick_prefill(prfaas_workers, cache.worker_tokens), decision)
    if decode.receives_kv and decode.role == "decode":
        candidates = [w for w in workers if w.prefills and w.cluster == "local" and w.role == "prefill"
                      and decode_name not in w.cannot_feed]
        if prefill := pick_prefill(candidates, cache.worker_tokens):
            return _route("pd", decode_name, prefill, decision)
    return _route("local", decode_name, None, decision)


def _route(path: Literal["local", "pd", "prfaas"], decode: str, prefill: str | None,
           decision: OffloadDecision) -> Route:
    return Route(path, decode, prefill, decision.num_cached_tokens, decision.transfer)
