"""Selective offloading on the incremental prefill length (paper, section 3.4.3; docs/architecture.md, "One request").

The router knows, per cluster, how many leading prompt tokens that cluster's cache pool holds. The
*incremental* prefill length is what a prefill still has to compute: ``l = l_total - cached``.

- **Scarce bandwidth** (the threshold controller has raised ``t`` above its base or stopped
  offloading, see :func:`bandwidth_scarce`): each cluster's cache is judged alone. The request is
  offloaded when the local cluster would have to prefill more than ``t`` tokens
  (``l_total - l_local > t``); the PrfaaS path then uses the PrfaaS cluster's own prefix. No cache
  moves between clusters: the link is busy enough carrying KV.
- **Abundant bandwidth**: the longest prefix anywhere counts (``l = l_total - max(l_local,
  l_prfaas)``). When it sits in the cluster the request is *not* prefilled in, a cross-cluster cache
  transfer of the missing blocks is decided (:attr:`OffloadDecision.transfer`).

Pure: no I/O, no clock. The router and the simulator call :func:`decide_offload` per request.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.scheduling.routing import PrefillSite, choose_prefill_site

CLUSTER_OF_SITE: dict[PrefillSite, str] = {"local": "local", "prfaas": "prfaas"}


@dataclass(frozen=True, slots=True)
class CacheTransfer:
    """Copy the prompt's cached blocks for tokens ``[0, num_tokens)`` from one cluster's pool to the other's."""

    source: str
    target: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class OffloadDecision:
    site: PrefillSite
    num_incremental_tokens: int
    num_cached_tokens: int
    scarce: bool
    transfer: CacheTransfer | None = None


def bandwidth_scarce(threshold_tokens: float, base_threshold_tokens: float) -> bool:
    """Scarce while the short-timescale controller holds ``t`` above its base (link near its
    ceiling or congested) or has stopped offloading (``t`` infinite: the link is down)."""
    return math.isinf(threshold_tokens) or threshold_tokens > base_threshold_tokens


def decide_offload(num_prompt_tokens: int, cached_tokens: Mapping[str, int], threshold_tokens: float,
                   prfaas_available: bool, scarce: bool) -> OffloadDecision:
    """``cached_tokens``: cluster (``local``, ``prfaas``) → usable cached prefix in tokens; a
    missing cluster has nothing cached. With no pools at all this is the plain length rule."""
    local = _cached(cached_tokens, "local", num_prompt_tokens)
    prfaas = _cached(cached_tokens, "prfaas", num_prompt_tokens)
    if scarce:
        site = choose_prefill_site(num_prompt_tokens - local, threshold_tokens, prfaas_available)
        own = local if site == "local" else prfaas
        return OffloadDecision(site, num_prompt_tokens - own, own, scarce=True)
    by_cluster = {"local": local, "prfaas": prfaas}
    best = max(local, prfaas)
    site = choose_prefill_site(num_prompt_tokens - best, threshold_tokens, prfaas_available)
    target = CLUSTER_OF_SITE[site]
    source = "prfaas" if target == "local" else "local"
    transfer = CacheTransfer(source, target, best) if by_cluster[target] < best else None
    return OffloadDecision(site, num_prompt_tokens - best, best, scarce=False, transfer=transfer)


def _cached(cached_tokens: Mapping[str, int], cluster: str, num_prompt_tokens: int) -> int:
    return max(0, min(cached_tokens.get(cluster, 0), num_prompt_tokens))
