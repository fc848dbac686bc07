"""The sending half: a pool of connections to one peer, striping frames across them.

Frames go into one queue per peer. ``io_threads`` I/O threads per peer each drive a group of its
connections without blocking (epoll): a connection with no frame in hand takes the next one from
the queue, and one whose socket is full waits for room, so a slow connection simply carries fewer
frames. With ``TCP_NOTSENT_LOWAT`` a socket reports room only while little is queued in it, so
frames go to the connections that are moving. A thread per group instead of one per connection: on
a busy core, blocking threads cost a wake-up and a switch per frame; several groups instead of one:
the kernel's copy into the socket runs without the GIL, so one thread per core moves that much more
(docs/transport.md has the measurements). A frame is taken from the queue, cut and numbered under
one lock, so an END frame always counts every frame handed out before it, whichever thread took
them. Queued bytes are bounded: ``send`` blocks the caller while the peer is behind (backpressure)
and fails the transfer after ``send_timeout_s``. A connection error fails every transfer that used
it; the receiver learns through an ABORT frame on another connection (or, at the latest, its idle
timeout).

Payloads are copied into the socket (``sendmsg``), not spliced from the caller's memory. A
zero-copy sender (``vmsplice`` into a pipe per connection, ``splice`` into the socket; same
frames, checksums and receiver) was measured on loopback against the same loop with ``sendmsg``:
26-33 against 36-40 Gbit/s, with no less sender CPU per GiB (0.23-0.31 s against 0.21-0.23 s)
and more on the receiver (0.25-0.31 against 0.20-0.22 s), which then copies out of 4 KiB page
fragments. It would also tie the
caller's buffer to the receiver: on one host the receiving socket reads the sender's pages when
the application reads, long after TCP acknowledged them, so a buffer reused early would be sent
changed.
"""
from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kv_transport.codecs import NONE
from services.kv_transport.events import ByteBudget
from services.kv_transport.protocol import (ABORT, COUNTED_KINDS, DATA, END, LAYOUT, Agreement, Bytes, FrameSizes,
                                            HandshakeRefused, client_handshake, encode_header)
from services.kv_transport.settings import TransportSettings
from services.kv_transport.telemetry import Clock, PeerTelemetry, tcp_info
from services.kv_transport.wakeup import WakePipe

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = 1.0
IO_POLL_S = 0.5  # longest wait for socket room before stalled connections are checked
MIN_NOTSENT_LOWAT = 128 << 10  # below this, a fast connection would wait on the I/O thread between frames
IDLE_CHECK_S = 0.5  # a connection unused this long is checked for a hang-up before it carries a frame
RECENT_FAILURES = 64  # failed transfers a link remembers for its telemetry (``recent_failures``)

# (dtype name of the engine's cache, values per row): how a payload of attention KV may be coded;
# each row is one (block, KV head, K or V) of the cache
Coding = tuple[str, int]
# encoder(codec, payload, dtype, values per row) -> the coded payload (``codecs`` has the formats)
Encoder = Callable[[int, memoryview, str, int], Bytes]


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
    on_sent: "_Countdown | None" = None
    coding: Coding | None = None  # None: never coded (state pages, layouts, cache-pool blocks)
    coded: "tuple[int, Bytes] | None" = None  # (codec, payload) coded ahead, on the sending thread
    divisible: bool = False  # its blocks lie one after another: it may be cut between them (``_cut``)


class _Countdown:
    """Calls ``done`` once all ``count`` frames cut from one payload are sent or dropped."""

    def __init__(self, count: int, done: Callable[[], None]) -> None:
        self._left = count
        self._done = done
        self._lock = threading.Lock()

    def add(self) -> None:
        """One frame more: a frame was cut in two before it was sent."""
        with self._lock:
            self._left += 1

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()


@dataclass(slots=True)
class _Transfer:
    started: float = field(default_factory=time.monotonic)
    num_frames: int = 0
    num_bytes: int = 0
    failed: str | None = None


class PeerLink:
    def __init__(self, peer: str, settings: TransportSettings, tls: ssl.SSLContext | None,
                 encoder: Encoder | None = None) -> None:
        self.peer = peer
        self._encoder = encoder
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
        self.recent_failures: deque[tuple[str, str]] = deque(maxlen=RECENT_FAILURES)  # (transfer id, reason)
        self._agreed: int | None = None  # the codec the last handshake agreed on (None: none yet)
        self._announced: int | None = None  # the frame payload the receiver last asked for (None: no handshake yet)
        num_threads = min(settings.io_threads, settings.connections_per_peer)
        self._drivers = [_Driver(i, [_Connection(conn_id, Clock(settings.telemetry_interval_s))
                                     for conn_id in range(i, settings.connections_per_peer, num_threads)])
                         for i in range(num_threads)]
        self._threads = [threading.Thread(target=self._io_loop, args=(driver,), daemon=True,
                                          name=f"prfaas-kv-send-{driver.index}") for driver in self._drivers]
        for thread in self._threads:
            thread.start()

    # Called by the user (any thread) ------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        """Transfers begun on this link and not yet completed or failed (a failed one is remembered
        until its sender finishes it, so that its late frames are dropped, but it is over)."""
        with self._cond:
            return sum(1 for transfer in self._transfers.values() if not transfer.failed)

    @property
    def pending_ids(self) -> list[str]:
        """The transfers ``num_pending`` counts."""
        with self._cond:
            return [transfer_id for transfer_id, transfer in self._transfers.items() if not transfer.failed]

    def send(self, transfer_id: str, layer: int, group: int, block_start: int, num_blocks: int,
             payload: Bytes, on_sent: Callable[[], None] | None = None, coding: Coding | None = None,
             divisible: bool = False) -> None:
        """Queue one layer's blocks, split into frames of whole blocks; may block (backpressure).
        The payload is read until ``on_sent`` is called (from any thread): once it was written to
        the sockets, or dropped with its transfer. With ``coding``, each frame is coded with the
        codec its connection agreed on: here, on the calling thread, once a handshake has agreed on
        one (so the I/O thread only writes), else as it goes out. ``divisible``: the payload is its
        blocks one after another, so it is cut at the receiver's frame size (``frame_bytes``), and a
        frame may also be cut as it goes out (``_cut``); a payload laid out otherwise (K of every
        block, then V; or pieces of heads) is cut at this end's cap alone (``frame_cap``: the size
        its maker knew, independent of any handshake) and must fit one frame."""
        payload = memoryview(payload).cast("B")
        block_bytes = len(payload) // max(num_blocks, 1)
        target = self.frame_bytes if divisible else self._settings.frame_cap
        blocks_per_frame = max(1, target // max(block_bytes, 1))
        starts = range(0, max(num_blocks, 1), blocks_per_frame)
        countdown = _Countdown(len(starts), on_sent) if on_sent is not None else None
        for first in starts:
            count = min(blocks_per_frame, num_blocks - first) if num_blocks else 0
            chunk = payload[first * block_bytes:(first + count) * block_bytes] if num_blocks else payload
            self._enqueue(transfer_id, DATA, chunk, layer, group, block_start + first, count, countdown, coding,
                          self._code_ahead(chunk, coding), divisible)

    @property
    def frame_bytes(self) -> int:
        """The payload a frame of whole blocks carries at most: this end's cap, or the receiver's
        announced frame size when a handshake told it and it is smaller."""
        return min(self._settings.frame_cap, self._announced or self._settings.frame_cap)

    def send_layout(self, transfer_id: str, layout: bytes) -> None:
        """Queue the transfer's LAYOUT frame; may block (backpressure)."""
        self._enqueue(transfer_id, LAYOUT, memoryview(layout))

    def finish(self, transfer_id: str) -> None:
        """All frames of the transfer are queued; the END frame tells the receiver how many."""
        self._enqueue(transfer_id, END, memoryview(b""))

    def abort(self, transfer_id: str, reason: str) -> None:
        """Fail the transfer: its queued frames are dropped and an ABORT frame tells the receiver why."""
        self._fail(transfer_id, reason)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        """Interrupt the I/O threads' waits for socket room: there is a new frame to hand out."""
        for driver in self._drivers:
            if driver.want_wake or self._closed:
                driver.wakeup.wake()

    # Internals -----------------------------------------------------------------------------------

    def _code_ahead(self, payload: memoryview, coding: Coding | None) -> "tuple[int, Bytes] | None":
        """The frame coded with the codec the link's handshakes agree on, or None (not known yet, raw,
        or coding failed: the I/O thread then decides as the frame goes out)."""
        codec = self._agreed
        if coding is None or codec in (None, NONE) or self._encoder is None:
            return None
        try:
            return codec, self._encoder(codec, payload, *coding)
        except Exception:  # noqa: BLE001 - the I/O thread tries again, and sends raw if it fails too
            return None

    def _enqueue(self, transfer_id: str, kind: int, payload: memoryview, layer: int = 0, group: int = 0,
                 block_start: int = 0, num_blocks: int = 0, on_sent: _Countdown | None = None,
                 coding: Coding | None = None, coded: "tuple[int, Bytes] | None" = None,
                 divisible: bool = False) -> None:
        with self._cond:
            transfer = self._transfers.setdefault(transfer_id, _Transfer())
            if transfer.failed:
                if kind == END:
                    self._transfers.pop(transfer_id, None)
                if on_sent is not None:
                    on_sent.tick()
                return
            seq = transfer.num_frames
            if kind in COUNTED_KINDS:
                transfer.num_frames += 1
                transfer.num_bytes += len(payload)
        if not self._budget.acquire(len(payload), self._settings.send_timeout_s):
            self._fail(transfer_id, f"peer took no data for {self._settings.send_timeout_s:.0f} s")
            if on_sent is not None:
                on_sent.tick()
            return
        with self._cond:
            self._queue.append(_Outgoing(kind, transfer_id, seq, payload, layer, group, block_start, num_blocks,
                                         on_sent, coding, coded, divisible))
            self._cond.notify()
        self._wake()

    def _pop(self, conn: "_Connection | None" = None) -> _Outgoing | None:
        """The next frame worth sending, cut for ``conn`` (``_cut``) and numbered if it is an END;
        frames of failed transfers are dropped on the way (one lock)."""
        dropped, item = [], None
        with self._cond:
            while self._queue:
                item = self._queue.popleft()
                transfer = self._transfers.get(item.transfer_id)
                if item.kind == ABORT or transfer is None or transfer.failed is None:
                    break
                if item.kind == END:
                    del self._transfers[item.transfer_id]
                dropped.append(item)
                item = None
            if item is not None and conn is not None:
                item = self._cut(item, conn)
        for frame in dropped:
            self._release(frame)
        return item

    def _wait_for_work(self) -> bool:
        """Block while nothing is queued; False once closed with nothing left."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            return bool(self._queue)

    def _io_loop(self, driver: "_Driver") -> None:
        conns = driver.conns
        poller = select.epoll()
        poller.register(driver.wakeup.fd, select.EPOLLIN)
        writable: set[int] = set()
        try:
            while True:
                busy = False
                for conn in conns:
                    if conn.watched and conn.connected.fileno() not in writable:
                        busy = True  # still no room: no point trying
                    else:
                        busy |= self._drive(conn, poller, driver)
                if busy:
                    # A new frame needs a wake-up only while some connection is idle; the flag is
                    # set before the queue is looked at again, so no frame waits out a poll.
                    driver.want_wake = any(conn.item is None for conn in conns)
                    if driver.want_wake and self._queue:
                        writable = set()
                        continue
                    writable = {fd for fd, _ in poller.poll(IO_POLL_S)}
                    driver.want_wake = False
                    if driver.wakeup.fd in writable:
                        driver.wakeup.drain()
                    self._check_stalled(conns, poller)
                elif not self._wait_for_work():
                    break
                else:
                    writable = set()
        finally:
            for conn in conns:
                if conn.sock is not None:
                    conn.sock.close()
            poller.close()
            driver.wakeup.close()

    def _drive(self, conn: "_Connection", poller: select.epoll, driver: "_Driver") -> bool:
        """Send what this connection can without blocking, taking new frames while its socket has
        room; True while it holds a frame it could not finish (it waits for room)."""
        while True:
            if conn.item is None and not self._take(conn, poller):
                return False
            try:
                if not _send_some(conn.connected, conn.views):
                    conn.waiting_since = conn.waiting_since or time.monotonic()
                    if not conn.watched:
                        poller.modify(conn.connected, select.EPOLLOUT)
                        conn.watched = True
                    return True
            except (OSError, ssl.SSLError) as exc:
                self._drop(conn, poller, f"KV connection to {self.peer} failed: {exc}")
                continue
            conn.waiting_since = 0.0
            if conn.watched:
                poller.modify(conn.connected, 0)
                conn.watched = False
            self._sent(conn, driver)

    def _take(self, conn: "_Connection", poller: select.epoll) -> bool:
        """Give an idle connection the next frame to send (connecting first when needed). A
        connection is (re)connected before it takes a frame, since how much of a frame it takes
        depends on its socket (``_cut``)."""
        while self._queue:
            if conn.sock is not None and time.monotonic() - conn.used_at > IDLE_CHECK_S and _hung_up(conn.sock):
                self._drop(conn, poller, f"KV peer {self.peer} closed an idle connection")
            if conn.sock is None:
                try:
                    conn.sock, agreement = self._connect()
                except (OSError, HandshakeRefused) as exc:
                    if (failed := self._pop()) is not None:
                        self._release(failed)
                        self._fail(failed.transfer_id, f"KV connection to {self.peer} failed: {exc}")
                    continue
                poller.register(conn.sock, 0)
                conn.codec, conn.frame_bytes = agreement.codec, self._frame_bytes_for(agreement.frames)
                conn.used_by, conn.notsent_lowat = set(), self._settings.notsent_lowat_bytes
            if (item := self._pop(conn)) is None:
                return False
            conn.used_by.add(item.transfer_id)
            codec, payload, row_elems = self._coded(item, conn.codec)
            header = encode_header(item.kind, item.transfer_id, item.layer, item.group, item.block_start,
                                   item.num_blocks, item.seq, payload, codec, row_elems)
            conn.item, conn.size = item, len(header) + len(payload)
            conn.views = [memoryview(header)] + ([memoryview(payload).cast("B")] if len(payload) else [])
            return True
        return False

    def _cut(self, item: _Outgoing, conn: "_Connection") -> _Outgoing:
        """The part of a frame this connection takes now: at most the receiver's frame size (a frame
        cut before the first handshake told it was cut at this end's cap), and with other
        connections to share with, about the bytes it may keep unsent (its ``TCP_NOTSENT_LOWAT``,
        some milliseconds at its rate), in whole blocks; the rest goes back to the front of the queue
        for whichever connection has room next. A connection whose socket is full thus holds no more
        of a transfer than that, and the end of a transfer is not left on the connections that
        happened to take its last large frames, at their share of the link, while the others idle.
        On a fast link the allowance is above the frame size and nothing is cut. A frame coded ahead
        (cut at the receiver's size already), or whose payload is not its blocks one after another,
        goes whole. The END frame counts the parts (all of them went before it). Called with
        ``_cond`` held."""
        if item.kind == END:
            if (transfer := self._transfers.get(item.transfer_id)) is not None:
                item.seq = transfer.num_frames
            return item
        if not item.divisible or item.num_blocks < 2 or item.coded is not None:
            return item
        block_bytes = max(len(item.payload) // item.num_blocks, 1)
        per_part = max(1, conn.frame_bytes // block_bytes)
        if self._settings.connections_per_peer >= 2:
            per_part = min(per_part, max(-(-conn.notsent_lowat // block_bytes), 1))
        parts = -(-item.num_blocks // per_part)
        take = -(-item.num_blocks // parts)
        if parts < 2 or (transfer := self._transfers.get(item.transfer_id)) is None:
            return item
        self._queue.appendleft(_Outgoing(
            DATA, item.transfer_id, transfer.num_frames, item.payload[take * block_bytes:], item.layer,
            item.group, item.block_start + take, item.num_blocks - take, item.on_sent, item.coding,
            divisible=True))
        self._cond.notify()
        transfer.num_frames += 1
        if item.on_sent is not None:
            item.on_sent.add()
        return _Outgoing(DATA, item.transfer_id, item.seq, item.payload[:take * block_bytes], item.layer,
                         item.group, item.block_start, take, item.on_sent, item.coding, divisible=True)

    def _coded(self, item: _Outgoing, codec: int) -> tuple[int, Bytes, int]:
        """(codec, payload, values per scale) of a frame on a connection that agreed on ``codec``;
        raw when it may not be coded, or when coding fails (raw is always understood)."""
        if item.coding is None or codec == NONE or self._encoder is None:
            return NONE, item.payload, 0
        dtype, row_elems = item.coding
        if item.coded is not None and item.coded[0] == codec:  # coded ahead for this codec
            return codec, item.coded[1], row_elems
        try:
            return codec, self._encoder(codec, item.payload, dtype, row_elems), row_elems
        except Exception:  # noqa: BLE001 - a codec bug must cost bytes on the wire, not the transfer
            logger.exception("request %s: KV frame could not be coded; sent raw", item.transfer_id)
            return NONE, item.payload, 0

    def _sent(self, conn: "_Connection", driver: "_Driver") -> None:
        item, conn.item, conn.views = conn.item, None, []
        assert item is not None, "a connection finishes only a frame it holds"
        conn.used_at = time.monotonic()
        self.telemetry.on_sent(conn.conn_id, conn.size)
        self.telemetry.on_cpu(driver.index, time.thread_time())
        if conn.clock.due():
            info = tcp_info(conn.connected)
            self.telemetry.on_sample(conn.conn_id, info)
            self._tune_notsent_lowat(conn, info)
        if item.kind == END:
            self._complete(item.transfer_id)
            conn.used_by.discard(item.transfer_id)
        self._release(item)

    def _tune_notsent_lowat(self, conn: "_Connection", info: dict[str, int] | None) -> None:
        """Unsent bytes worth ``notsent_queue_ms`` at the connection's rate (see settings). The rate
        is TCP's pacing rate, its estimate of what the path carries: delivery-rate samples taken while
        the connection had nothing to send would shrink the queue of an idle fast connection."""
        rate = (info or {}).get("pacing_rate_bps", 0) / 8
        if not rate:
            return
        ceiling = self._settings.notsent_lowat_bytes
        target = int(min(ceiling, max(MIN_NOTSENT_LOWAT, rate * self._settings.notsent_queue_ms / 1000)))
        if abs(target - conn.notsent_lowat) > conn.notsent_lowat // 4:
            conn.connected.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, target)
            conn.notsent_lowat = target

    def _drop(self, conn: "_Connection", poller: select.epoll, reason: str) -> None:
        """A broken connection: close it and fail every transfer that used it."""
        item, conn.item, conn.views = conn.item, None, []
        failed = conn.used_by | ({item.transfer_id} if item is not None else set())
        poller.unregister(conn.connected)
        conn.connected.close()
        conn.sock, conn.watched, conn.waiting_since, conn.used_by = None, False, 0.0, set()
        self.telemetry.on_closed(conn.conn_id)
        if item is not None:
            self._release(item)
        for transfer_id in failed:
            self._fail(transfer_id, reason)

    def _check_stalled(self, conns: list["_Connection"], poller: select.epoll) -> None:
        now, limit = time.monotonic(), min(self._settings.io_timeout_s, self._settings.stall_timeout_s)
        for conn in conns:
            if conn.waiting_since and now - conn.waiting_since > limit:
                self._drop(conn, poller, f"KV connection to {self.peer} made no progress for {limit:g} s")

    def _release(self, item: _Outgoing) -> None:
        if item.kind != ABORT:
            self._budget.release(len(item.payload))
        if item.on_sent is not None:
            item.on_sent.tick()

    def _frame_bytes_for(self, frames: FrameSizes) -> int:
        """The frame payload for a receiver that announced ``frames``: the smaller of this end's cap
        and its preferred size (which its handshake checked is within its limit)."""
        return min(self._settings.frame_cap, frames.preferred, frames.limit)

    def _connect(self) -> tuple[socket.socket, Agreement]:
        """A connected, authenticated socket and what its handshake settled with the peer."""
        if time.monotonic() < self._unreachable_until:
            raise ConnectionRefusedError("peer unreachable (recent connect failure)")
        sock = None
        try:
            timeout = min(self._settings.connect_timeout_s, self._settings.stall_timeout_s)
            sock = socket.create_connection(self._address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, self._settings.notsent_lowat_bytes)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
            agreement = client_handshake(sock, self._settings.secret_bytes, self._settings.codec_offer)
            sock.setblocking(False)
            self._announced = agreement.frames.preferred  # later payloads are cut at it (``frame_bytes``)
            self._agreed = agreement.codec  # later frames are coded ahead for it (``_code_ahead``)
            return sock, agreement
        except (OSError, HandshakeRefused) as exc:
            if sock is not None:
                sock.close()
            self._unreachable_until = time.monotonic() + RECONNECT_BACKOFF_S
            if isinstance(exc, HandshakeRefused):
                logger.error("KV handshake with %s failed: %s", self.peer, exc)
            raise

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
        self._wake()
        self.telemetry.on_transfer(False, 0, 0.0)
        self.recent_failures.append((transfer_id, reason))
        logger.warning("request %s: KV send failed: %s", transfer_id, reason)


@dataclass(slots=True, eq=False)
class _Driver:
    """One I/O thread's share of a link: its connections, and how to wake it from its wait for room."""
    index: int
    conns: list["_Connection"]
    wakeup: WakePipe = field(default_factory=WakePipe)
    want_wake: bool = False  # it waits for socket room while one of its connections is idle


@dataclass(slots=True)
class _Connection:
    conn_id: int
    clock: Clock
    sock: socket.socket | None = None
    codec: int = NONE                               # agreed at its handshake
    frame_bytes: int = 0                            # the most a frame of whole blocks carries (its handshake)
    item: _Outgoing | None = None
    views: list[memoryview] = field(default_factory=list)  # what is left to send of ``item`` (header, payload)
    size: int = 0
    used_by: set[str] = field(default_factory=set)  # transfers with frames sent on this socket
    watched: bool = False                           # registered for EPOLLOUT
    waiting_since: float = 0.0                      # blocked on a full socket since (0: not blocked)
    used_at: float = 0.0                            # when it last finished a frame
    notsent_lowat: int = 0                          # its TCP_NOTSENT_LOWAT now

    @property
    def connected(self) -> socket.socket:
        """The socket, which a connection that holds or waits on a frame always has."""
        assert self.sock is not None, f"KV connection {self.conn_id} is not connected"
        return self.sock


def _send_some(sock: socket.socket, views: list[memoryview]) -> bool:
    """Send from ``views`` (consumed in place) until done (True) or the socket is full (False)."""
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        try:
            sent = sock.send(views[0]) if tls else sock.sendmsg(views)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return False
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
    return True


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) this connection. A receiver never sends after the
    handshake, so anything readable means it is going away."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return bool(poller.poll(0))


def _parse_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV peer {peer!r} is not host:port")
    return host.strip("[]"), int(port)
