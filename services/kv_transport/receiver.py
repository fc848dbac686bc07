"""The receiving half: a listener, ``io_threads`` I/O threads reading the connections, reassembly per transfer.

An accepted connection is authenticated in a short-lived thread of its own (the handshake blocks),
then joins the I/O thread with the fewest connections (``reading.ReadLoop``), which reads its plain
connections without blocking (epoll) and puts ``Frame`` events on a queue as frames complete. One
thread per group of connections instead of one per connection takes a third of the system calls
per frame; several groups let the kernel's copies run on several cores. TLS connections keep a
blocking reader thread each, since the TLS layer buffers records that epoll cannot see.

A transfer completes (``TransferDone``) when its END frame and all the frames it counts are in, on
whatever connections and threads they came: a frame is counted and queued under one lock, so its
``Frame`` event always comes before its transfer's ``TransferDone``. Received bytes not yet taken
by ``poll`` are bounded by ``max_staging_bytes``: past it, reading stops, TCP's flow control stops the sender, and the
sender's own budget blocks its caller. Anything wrong with a frame fails its transfer (or, when the
stream itself is broken, every incomplete transfer seen on that connection) and is logged; the
process keeps serving.
"""
from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy

from services.kv_transport.codecs import NONE, payload_problem
from services.kv_transport.events import ByteBudget, Event, Frame, TransferDone, TransferFailed
from services.kv_transport.protocol import (ABORT, COUNTED_KINDS, DATA, END, FrameHeader, FrameSizes,
                                            HandshakeRefused, ProtocolError, checksum, read_header,
                                            recv_into_exactly, server_handshake)
from services.kv_transport.reading import Connection, ReadLoop
from services.kv_transport.settings import TransportSettings

logger = logging.getLogger(__name__)

MAX_FORGOTTEN = 4096


@dataclass(slots=True)
class _Progress:
    num_frames: int = 0
    expected: int | None = None


class Receiver:
    def __init__(self, settings: TransportSettings, host: str, port: int, tls: ssl.SSLContext | None,
                 frames: FrameSizes) -> None:
        """``frames``: the frame sizes announced to every sender at the handshake."""
        self._settings = settings
        self.frames = frames
        self.allocate: Callable[[int], memoryview] = heap_buffer  # where each frame's payload is read into
        self._tls = tls
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.staging = ByteBudget(settings.max_staging_bytes)
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.bytes_received = 0
        self.frames_rejected = 0
        self.connections_refused = 0
        self._refused_lock = threading.Lock()  # the accept thread and every handshake thread count
        self._closed = False
        self._slots = _Slots(settings.max_pending_handshakes, settings.max_connections_per_peer)
        self._assign_lock = threading.Lock()  # ``ReadLoop.num_connections``
        self._loops = [ReadLoop(self, settings, i) for i in range(settings.io_threads)]
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="prfaas-kv-accept", daemon=True).start()
        logger.info("KV receiver listening on %s:%d (frames of %d bytes asked for)", host, self.port,
                    frames.preferred)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_pending(self) -> int:
        """Transfers with frames received and no end yet."""
        with self._lock:
            return len(self._progress)

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer's state; its late frames are discarded unread."""
        with self._lock:
            self._progress.pop(transfer_id, None)
            self._remember(transfer_id)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept(), which holds the port open
        except OSError:
            pass
        self._listener.close()
        for loop in self._loops:
            loop.wake()

    # Accepting ------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return
            handshake = _Handshake(conn, address[0])
            if (displaced := self._slots.begin(handshake)) is not None:
                _shut(displaced.sock)  # its handshake thread closes it and counts it refused
            threading.Thread(target=self._admit, args=(handshake, f"{address[0]}:{address[1]}"),
                             name="prfaas-kv-handshake", daemon=True).start()

    def _count_refused(self) -> int:
        with self._refused_lock:
            self.connections_refused += 1
            return self.connections_refused

    def _admit(self, handshake: _Handshake, peer: str) -> None:
        """Authenticate a new connection within ``handshake_timeout_s`` (or until a newer one displaces
        it from the budget of connections authenticating), then hand it to the I/O thread with the
        fewest connections (or read it here, for TLS). Only then does it count against its address's
        ``max_connections_per_peer``."""
        deadline = threading.Timer(self._settings.handshake_timeout_s, lambda: _shut(handshake.sock))
        deadline.start()
        conn, admitted = handshake.sock, False

        def admit() -> str | None:
            nonlocal admitted
            why = self._slots.admit(handshake.host)
            admitted = why is None
            return why

        try:
            conn.settimeout(self._settings.connect_timeout_s)
            if self._tls is not None:
                _wait_for_hello(conn, self._settings.handshake_timeout_s)
                conn = handshake.sock = self._tls.wrap_socket(conn, server_side=True)
            codec = server_handshake(conn, self._settings.secret_bytes, self._settings.codec_offer, admit,
                                     self.frames)
        except (HandshakeRefused, ProtocolError, OSError, ssl.SSLError) as exc:
            self._refused_in_handshake(peer, exc, late=not deadline.is_alive(), displaced=handshake.displaced)
            conn.close()
            if admitted:
                self._slots.give(handshake.host)
            return
        finally:
            deadline.cancel()
            self._slots.end(handshake)
        if self._tls is not None:
            self._serve_blocking(conn, peer, codec)
            return
        conn.setblocking(False)
        with self._assign_lock:
            loop = min(self._loops, key=lambda candidate: candidate.num_connections)
            loop.num_connections += 1
        loop.join(Connection(conn, peer, codec))
        if self._closed:  # the I/O thread may have gone already
            self.close_connection(conn, peer, loop)

    def _refused_in_handshake(self, peer: str, exc: Exception, late: bool, displaced: bool) -> None:
        """Counted; logged at the 1st, 2nd, 4th, 8th, ... refusal, so that a flood writes no flood of logs."""
        refused = self._count_refused()
        if refused & (refused - 1):
            return
        if displaced:
            why = (f" (displaced by a newer connection: {self._settings.max_pending_handshakes} were "
                   "authenticating, max_pending_handshakes)")
        elif late:
            why = f" (not authenticated within {self._settings.handshake_timeout_s} s)"
        else:
            why = ""
        if isinstance(exc, HandshakeRefused):
            logger.warning("refused KV connection from %s: %s (%d refused so far)", peer, exc, refused)
        else:
            logger.warning("KV connection from %s dropped during the handshake: %s%s (%d refused so far)", peer,
                           exc, why, refused)

    def close_connection(self, conn: socket.socket, peer: str, loop: ReadLoop | None = None) -> None:
        """Close an authenticated connection, giving its address's slot back (and its place in ``loop``)."""
        conn.close()
        self._slots.give(peer.rpartition(":")[0])
        if loop is not None:
            with self._assign_lock:
                loop.num_connections -= 1

    # TLS connections: a blocking reader each -------------------------------------------------------

    def _serve_blocking(self, conn: socket.socket, peer: str, codec: int) -> None:
        seen: set[str] = set()
        try:
            while True:
                conn.settimeout(None)  # idle between transfers is normal
                header = read_header(conn, self._settings.max_frame_bytes)
                if header is None:
                    self.fail_incomplete(seen, f"KV connection from {peer} closed")
                    return
                conn.settimeout(self._settings.io_timeout_s)
                seen.add(header.transfer_id)
                self.staging.acquire(header.length)
                payload = self.allocate(header.length)
                try:
                    recv_into_exactly(conn, payload)
                except BaseException:
                    self.staging.release(header.length)
                    raise
                self.on_payload(header, payload, peer, seen, codec)
        except (ProtocolError, OSError, ssl.SSLError) as exc:
            self.broken(peer, seen, exc)
        finally:
            self.close_connection(conn, peer)

    def broken(self, peer: str, seen: set[str], exc: Exception) -> None:
        """A connection's stream broke: every incomplete transfer seen on it fails."""
        if isinstance(exc, ProtocolError) and exc.transfer_id:
            seen.add(exc.transfer_id)
        with self._lock:
            self.frames_rejected += 1
        logger.warning("KV connection from %s dropped: %s", peer, exc)
        self.fail_incomplete(seen, f"KV stream from {peer} broke: {exc}")

    # Frames, whichever way they came ---------------------------------------------------------------

    def on_payload(self, header: FrameHeader, payload: memoryview, peer: str, seen: set[str], codec: int) -> None:
        """A whole frame is in; its staging room was taken and is kept only by a counted frame (DATA
        or LAYOUT) that is handed on. Called by every I/O thread (and TLS reader)."""
        with self._lock:
            self.bytes_received += header.length
        keep = header.kind in COUNTED_KINDS and not self.is_forgotten(header.transfer_id)
        if not keep:
            self.staging.release(header.length)
        if (problem := _frame_problem(header, payload, codec)) is not None:
            with self._lock:
                self.frames_rejected += 1
            logger.warning("request %s: KV frame from %s refused (layer %d): %s", header.transfer_id, peer,
                           header.layer, problem)
            if keep:
                self.staging.release(header.length)
            self._fail(header.transfer_id, problem)
        elif header.kind == ABORT:
            self._fail(header.transfer_id, f"sender aborted: {bytes(payload).decode(errors='replace')}")
        elif header.kind == END:
            self._on_frame(header.transfer_id, None, header.seq)
        elif keep:
            frame = Frame(header.transfer_id, header.layer, header.group, header.block_start,
                          header.num_blocks, payload, header.kind, header.codec, header.row_elems)
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

    def fail_incomplete(self, seen: set[str], reason: str) -> None:
        for transfer_id in seen:
            self._fail(transfer_id, reason)

    def is_forgotten(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._forgotten

    def _remember(self, transfer_id: str) -> None:
        self._forgotten[transfer_id] = None
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)


def _frame_problem(header: FrameHeader, payload: memoryview, codec: int) -> str | None:
    """Why a whole frame is refused: its checksum, or a codec or scales the handshake did not agree
    on (only DATA frames may be coded)."""
    if checksum(payload) != header.digest:
        return "checksum mismatch"
    if header.kind != DATA:
        return None if header.codec == NONE and header.row_elems == 0 else "a coded frame that is not DATA"
    return payload_problem(header.codec, header.row_elems, codec, payload)


def _shut(conn: socket.socket) -> None:
    """Wake a handshake blocked on ``conn`` (its reads then fail). The plain socket's shutdown, also on
    a TLS socket: ``SSLSocket.shutdown`` would drop the TLS state under the thread that uses it."""
    try:
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass


def _wait_for_hello(conn: socket.socket, timeout_s: float) -> None:
    """Wait until the peer sent something (or went away) before TLS takes the connection: an idle
    connection then costs no TLS state, which a flood of them would leave scattered over the heap."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLRDHUP)
    if not poller.poll(timeout_s * 1000):
        raise TimeoutError("the peer sent nothing")


@dataclass(slots=True, eq=False)
class _Handshake:
    """A connection being authenticated: its socket (the TLS one once wrapped) and address."""
    sock: socket.socket
    host: str
    displaced: bool = False  # a newer connection took its place in the budget (``_Slots.begin``)


class _Slots:
    """Connections being authenticated, a budget of their own (``max_pending_handshakes``, all
    addresses together), and authenticated connections per peer address (``max_connections_per_peer``).
    A connection counts against its address only once it proved the secret, so unauthenticated ones
    never take an authenticated peer's room, even from the same address. When the handshake budget is
    full, a new connection displaces the one that has waited longest: a real peer authenticates in a
    round trip or two, so it is never the oldest for long, while idle connections cannot keep a
    newcomer out."""

    def __init__(self, max_pending: int, max_per_peer: int) -> None:
        self._max_pending, self._max_per_peer = max_pending, max_per_peer
        self._pending: OrderedDict[_Handshake, None] = OrderedDict()
        self._per_peer: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def begin(self, handshake: _Handshake) -> _Handshake | None:
        """Count ``handshake`` as authenticating; the one it displaces (to be shut), if any."""
        with self._lock:
            displaced = None
            if len(self._pending) >= self._max_pending:
                displaced, _ = self._pending.popitem(last=False)
                displaced.displaced = True
            self._pending[handshake] = None
            return displaced

    def end(self, handshake: _Handshake) -> None:
        """The handshake is over, either way."""
        with self._lock:
            self._pending.pop(handshake, None)

    def admit(self, host: str) -> str | None:
        """Take an authenticated connection's slot for ``host``; the reason when there is none."""
        with self._lock:
            if self._per_peer.get(host, 0) >= self._max_per_peer:
                return (f"{self._max_per_peer} authenticated connections from {host} already open "
                        "(max_connections_per_peer)")
            self._per_peer[host] = self._per_peer.get(host, 0) + 1
            return None

    def give(self, host: str) -> None:
        with self._lock:
            left = self._per_peer.get(host, 0) - 1
            if left > 0:
                self._per_peer[host] = left
            else:
                self._per_peer.pop(host, None)


def heap_buffer(num_bytes: int) -> memoryview:
    """A frame's payload in ordinary memory (not zero-filled: it is overwritten)."""
    return numpy.empty(num_bytes, numpy.uint8).data
