"""Connector settings, passed by the worker through vLLM's ``kv_connector_extra_config``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    listen_host: str = "127.0.0.1"
    listen_port: int | None = None  # None: this engine only sends
    max_early_bytes: int = 256 << 20
    # Stream each layer's KV as soon as it is computed; False holds it all until the prefill ends
    # (only useful to measure what layer-wise streaming saves: bench/layerwise_overlap.py).
    layerwise: bool = True
    transport: dict = field(default_factory=dict)

    @classmethod
    def of(cls, extra: dict) -> "ConnectorSettings":
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_extra_config(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @property
    def recv_idle_timeout_s(self) -> float:
        from services.kv_transport import TransportSettings

        return TransportSettings.of(self.transport).recv_idle_timeout_s

    def open_streams(self):
        from services.kv_transport import KVTransport, TransportSettings

        return KVTransport(TransportSettings.of(self.transport), self.listen_host, self.listen_port)
