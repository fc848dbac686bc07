"""Per-request transfer instructions, carried in vLLM's ``kv_transfer_params``.

The workers' gRPC servicers build them; the connector's scheduler side reads them. A producer
computes the KV of ``prompt[:-1]`` and streams it to ``peer``; the consumer loads that KV and
computes the last prompt token itself (as vLLM's Mooncake and NIXL connectors do for hybrid models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

KEY = "prfaas"


@dataclass(frozen=True, slots=True)
class TransferParams:
    mode: Literal["produce", "consume"]
    transfer_id: str
    peer: str = ""

    def to_extra_args(self) -> dict[str, Any]:
        """For ``SamplingParams.extra_args``."""
        return {"kv_transfer_params": {KEY: {"mode": self.mode, "transfer_id": self.transfer_id,
                                             "peer": self.peer}}}

    @classmethod
    def of(cls, kv_transfer_params: dict | None) -> "TransferParams | None":
        raw = (kv_transfer_params or {}).get(KEY)
        if not raw:
            return None
        return cls(mode=raw["mode"], transfer_id=raw["transfer_id"], peer=raw.get("peer", ""))


def produce(transfer_id: str, peer: str) -> TransferParams:
    return TransferParams("produce", transfer_id, peer)


def consume(transfer_id: str) -> TransferParams:
    return TransferParams("consume", transfer_id)
