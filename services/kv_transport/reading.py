"""A receiver's I/O threads: each reads its share of the plain connections without blocking (epoll).

The receiver hands each authenticated connection to the loop with the fewest (``ReadLoop.join``);
a loop reads what its sockets hold, completing frames as they come in. Headers are read a few KiB
at a time into a read-ahead buffer (so small frames come several to a ``recv``); a payload is
copied from there as far as it was read ahead, and the rest is received straight into the memory
the receiver's ``allocate`` gives it (``recv_into``). One loop per thread and connection groups
instead of a thread per connection: no lock hand-offs between readers, no per-frame timeout
changes, and one place times out a connection stalled anywhere in a frame; several loops instead
of one: the kernel's copy out of the socket runs without the GIL, so each thread on a core of its
own moves that much more (docs/transport.md).
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

from services.kv_transport.codecs import NONE
from services.kv_transport.events import ByteBudget
from services.kv_transport.protocol import HEADER, FrameHeader, ProtocolError, finish_header, unpack_fixed
from services.kv_transport.settings import TransportSettings
from services.kv_transport.wakeup import WakePipe

logger = logging.getLogger(__name__)

IO_POLL_S = 0.5        # longest a loop sleeps before it looks for stalled connections
STAGING_WAIT_S = 0.5   # how long it waits for staging room before it checks whether it was closed
READ_AHEAD_BYTES = 4096  # read at once while looking for a header; what belongs to a payload is copied
_NO_PAYLOAD = memoryview(b"")  # a connection's payload between frames


class Closed(Exception):
    """The connection ended cleanly between frames, or the receiver is closing."""


@dataclass(slots=True, eq=False)
class Connection:
    """A plain connection read by a loop: unparsed header bytes are ``buffer[start:end]``; while
    ``header`` is set, its payload is read into ``payload``."""
    sock: socket.socket
    peer: str
    codec: int = NONE                  # agreed at the handshake
    buffer: bytearray = field(default_factory=lambda: bytearray(READ_AHEAD_BYTES))
    start: int = 0
    end: int = 0
    header: FrameHeader | None = None
    payload: memoryview = _NO_PAYLOAD
    got: int = 0                       # payload bytes in
    progress_at: float = 0.0           # last time a byte came in the middle of a frame
    seen: set[str] = field(default_factory=set)  # transfers with frames on this connection

    @property
    def mid_frame(self) -> bool:
        return self.header is not None or self.end > self.start


class Sink(Protocol):
    """What a loop hands frames to and asks (the ``Receiver``); called on the loop's thread."""
    allocate: Callable[[int], memoryview]  # memory for a payload of so many bytes
    staging: ByteBudget

    @property
    def closed(self) -> bool: ...
    def on_payload(self, header: FrameHeader, payload: memoryview, peer: str, seen: set[str], codec: int) -> None: ...
    def is_forgotten(self, transfer_id: str) -> bool: ...
    def close_connection(self, conn: socket.socket, peer: str, loop: ReadLoop | None = None) -> None: ...
    def fail_incomplete(self, seen: set[str], reason: str) -> None: ...
    def broken(self, peer: str, seen: set[str], exc: Exception) -> None: ...


class ReadLoop:
    """One I/O thread of a receiver and the connections it reads. ``num_connections`` is changed
    under the receiver's assignment lock (``Receiver._assign``), by ``join`` and by the thread's drops."""

    def __init__(self, receiver: Sink, settings: TransportSettings, index: int) -> None:
        self._receiver = receiver
        self._settings = settings
        self.num_connections = 0
        self._joining: deque[Connection] = deque()
        self._wakeup = WakePipe()
        self._resumed_at = 0.0  # when this loop last got staging room after waiting for it
        threading.Thread(target=self._run, name=f"prfaas-kv-recv-{index}", daemon=True).start()

    def join(self, conn: Connection) -> None:
        """Hand an authenticated connection (non-blocking) to this loop; called by a handshake thread."""
        self._joining.append(conn)
        self._wakeup.wake()

    def wake(self) -> None:
        self._wakeup.wake()

    def _run(self) -> None:
        poller = select.epoll()
        poller.register(self._wakeup.fd, select.EPOLLIN)
        conns: dict[int, Connection] = {}
        try:
            while not self._receiver.closed:
                for fd, _ in poller.poll(IO_POLL_S):
                    if fd == self._wakeup.fd:
                        self._wakeup.drain()
                        while self._joining:
                            joined = self._joining.popleft()
                            conns[joined.sock.fileno()] = joined
                            poller.register(joined.sock, select.EPOLLIN)
                    elif (conn := conns.get(fd)) is not None:
                        try:
                            self._read_some(conn)
                        except (ProtocolError, OSError, Closed) as exc:
                            self._drop(conn, exc, conns, poller)
                        except Exception as exc:  # noqa: BLE001 - a bug must cost one connection, not all
                            logger.exception("KV connection from %s: unexpected error", conn.peer)
                            self._drop(conn, exc, conns, poller)
                self._check_stalled(conns, poller)
        finally:
            for conn in list(conns.values()):
                self._release_partial(conn)
                conn.sock.close()
            while self._joining:
                self._joining.popleft().sock.close()
            poller.close()
            self._wakeup.close()

    def _read_some(self, conn: Connection) -> None:
        """Read what the socket has, completing as many frames as it holds; raises when the stream
        is broken (``Closed`` at a clean end between frames)."""
        while True:
            if conn.header is None and self._next_header(conn):
                continue
            if conn.header is not None:
                view = conn.payload[conn.got:]
            else:
                if conn.start:  # keep the unparsed tail at the front
                    conn.buffer[:conn.end - conn.start] = conn.buffer[conn.start:conn.end]
                    conn.start, conn.end = 0, conn.end - conn.start
                view = memoryview(conn.buffer)[conn.end:]
            try:
                n = conn.sock.recv_into(view)
            except BlockingIOError:
                return
            if n == 0:
                if not conn.mid_frame:
                    raise Closed(f"KV connection from {conn.peer} closed")
                if conn.header is None:
                    raise ProtocolError(f"truncated frame: connection closed {conn.end - conn.start} bytes into "
                                        "a header")
                raise ProtocolError(f"truncated frame: connection closed after {conn.got} of {len(conn.payload)} "
                                    "bytes", conn.header.transfer_id)
            conn.progress_at = time.monotonic()
            if conn.header is None:
                conn.end += n
                continue
            conn.got += n
            if conn.got == len(conn.payload):
                self._complete(conn)

    def _next_header(self, conn: Connection) -> bool:
        """Parse the next header from the read-ahead buffer, with as much of its payload as is
        there; False when the buffer does not hold a whole header yet."""
        available = conn.end - conn.start
        if available < HEADER.size:
            return False
        head = memoryview(conn.buffer)
        fields = unpack_fixed(head[conn.start:conn.start + HEADER.size])
        size = HEADER.size + fields[1]
        if available < size:
            return False
        header = finish_header(fields, head[conn.start + HEADER.size:conn.start + size],
                               self._settings.max_frame_bytes)
        conn.start += size
        conn.seen.add(header.transfer_id)
        self._stage(header.length)
        conn.header = header
        conn.payload = self._receiver.allocate(header.length)
        conn.got = min(header.length, conn.end - conn.start)
        conn.payload[:conn.got] = head[conn.start:conn.start + conn.got]
        conn.start += conn.got
        if conn.got == header.length:
            self._complete(conn)
        return True

    def _complete(self, conn: Connection) -> None:
        header, payload = conn.header, conn.payload
        assert header is not None, "a connection completes only a frame it started"
        conn.header, conn.payload, conn.got = None, _NO_PAYLOAD, 0
        self._receiver.on_payload(header, payload, conn.peer, conn.seen, conn.codec)
        if len(conn.seen) > 1024:
            conn.seen.difference_update([t for t in conn.seen if self._receiver.is_forgotten(t)])

    def _stage(self, num_bytes: int) -> None:
        """Take staging room for a payload; waits (and so stops this loop's reading) while there is
        none. Time spent waiting here does not count against any connection's ``io_timeout_s``."""
        staging = self._receiver.staging
        if staging.acquire(num_bytes, 0):
            return
        while not staging.acquire(num_bytes, STAGING_WAIT_S):
            if self._receiver.closed:
                raise Closed("receiver closed")
        self._resumed_at = time.monotonic()

    def _drop(self, conn: Connection, exc: Exception, conns: dict[int, Connection], poller: select.epoll) -> None:
        conns.pop(conn.sock.fileno(), None)
        poller.unregister(conn.sock)
        self._release_partial(conn)
        self._receiver.close_connection(conn.sock, conn.peer, self)
        if isinstance(exc, Closed):
            self._receiver.fail_incomplete(conn.seen, str(exc))
        else:
            self._receiver.broken(conn.peer, conn.seen, exc)

    def _release_partial(self, conn: Connection) -> None:
        if conn.header is not None:
            self._receiver.staging.release(conn.header.length)
            conn.header, conn.payload = None, _NO_PAYLOAD

    def _check_stalled(self, conns: dict[int, Connection], poller: select.epoll) -> None:
        now, limit = time.monotonic(), self._settings.io_timeout_s
        for conn in list(conns.values()):
            if conn.mid_frame and now - max(conn.progress_at, self._resumed_at) > limit:
                self._drop(conn, ProtocolError(f"no data for {limit:.0f} s in the middle of a frame"), conns, poller)
