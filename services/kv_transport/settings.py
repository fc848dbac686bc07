"""Transport settings: the deployment's `transport:` block, validated."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from services.config.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TransportSettings:
    connections_per_peer: int = 8
    max_frame_bytes: int = 8 << 20        # larger layer payloads are split into whole-block frames
    max_inflight_bytes: int = 512 << 20   # per peer, queued for sending; senders block beyond it
    max_staging_bytes: int = 512 << 20    # received, not yet taken by the engine; readers pause beyond it
    connect_timeout_s: float = 10.0
    io_timeout_s: float = 30.0            # a socket that makes no progress this long is dead
    send_timeout_s: float = 60.0          # longest a send may wait for room before the transfer fails
    recv_idle_timeout_s: float = 30.0     # a receiving transfer with no progress this long fails
    secret: str = ""                      # shared secret; empty: read from `secret_env`
    secret_env: str = "PRFAAS_KV_SECRET"
    tls_cert: str = ""                    # PEM files; set all three to wrap connections in mutual TLS
    tls_key: str = ""
    tls_ca: str = ""
    telemetry_interval_s: float = 0.25    # how often a sending connection samples TCP_INFO

    @classmethod
    def of(cls, raw: dict | None) -> "TransportSettings":
        raw = dict(raw or {})
        known = {f.name: f for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"transport.{key}: unknown key (known: {', '.join(known)})")
            expected = type(known[key].default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                raw[key] = value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
                raise ConfigError(f"transport.{key}: expected {expected.__name__}, got {value!r}")
            if expected in (int, float) and value <= 0:
                raise ConfigError(f"transport.{key}: must be positive, got {value!r}")
        settings = cls(**raw)
        if len({bool(settings.tls_cert), bool(settings.tls_key), bool(settings.tls_ca)}) > 1:
            raise ConfigError("transport.tls_cert: tls_cert, tls_key and tls_ca go together")
        return settings

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def secret_bytes(self) -> bytes:
        return (self.secret or os.environ.get(self.secret_env, "")).encode()

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert)
