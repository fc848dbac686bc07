"""Known peers only: the KV targets a worker or a pool may be asked to dial are those the deployment
config names, so no caller can point a worker's or a pool's connections at an address of its choice
(server-side request forgery). A target is compared as the router and pools write it: ``host:port``
with the host exactly as configured."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownPeers:
    """``host:port`` addresses a service may open KV connections to, and what they are (for errors)."""
    addresses: frozenset[str]
    what: str

    def refusal(self, target: str) -> str | None:
        """Why ``target`` may not be dialled, or None when it is known."""
        if target in self.addresses:
            return None
        known = ", ".join(sorted(self.addresses)) or "none configured"
        return f"KV target {target!r} is not one of the {self.what} ({known})"


def decode_kv_targets(config) -> KnownPeers:
    """Where a prefill worker (PrfaaS or PD-P) may stream KV: the workers' configured KV ports."""
    return KnownPeers(frozenset(f"{w.host}:{w.kv_port}" for w in config.workers if w.kv_port is not None),
                      "deployment's worker KV ports (workers[].host:kv_port)")


def pool_kv_targets(config, pool_name: str) -> KnownPeers:
    """Where a cache pool may push blocks: the other pools' KV ports."""
    return KnownPeers(frozenset(f"{p.host}:{p.kv_port}" for p in config.cache_pools
                                if p.kv_port is not None and p.name != pool_name),
                      "deployment's other cache pools (cache_pools[].host:kv_port)")
