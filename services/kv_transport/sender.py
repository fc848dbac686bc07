"""The sending half: a pool of connections to one peer, striping frames across them.

Frames go into one queue per peer; each connection's thread takes the next frame when its socket
is free, so a slow connection simply carries fewer frames. Queued bytes are bounded: ``send``
blocks the caller while the peer is behind (backpressure) and fails the transfer after
``send_timeout_s``. A connection error fails every transfer that used it; the receiver learns
through an ABORT frame on another connection (or, at the latest, its idle timeout).
"""
from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from services.kv_transport.events import ByteBudget
from services.kv_transport.protocol import ABORT, DATA, END, HandshakeRefused, client_handshake, encode_header
from services.kv_transport.settings import TransportSettings
from services.kv_transport.telemetry import Clock, PeerTelemetry, tcp_info

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = 1.0


@dataclass(slots=True)
class _Outgoing:
    kind: int
    transfer_id: str
    seq: int
    payload: memoryview
    layer: int = 0
    group: int = 0
    block_start: int = 0
    num_blocks: int = 0


@dataclass(slots=True)
class _Transfer:
    started: float = field(default_factory=time.monotonic)
    num_frames: int = 0
    num_bytes: int = 0
    failed: str | None = None


class PeerLink:
    def __init__(self, peer: str, settings: TransportSettings, tls: ssl.SSLContext | None) -> None:
        self.peer = peer
        self._address = _parse_peer(peer)
        self._settings = settings
        self._tls = tls
        self.telemetry = PeerTelemetry(peer)
        self._budget = ByteBudget(settings.max_inflight_bytes)
        self._queue: deque[_Outgoing] = deque()
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self._closed = False
        self._unreachable_until = 0.0
        self._threads = [threading.Thread(target=self._connection_loop, args=(i,), daemon=True,
                                          name=f"prfaas-kv-send-{i}")
                         for i in range(settings.connections_per_peer)]
        for thread in self._threads:
            thread.start()

    # Called by the user (any thread) ------------------------------------------------------------

    def send(self, transfer_id: str, layer: int, group: int, block_start: int, num_blocks: int,
             payload: memoryview) -> None:
        """Queue one layer's blocks, split into frames of whole blocks; may block (backpressure)."""
        payload = memoryview(payload).cast("B")
        block_bytes = len(payload) // max(num_blocks, 1)
        target = min(self._settings.frame_bytes, self._settings.max_frame_bytes)
        blocks_per_frame = max(1, target // max(block_bytes, 1))
        for first in range(0, max(num_blocks, 1), blocks_per_frame):
            count = min(blocks_per_frame, num_blocks - first) if num_blocks else 0
            chunk = payload[first * block_bytes:(first + count) * block_bytes] if num_blocks else payload
            self._enqueue(transfer_id, DATA, chunk, layer, group, block_start + first, count)

    def finish(self, transfer_id: str) -> None:
        """All frames of the transfer are queued; the END frame tells the receiver how many."""
        self._enqueue(transfer_id, END, memoryview(b""))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # Internals -----------------------------------------------------------------------------------

    def _enqueue(self, transfer_id: str, kind: int, payload: memoryview, layer: int = 0, group: int = 0,
                 block_start: int = 0, num_blocks: int = 0) -> None:
        with self._cond:
            transfer = self._transfers.setdefault(transfer_id, _Transfer())
            if transfer.failed:
                if kind == END:
                    self._transfers.pop(transfer_id, None)
                return
            seq = transfer.num_frames
            if kind == DATA:
                transfer.num_frames += 1
                transfer.num_bytes += len(payload)
        if not self._budget.acquire(len(payload), self._settings.send_timeout_s):
            self._fail(transfer_id, f"peer took no data for {self._settings.send_timeout_s:.0f} s")
            return
        with self._cond:
            self._queue.append(_Outgoing(kind, transfer_id, seq, payload, layer, group, block_start, num_blocks))
            self._cond.notify()

    def _next(self) -> _Outgoing | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            return self._queue.popleft() if self._queue else None

    def _connection_loop(self, conn_id: int) -> None:
        sock, used_by = None, set()
        sample = Clock(self._settings.telemetry_interval_s)
        while (item := self._next()) is not None:
            try:
                if item.kind != ABORT and self._is_failed(item.transfer_id, drop=item.kind == END):
                    continue
                if sock is None:
                    sock = self._connect()
                    used_by = set()
                used_by.add(item.transfer_id)
                header = encode_header(item.kind, item.transfer_id, item.layer, item.group, item.block_start,
                                       item.num_blocks, item.seq, item.payload)
                _send_parts(sock, header, item.payload)
                self.telemetry.on_sent(conn_id, len(header) + len(item.payload))
                if sample.due():
                    self.telemetry.on_sample(conn_id, tcp_info(sock))
                if item.kind == END:
                    self._complete(item.transfer_id)
                    used_by.discard(item.transfer_id)
            except (OSError, HandshakeRefused) as exc:
                reason = f"KV connection to {self.peer} failed: {exc}"
                if sock is not None:
                    sock.close()
                    sock = None
                    self.telemetry.on_closed(conn_id)
                for transfer_id in used_by | {item.transfer_id}:
                    self._fail(transfer_id, reason)
            finally:
                if item.kind != ABORT:
                    self._budget.release(len(item.payload))
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket:
        if time.monotonic() < self._unreachable_until:
            raise ConnectionRefusedError("peer unreachable (recent connect failure)")
        sock = None
        try:
            sock = socket.create_connection(self._address, timeout=self._settings.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, self._settings.notsent_lowat_bytes)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
            client_handshake(sock, self._settings.secret_bytes)
            if self._tls is None:
                # Blocking with a kernel timeout: one sendmsg moves a whole frame, where Python's own
                # socket timeouts cost a poll and a send per buffer-full.
                sock.settimeout(None)
                seconds = int(self._settings.io_timeout_s)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))
            else:
                sock.settimeout(self._settings.io_timeout_s)
            return sock
        except (OSError, HandshakeRefused) as exc:
            if sock is not None:
                sock.close()
            self._unreachable_until = time.monotonic() + RECONNECT_BACKOFF_S
            if isinstance(exc, HandshakeRefused):
                logger.error("KV peer %s refused the connection: %s", self.peer, exc)
            raise

    def _is_failed(self, transfer_id: str, drop: bool) -> bool:
        with self._cond:
            transfer = self._transfers.get(transfer_id)
            failed = transfer is not None and transfer.failed is not None
            if failed and drop:
                del self._transfers[transfer_id]
            return failed

    def _complete(self, transfer_id: str) -> None:
        with self._cond:
            transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            self.telemetry.on_transfer(True, transfer.num_bytes, time.monotonic() - transfer.started)

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._cond:
            transfer = self._transfers.get(transfer_id)
            if transfer is None or transfer.failed:
                return  # already complete, or already failed
            transfer.failed = reason
            self._queue.appendleft(_Outgoing(ABORT, transfer_id, 0, memoryview(reason.encode()[:1024])))
            self._cond.notify()
        self.telemetry.on_transfer(False, 0, 0.0)
        logger.warning("request %s: KV send failed: %s", transfer_id, reason)


def _send_parts(sock: socket.socket, *parts) -> None:
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _parse_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV peer {peer!r} is not host:port")
    return host.strip("[]"), int(port)
