"""Transport telemetry carried through vLLM's connector-stats channel to the worker's stat logger.

The worker-side connector returns a snapshot at most once per ``INTERVAL_S``; vLLM ships it to
the engine front end, where ``services.engine.engine`` stores it for the stats RPC.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

INTERVAL_S = 1.0


@dataclass
class TransportStats(KVConnectorStats):
    """``data`` is ``KVTransport.snapshot()``: cumulative counters and the latest samples."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        return self if other.is_empty() else other  # snapshots are cumulative: the newest wins

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, Any] = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        for peer in self.data.get("peers", ()):
            reduced[f"{peer['peer']}_goodput_gbps"] = round(peer["goodput_bps"] / 1e9, 3)
            reduced[f"{peer['peer']}_retransmits"] = peer["retransmits"]
        return reduced

    def is_empty(self) -> bool:
        return not self.data
