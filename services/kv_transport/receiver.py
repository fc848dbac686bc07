"""The receiving half: a listener, one reader thread per connection, reassembly per transfer.

Readers put ``Frame`` events on a queue as they arrive; a transfer completes (``TransferDone``)
when its END frame and all the frames it counts are in, on whatever connections they came.
Received bytes not yet taken by ``poll`` are bounded by ``max_staging_bytes``: past it, readers
stop reading, TCP's flow control stops the sender, and the sender's own budget blocks its caller.
Anything wrong with a frame fails its transfer (or, when the stream itself is broken, every
incomplete transfer seen on that connection) and is logged; the process keeps serving.
"""
from __future__ import annotations

import logging
import queue
import socket
import ssl
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy

from services.kv_transport.events import ByteBudget, Frame, TransferDone, TransferFailed
from services.kv_transport.protocol import (ABORT, DATA, END, HandshakeRefused, ProtocolError, read_header,
                                            checksum, recv_into_exactly, server_handshake)
from services.kv_transport.settings import TransportSettings

logger = logging.getLogger(__name__)

MAX_FORGOTTEN = 4096


@dataclass(slots=True)
class _Progress:
    num_frames: int = 0
    expected: int | None = None


class Receiver:
    def __init__(self, settings: TransportSettings, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self._settings = settings
        self._tls = tls
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.staging = ByteBudget(settings.max_staging_bytes)
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.bytes_received = 0
        self.frames_rejected = 0
        self.connections_refused = 0
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="prfaas-kv-accept", daemon=True).start()
        logger.info("KV receiver listening on %s:%d", host, self.port)

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer's state; its late frames are discarded unread."""
        with self._lock:
            self._progress.pop(transfer_id, None)
            self._forgotten[transfer_id] = None
            while len(self._forgotten) > MAX_FORGOTTEN:
                self._forgotten.popitem(last=False)

    def close(self) -> None:
        self._listener.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return
            peer = f"{address[0]}:{address[1]}"
            threading.Thread(target=self._serve, args=(conn, peer), name="prfaas-kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        seen: set[str] = set()
        try:
            conn.settimeout(self._settings.connect_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            server_handshake(conn, self._settings.secret_bytes)
            self._read_frames(conn, peer, seen)
        except HandshakeRefused as exc:
            self.connections_refused += 1
            logger.warning("refused KV connection from %s: %s", peer, exc)
        except (ProtocolError, OSError, ssl.SSLError) as exc:
            if getattr(exc, "transfer_id", None):
                seen.add(exc.transfer_id)
            self.frames_rejected += 1
            logger.warning("KV connection from %s dropped: %s", peer, exc)
            self._fail_incomplete(seen, f"KV stream from {peer} broke: {exc}")
        finally:
            conn.close()

    def _read_frames(self, conn: socket.socket, peer: str, seen: set[str]) -> None:
        plain = not isinstance(conn, ssl.SSLSocket)
        if plain:
            conn.settimeout(None)
        while True:
            _read_timeout(conn, None, plain)  # idle between transfers is normal
            header = read_header(conn, self._settings.max_frame_bytes)
            if header is None:
                self._fail_incomplete(seen, f"KV connection from {peer} closed")
                return
            _read_timeout(conn, self._settings.io_timeout_s, plain)
            seen.add(header.transfer_id)
            if len(seen) > 1024:
                seen.difference_update([t for t in seen if self._is_forgotten(t)])
            self.staging.acquire(header.length)
            payload = memoryview(numpy.empty(header.length, numpy.uint8))  # not zero-filled: recv overwrites it
            try:
                recv_into_exactly(conn, payload, flags=socket.MSG_WAITALL if plain else 0)
            except BaseException:
                self.staging.release(header.length)
                raise
            self.bytes_received += header.length
            keep = header.kind == DATA and not self._is_forgotten(header.transfer_id)
            if not keep:
                self.staging.release(header.length)
            if checksum(payload) != header.digest:
                self.frames_rejected += 1
                logger.warning("request %s: KV frame from %s failed its checksum (layer %d)", header.transfer_id,
                               peer, header.layer)
                if keep:
                    self.staging.release(header.length)
                self._fail(header.transfer_id, "checksum mismatch")
            elif header.kind == ABORT:
                self._fail(header.transfer_id, f"sender aborted: {bytes(payload).decode(errors='replace')}")
            elif header.kind == END:
                self._on_frame(header.transfer_id, None, header.seq)
            elif keep:
                frame = Frame(header.transfer_id, header.layer, header.group, header.block_start,
                              header.num_blocks, payload)
                self._on_frame(header.transfer_id, frame, None)

    def _on_frame(self, transfer_id: str, frame: Frame | None, expected: int | None) -> None:
        with self._lock:
            if transfer_id in self._forgotten:
                if frame is not None:
                    self.staging.release(len(frame.payload))
                return
            progress = self._progress.setdefault(transfer_id, _Progress())
            if frame is not None:
                progress.num_frames += 1
                self.events.put(frame)
            else:
                progress.expected = expected
            if progress.expected is not None and progress.num_frames >= progress.expected:
                del self._progress[transfer_id]
                self._remember(transfer_id)
                self.events.put(TransferDone(transfer_id))

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            if transfer_id in self._forgotten:
                return
            self._progress.pop(transfer_id, None)
            self._remember(transfer_id)
        self.events.put(TransferFailed(transfer_id, reason))

    def _fail_incomplete(self, seen: set[str], reason: str) -> None:
        for transfer_id in seen:
            self._fail(transfer_id, reason)

    def _is_forgotten(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._forgotten

    def _remember(self, transfer_id: str) -> None:
        self._forgotten[transfer_id] = None
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)


def _read_timeout(conn: socket.socket, seconds: float | None, plain: bool) -> None:
    """Plain sockets stay blocking with a kernel timeout (SO_RCVTIMEO), so a whole frame arrives in
    one ``recv(MSG_WAITALL)``; Python's own socket timeouts cost a poll and a recv per segment."""
    if not plain:
        conn.settimeout(seconds)
        return
    whole = 0 if seconds is None else int(seconds)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", whole, 0 if seconds is None else int((seconds - whole) * 1e6)))
