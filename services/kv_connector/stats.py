"""Connector telemetry carried through vLLM's connector-stats channel to the worker's stat logger.

The worker-side connector returns a snapshot at most once per ``INTERVAL_S``; vLLM ships its
``data`` (``ConnectorSnapshot.as_dict()``) to the engine front end, where ``services.engine.engine``
reads it back for the stats RPC.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from services.kv_connector.snapshot import ConnectorSnapshot

INTERVAL_S = 1.0


@dataclass
class ConnectorStats(KVConnectorStats):
    """``data`` is ``ConnectorSnapshot.as_dict()``: cumulative counters and the latest samples."""

    @classmethod
    def of(cls, snapshot: ConnectorSnapshot) -> ConnectorStats:
        return cls(data=snapshot.as_dict())

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        return self if other.is_empty() else other  # snapshots are cumulative: the newest wins

    def reduce(self) -> dict[str, int | float]:
        snapshot = ConnectorSnapshot.from_dict(self.data)
        transport, pool = snapshot.transport, snapshot.pool
        reduced: dict[str, Any] = {
            "bytes_received": transport.bytes_received, "frames_rejected": transport.frames_rejected,
            "connections_refused": transport.connections_refused, "pool_tokens_loaded": pool.tokens_loaded,
            "pool_tokens_stored": pool.tokens_stored, "pool_loads_failed": pool.loads_failed,
            "pool_stores_failed": pool.stores_failed}
        for peer in transport.peers:
            reduced[f"{peer.peer}_goodput_gbps"] = round(peer.goodput_bps / 1e9, 3)
            reduced[f"{peer.peer}_retransmits"] = peer.retransmits
        return reduced

    def is_empty(self) -> bool:
        return not self.data
