"""Known peers only: the KV targets a worker or a pool may be asked to dial are those the deployment
config names, so no caller can point a worker's or a pool's connections at an address of its choice
(server-side request forgery). A target is compared as the router and pools write it: ``host:port``
with the host exactly as configured."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KnownPeers:
    """``host:port`` addresses a service may open KV connections to, and what they are (for errors).
    ``tp_sizes``: an address's engine TP size where above 1 (its rank r listens at port + r)."""
    addresses: frozenset[str]
    what: str
    tp_sizes: Mapping[str, int] = field(default_factory=dict)

    def refusal(self, target: str, tp_size: int = 1) -> str | None:
        """Why ``target`` (an engine of ``tp_size`` ranks) may not be dialled, or None when it is known."""
        if target not in self.addresses:
            known = ", ".join(sorted(self.addresses)) or "none configured"
            return f"KV target {target!r} is not one of the {self.what} ({known})"
        if tp_size != self.tp_sizes.get(target, 1):
            return (f"KV target {target!r} runs {self.tp_sizes.get(target, 1)} TP rank(s) in the deployment config, "
                    f"not {tp_size}")
        return None


def decode_kv_targets(config) -> KnownPeers:
    """Where a prefill worker (PrfaaS or PD-P) may stream KV: the workers' configured KV ports (and the
    ports after them, one per further TP rank)."""
    workers = [w for w in config.workers if w.kv_port is not None]
    tp_sizes = {f"{w.host}:{w.kv_port}": config.engine_for(w).tensor_parallel_size for w in workers}
    return KnownPeers(frozenset(tp_sizes), "deployment's worker KV ports (workers[].host:kv_port)",
                      {address: size for address, size in tp_sizes.items() if size > 1})


def pool_kv_targets(config, pool_name: str) -> KnownPeers:
    """Where a cache pool may push blocks: the other pools' KV ports."""
    return KnownPeers(frozenset(f"{p.host}:{p.kv_port}" for p in config.cache_pools
                                if p.kv_port is not None and p.name != pool_name),
                      "deployment's other cache pools (cache_pools[].host:kv_port)")
