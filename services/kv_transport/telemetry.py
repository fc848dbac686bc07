"""Congestion telemetry: Linux ``TCP_INFO`` per connection, bytes and goodput per peer.

Sending connections sample ``TCP_INFO`` every ``telemetry_interval_s``; ``PeerTelemetry.snapshot``
sums or averages over a peer's connections into a :class:`PeerSnapshot`; ``KVTransport.snapshot``
gathers them, with the receiving counters, into a :class:`TransportSnapshot`. Both are frozen
dataclasses of plain fields; ``TransportSnapshot.as_dict``/``from_dict`` carry one to the worker's
front end as a plain dict (a JSON file, or vLLM's connector-stats channel); ``summed`` adds up an
engine's TP ranks.

A connection's smoothed RTT only moves when ACKs arrive, and it is sampled only while it sends: an
idle connection's last sample keeps the RTT of the link as it was (a full queue on a squeezed link,
say) for as long as it stays idle. The snapshot's RTT therefore comes from connections that heard an
ACK in the last ``RTT_FRESH_S``; with none, it is 0 (no reading).
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

_TCP_INFO_LEN = 232
RTT_FRESH_S = 2.0
MAX_LISTED = 256  # sending transfers a snapshot names
# Offsets into struct tcp_info (linux/tcp.h).
_FIELDS = {"retransmits": ("B", 2), "last_ack_recv_ms": ("I", 56), "rtt_us": ("I", 68), "rttvar_us": ("I", 72),
           "snd_cwnd": ("I", 80), "total_retrans": ("I", 100), "pacing_rate_bps": ("Q", 104),
           "delivery_rate_bps": ("Q", 160), "bytes_retrans": ("Q", 208)}


def tcp_info(sock: socket.socket) -> dict[str, int] | None:
    """Selected ``TCP_INFO`` fields of a connected socket; None where the OS does not provide them."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None
    info = {}
    for name, (fmt, offset) in _FIELDS.items():
        size = struct.calcsize(fmt)
        if offset + size <= len(raw):
            info[name] = struct.unpack_from("=" + fmt, raw, offset)[0]
    for rate in ("pacing_rate_bps", "delivery_rate_bps"):
        if rate in info:
            info[rate] *= 8  # the kernel reports bytes per second
    return info


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    """One sender's link to one peer: cumulative counters and the latest ``TCP_INFO`` samples,
    summed over its connections (``rtt_us``: the largest fresh RTT, 0 with none)."""

    peer: str
    connections: int = 0
    bytes_sent: int = 0
    frames_sent: int = 0
    transfers_sent: int = 0
    transfers_failed: int = 0
    goodput_bps: float = 0.0  # of the last completed transfer
    retransmits: int = 0
    delivery_rate_bps: int = 0
    rtt_us: int = 0
    cwnd_segments: int = 0
    # CPU seconds the sender's I/O threads have used: writing frames, TCP's work in the kernel on its
    # behalf (on a veth pair, the receiving side's too). On a host where the engine shares its cores
    # with the sender, this is what a prefill loses to the previous request's KV leaving.
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TransportSnapshot:
    """A ``KVTransport``'s telemetry: each peer it sends to, and what its listener received."""

    peers: tuple[PeerSnapshot, ...] = ()
    bytes_received: int = 0
    frames_rejected: int = 0
    connections_refused: int = 0
    # transfers begun and not yet ended (completed, failed or forgotten): a cancelled request's must
    # go to 0, or its state leaks
    transfers_receiving: int = 0
    transfers_sending: int = 0
    # the sending transfers not yet ended (at most ``MAX_LISTED``), and the latest failed ones with
    # why: the prefill worker reports a failed transfer to the router by its Prefill call
    sends_pending: tuple[str, ...] = ()
    sends_failed: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransportSnapshot:
        return cls(peers=tuple(PeerSnapshot(**peer) for peer in data.get("peers", ())),
                   bytes_received=data.get("bytes_received", 0), frames_rejected=data.get("frames_rejected", 0),
                   connections_refused=data.get("connections_refused", 0),
                   transfers_receiving=data.get("transfers_receiving", 0),
                   transfers_sending=data.get("transfers_sending", 0),
                   sends_pending=tuple(data.get("sends_pending", ())),
                   sends_failed=tuple((str(tid), str(why)) for tid, why in data.get("sends_failed", ())))

    @classmethod
    def summed(cls, snapshots: Sequence[TransportSnapshot]) -> TransportSnapshot:
        """Several transports (an engine's TP ranks) as one: counters and rates add up per peer, the
        RTT is the largest."""
        peers: dict[str, PeerSnapshot] = {}
        for peer in (p for s in snapshots for p in s.peers):
            seen = peers.get(peer.peer)
            peers[peer.peer] = peer if seen is None else PeerSnapshot(peer.peer, **{
                name: max(getattr(seen, name), getattr(peer, name)) if name == "rtt_us"
                else getattr(seen, name) + getattr(peer, name)
                for name in PeerSnapshot.__dataclass_fields__ if name != "peer"})
        return cls(peers=tuple(peers.values()), bytes_received=sum(s.bytes_received for s in snapshots),
                   frames_rejected=sum(s.frames_rejected for s in snapshots),
                   connections_refused=sum(s.connections_refused for s in snapshots),
                   transfers_receiving=sum(s.transfers_receiving for s in snapshots),
                   transfers_sending=sum(s.transfers_sending for s in snapshots),
                   sends_pending=tuple(t for s in snapshots for t in s.sends_pending),
                   sends_failed=tuple(f for s in snapshots for f in s.sends_failed))


@dataclass(slots=True)
class _Connection:
    info: dict[str, int] | None = None
    sampled_at: float = 0.0
    bytes_sent: int = 0

    def rtt_is_fresh(self, now: float) -> bool:
        """Whether the sampled RTT was fed by an ACK in the last ``RTT_FRESH_S``."""
        if not self.info:
            return False
        return now - self.sampled_at + self.info.get("last_ack_recv_ms", 0) / 1000 <= RTT_FRESH_S


class PeerTelemetry:
    """What one sender knows about its link to one peer. Thread-safe; cheap to update per frame."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        self.bytes_sent = 0
        self.frames_sent = 0
        self.transfers_sent = 0
        self.transfers_failed = 0
        self.busy_s = 0.0           # time with at least one frame on the wire
        self._cpu_by_thread: dict[int, float] = {}  # each I/O thread's ``time.thread_time``, as of its last frame
        self._last_goodput_bps = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU seconds the link's I/O threads have used, as of each one's last frame."""
        with self._lock:
            return sum(self._cpu_by_thread.values())

    def on_cpu(self, thread_index: int, thread_time_s: float) -> None:
        with self._lock:
            self._cpu_by_thread[thread_index] = thread_time_s

    def on_sent(self, conn_id: int, num_bytes: int) -> None:
        with self._lock:
            self.bytes_sent += num_bytes
            self.frames_sent += 1
            self._connections.setdefault(conn_id, _Connection()).bytes_sent += num_bytes

    def on_sample(self, conn_id: int, info: dict[str, int] | None) -> None:
        with self._lock:
            connection = self._connections.setdefault(conn_id, _Connection())
            connection.info, connection.sampled_at = info, time.monotonic()

    def on_closed(self, conn_id: int) -> None:
        with self._lock:
            self._connections.pop(conn_id, None)

    def on_transfer(self, ok: bool, num_bytes: int, elapsed_s: float) -> None:
        with self._lock:
            if ok:
                self.transfers_sent += 1
                if elapsed_s > 0:
                    self._last_goodput_bps = num_bytes * 8 / elapsed_s
            else:
                self.transfers_failed += 1

    def snapshot(self) -> PeerSnapshot:
        now = time.monotonic()
        with self._lock:
            infos = [c.info for c in self._connections.values() if c.info]
            fresh = [c.info for c in self._connections.values() if c.info and c.rtt_is_fresh(now)]
            return PeerSnapshot(
                peer=self.peer, connections=len(self._connections), bytes_sent=self.bytes_sent,
                frames_sent=self.frames_sent, transfers_sent=self.transfers_sent,
                transfers_failed=self.transfers_failed, goodput_bps=self._last_goodput_bps,
                retransmits=sum(i.get("total_retrans", 0) for i in infos),
                delivery_rate_bps=sum(i.get("delivery_rate_bps", 0) for i in infos),
                rtt_us=max((i.get("rtt_us", 0) for i in fresh), default=0),
                cwnd_segments=sum(i.get("snd_cwnd", 0) for i in infos),
                cpu_s=sum(self._cpu_by_thread.values()))


class Clock:
    """Rate limiter for per-connection sampling."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval_s
        return True
