"""Transport settings: the deployment's `transport:` block, validated."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from services.kv_transport.codecs import CODECS, offer
from services.kv_transport.protocol import DEFAULT_FRAME_SIZES, FrameSizes

_T = TypeVar("_T")
MAX_IO_THREADS = 64
ZERO_MEANS_DEFAULT = ("frame_bytes",)  # keys whose 0 asks for each end's own default


class SettingsError(ValueError):
    """A `transport:` setting that cannot be used; the message names the key. (The config loader
    reports it as a configuration error; this package depends on no other of the project.)"""


def _opt(default: _T, help: str) -> _T:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class TransportSettings:
    connections_per_peer: int = _opt(8, "TCP connections per peer pair; frames are striped across them.")
    io_threads: int = _opt(1, "I/O threads per side: a sender drives each peer's connections from this many "
                           "threads (at most one per connection), a receiver reads its connections from this many "
                           "(at most 64). Their copies and checksums run in parallel, so where an end has cores to "
                           "spare, goodput grows with them up to the link's limit; where it has one (a 2-core host), "
                           "a second thread costs 15-25% more CPU per GiB, hence 1 (docs/transport.md).")
    frame_bytes: int = _opt(0, "Frame payload. A receiver announces its frame size at the KV handshake; a sender "
                            "cuts a layer's blocks into frames of whole blocks up to the smaller of this and what the "
                            "receiver announced (a single larger block is one frame), so connections share a "
                            "transfer in small units and none holds its tail; a connection whose unsent allowance "
                            "(see `notsent_queue_ms`) is smaller takes such a frame in parts of it. 0: each end's "
                            "default: a receiver announces its device's size (a decode engine whose KV cache is on "
                            "CUDA 8 MiB, which its host-to-device copies need: docs/gpu.md; every other receiver "
                            "512 KiB), and a sender takes what the receiver announces. Set, it is both what "
                            "receivers announce and the most senders send.")
    max_frame_bytes: int = _opt(DEFAULT_FRAME_SIZES.limit, "Largest frame payload a receiver accepts (it announces "
                                "it at the handshake); senders never pack frames beyond it (a single block larger "
                                "than this cannot be sent).")
    notsent_lowat_bytes: int = _opt(1 << 20, "Most unsent bytes a connection may hold in its socket buffer "
                                     "(`TCP_NOTSENT_LOWAT`); a frame goes to the next connection with room, so "
                                     "one slowed by loss does not sit on queued frames while the others idle.")
    notsent_queue_ms: float = _opt(10.0, "Unsent bytes per connection as time at its rate (TCP's pacing rate): each "
                                   "connection's `TCP_NOTSENT_LOWAT` follows rate x this, between 128 KiB and "
                                   "`notsent_lowat_bytes`, so a slow WAN connection holds a short tail while a "
                                   "fast local one keeps enough queued to stay busy.")
    max_inflight_bytes: int = _opt(512 << 20, "Bytes queued for sending, per peer; senders block beyond it.")
    max_staging_bytes: int = _opt(512 << 20, "Bytes received but not yet taken by the engine; readers pause "
                                  "beyond it.")
    connect_timeout_s: float = _opt(10.0, "Deadline for connecting (and handshaking) to a peer.")
    io_timeout_s: float = _opt(30.0, "A socket that makes no progress this long is dead.")
    stall_timeout_s: float = _opt(10.0, "The PrfaaS path fails fast: a sending transfer whose peer cannot be "
                                  "connected to (and authenticated with) within this bound, or whose connection "
                                  "makes no progress for this long, fails (the sender's `connect_timeout_s` and "
                                  "`io_timeout_s` count only up to it). The prefill worker then fails its Prefill "
                                  "call and the router prefills the request locally, so no request waits on a dead "
                                  "link longer than this plus a local prefill; the failure counts as a link fault.")
    send_timeout_s: float = _opt(60.0, "Longest a send may wait for room before the transfer fails.")
    recv_idle_timeout_s: float = _opt(30.0, "A receiving transfer with no progress this long, once its first KV "
                                      "arrived, fails.")
    recv_first_frame_timeout_s: float = _opt(300.0, "A decode engine waits this long for a transfer's first KV "
                                             "(the prefill may be queued behind others); the router cancels a "
                                             "request whose prefill fails, so this is a backstop.")
    secret: str = _opt("", "Shared secret both ends prove at connect; empty: read it from `secret_env`.")
    secret_env: str = _opt("PRFAAS_KV_SECRET", "Environment variable with the shared secret.")
    tls_cert: str = _opt("", "PEM certificate; set `tls_cert`, `tls_key` and `tls_ca` to wrap connections "
                         "in mutual TLS.")
    tls_key: str = _opt("", "PEM private key of `tls_cert`.")
    tls_ca: str = _opt("", "PEM CA bundle that peer certificates must chain to.")
    tls_server_name: str = _opt("", "Name gRPC clients expect in servers' certificates (`tls_*` also secure gRPC); "
                                "empty: the host as configured. The KV data plane trusts the CA alone.")
    handshake_timeout_s: float = _opt(5.0, "Deadline for a new connection to authenticate; slower ones are closed "
                                      "(counted as refused).")
    max_pending_handshakes: int = _opt(32, "Connections a receiver lets authenticate at once, from all addresses "
                                       "together: a budget of their own, apart from `max_connections_per_peer`. "
                                       "When it is full, a new connection displaces the one that has waited "
                                       "longest (closed, counted as refused), so idle or garbage connections "
                                       "never keep a real peer, which authenticates in a round trip or two, out.")
    max_connections_per_peer: int = _opt(64, "Authenticated connections one peer address may hold open to a "
                                         "receiver; more are refused at the handshake with this reason (counted "
                                         "as refused). Connections still authenticating do not count.")
    telemetry_interval_s: float = _opt(0.25, "How often a sending connection samples `TCP_INFO`.")
    codec: str = _opt("none", "Codec of attention KV on the link from the PrfaaS cluster: `none` (the engine's cache "
                      "dtype as it is), `int8` or `fp8` (8-bit values with a float32 scale per row of one K channel "
                      "or a few tokens: about half of bfloat16's bytes, a quarter of float32's; int8 costs less "
                      "quality: docs/wire-codecs.md). PrfaaS prefill workers code what they send and decode workers "
                      "accept it; both ends must offer it at the KV handshake, else KV travels raw. Linear-attention "
                      "state, local PD transfers and cache-pool blocks always travel raw.")

    @classmethod
    def of(cls, raw: Mapping[str, object] | None) -> "TransportSettings":
        values: dict[str, Any] = dict(raw or {})  # each checked below against its field's type
        known = {f.name: f for f in fields(cls)}
        for key, value in values.items():
            if key not in known:
                raise SettingsError(f"transport.{key}: unknown key (known: {', '.join(known)})")
            expected = type(known[key].default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                values[key] = value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
                raise SettingsError(f"transport.{key}: expected {expected.__name__}, got {value!r}")
            if (expected in (int, float) and isinstance(value, (int, float)) and value <= 0
                    and not (value == 0 and key in ZERO_MEANS_DEFAULT)):
                allowed = "0 (each end's default) or positive" if key in ZERO_MEANS_DEFAULT else "positive"
                raise SettingsError(f"transport.{key}: must be {allowed}, got {value!r}")
        settings = cls(**values)
        if settings.codec not in CODECS:
            raise SettingsError(f"transport.codec: {settings.codec!r} is not one of {', '.join(CODECS)}")
        if settings.notsent_lowat_bytes >= 1 << 31:
            raise SettingsError(f"transport.notsent_lowat_bytes: {settings.notsent_lowat_bytes} does not fit the "
                              "kernel's socket option (below 2 GiB)")
        if settings.max_frame_bytes >= 1 << 64:
            raise SettingsError(f"transport.max_frame_bytes: {settings.max_frame_bytes} does not fit the handshake's "
                              "64-bit field")
        if settings.frame_bytes > settings.max_frame_bytes:
            raise SettingsError(f"transport.frame_bytes: {settings.frame_bytes} is above max_frame_bytes "
                              f"({settings.max_frame_bytes}), which receivers would refuse")
        if settings.io_threads > MAX_IO_THREADS:
            raise SettingsError(f"transport.io_threads: {settings.io_threads} is above {MAX_IO_THREADS}; one thread "
                              "per free core is what pays")
        if settings.max_connections_per_peer < settings.connections_per_peer:
            raise SettingsError(f"transport.max_connections_per_peer: {settings.max_connections_per_peer} is below "
                              f"connections_per_peer ({settings.connections_per_peer}); peers could not connect")
        if len({bool(settings.tls_cert), bool(settings.tls_key), bool(settings.tls_ca)}) > 1:
            raise SettingsError("transport.tls_cert: tls_cert, tls_key and tls_ca go together")
        return settings

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def secret_bytes(self) -> bytes:
        return (self.secret or os.environ.get(self.secret_env, "")).encode()

    @property
    def frame_cap(self) -> int:
        """The largest frame payload this end sends: ``frame_bytes``, or ``max_frame_bytes`` when it is 0."""
        return min(self.frame_bytes or self.max_frame_bytes, self.max_frame_bytes)

    def frame_sizes(self, default: int = DEFAULT_FRAME_SIZES.preferred) -> FrameSizes:
        """What this end's receiver announces: ``frame_bytes``, or when it is 0 the receiving
        service's ``default``, at most ``max_frame_bytes``; and ``max_frame_bytes``."""
        return FrameSizes(min(self.frame_bytes or default, self.max_frame_bytes), self.max_frame_bytes)

    @property
    def codec_offer(self) -> int:
        """What this end offers at the KV handshake (``codecs.offer``)."""
        return offer(self.codec)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert)
