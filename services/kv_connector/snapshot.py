"""What the worker-side connector reports to the engine: the transport's telemetry and the cache
pool counters, as frozen dataclasses.

Each TP rank's connector writes its snapshot to a file the worker's front end reads
(``stats_file``); ``ConnectorSnapshot.as_dict``/``from_dict`` are the one place that dict is written
and read.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.kv_transport.telemetry import TransportSnapshot


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """Cumulative cache pool traffic of one engine's connector."""

    tokens_loaded: int = 0
    tokens_stored: int = 0
    loads_failed: int = 0
    stores_failed: int = 0


@dataclass(frozen=True, slots=True)
class ConnectorSnapshot:
    transport: TransportSnapshot = field(default_factory=TransportSnapshot)
    pool: PoolCounters = field(default_factory=PoolCounters)

    def as_dict(self) -> dict[str, Any]:
        return {"transport": self.transport.as_dict(), "pool": asdict(self.pool)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConnectorSnapshot:
        return cls(TransportSnapshot.from_dict(data.get("transport", {})), PoolCounters(**data.get("pool", {})))

    @classmethod
    def summed(cls, snapshots: Sequence[ConnectorSnapshot]) -> ConnectorSnapshot:
        """An engine's TP ranks as one: each rank sends and receives its own share of the KV (summed),
        and stores and loads its own share of the same prompt tokens: the tokens every rank moved
        (the least of the ranks' counts), and the most failures any rank saw."""
        pools = [s.pool for s in snapshots]
        return cls(TransportSnapshot.summed([s.transport for s in snapshots]),
                   PoolCounters(tokens_loaded=min((p.tokens_loaded for p in pools), default=0),
                                tokens_stored=min((p.tokens_stored for p in pools), default=0),
                                loads_failed=max((p.loads_failed for p in pools), default=0),
                                stores_failed=max((p.stores_failed for p in pools), default=0)))
