"""Per-request transfer instructions: ``KvTransfer``, the one type for a request's streamed KV from
the router (``GenerateInput.kv_transfer``) through the workers' RPC conversion to the connector,
which reads it from vLLM's ``kv_transfer_params``. A producer
computes the KV of ``prompt[:-1]`` and streams it to ``peer``; the consumer loads that KV and
computes the last prompt token itself (as vLLM's Mooncake and NIXL connectors do for hybrid models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

KEY = "prfaas"


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """This request's KV is streamed: ``produce`` it to ``peer`` (an engine of ``peer_tp_size`` TP
    ranks, rank r receiving at peer's port + r), or ``consume`` it from a producer."""

    mode: Literal["produce", "consume"]
    transfer_id: str
    peer: str = ""
    peer_tp_size: int = 1

    def to_extra_args(self) -> dict[str, Any]:
        """For ``SamplingParams.extra_args``."""
        return {"kv_transfer_params": {KEY: {"mode": self.mode, "transfer_id": self.transfer_id,
                                             "peer": self.peer, "peer_tp_size": self.peer_tp_size}}}

    @classmethod
    def of(cls, kv_transfer_params: dict[str, Any] | None) -> KvTransfer | None:
        raw = (kv_transfer_params or {}).get(KEY)
        if not raw:
            return None
        return cls(mode=raw["mode"], transfer_id=raw["transfer_id"], peer=raw.get("peer", ""),
                   peer_tp_size=int(raw.get("peer_tp_size", 1)))


def produce(transfer_id: str, peer: str, peer_tp_size: int = 1) -> KvTransfer:
    return KvTransfer("produce", transfer_id, peer, peer_tp_size)


def consume(transfer_id: str) -> KvTransfer:
    return KvTransfer("consume", transfer_id)
