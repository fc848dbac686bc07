"""``KVTransport``: send KV frames to peers and receive them from peers, over authenticated TCP.

Thread model: ``send``/``finish`` may be called from any thread and block only for
backpressure; background threads do all socket I/O; ``poll`` returns what arrived (frames, then
``TransferDone`` or ``TransferFailed``) and is meant for one consuming thread.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import ssl
import threading
from collections.abc import Callable

from services.kv_transport.events import Event, Frame, TransferDone, TransferFailed
from services.kv_transport.protocol import DEFAULT_FRAME_SIZES, Bytes, block_frame_fields
from services.kv_transport.receiver import Receiver
from services.kv_transport.sender import Coding, Encoder, PeerLink
from services.kv_transport.settings import TransportSettings
from services.kv_transport.telemetry import MAX_LISTED, TransportSnapshot

logger = logging.getLogger(__name__)

__all__ = ["Frame", "KVTransport", "TransferDone", "TransferFailed"]


class KVTransport:
    def __init__(self, settings: TransportSettings, listen_host: str = "127.0.0.1",
                 listen_port: int | None = None, encoder: Encoder | None = None,
                 frame_bytes: int = DEFAULT_FRAME_SIZES.preferred) -> None:
        """``listen_port`` None: send only; 0: listen on a free port (see ``port``). ``encoder``
        codes the payloads sent with a ``coding`` (the connector's, ``kv_connector/codecs.py``);
        without one everything is sent raw. ``frame_bytes``: the frame payload the receiver asks
        senders for at the handshake when ``settings.frame_bytes`` is 0 (the receiving service's
        default; the connector's depends on its device)."""
        self.settings = settings
        self._encoder = encoder
        self.listen_host = listen_host
        if not settings.secret_bytes:
            logger.warning("KV transport has no shared secret (transport.secret or $%s): any process that "
                           "can reach the KV port can connect", settings.secret_env)
        self._links: dict[str, PeerLink] = {}
        self._links_lock = threading.Lock()
        self._receiver = None
        if listen_port is not None:
            self._receiver = Receiver(settings, listen_host, listen_port, _server_tls(settings),
                                      settings.frame_sizes(frame_bytes))

    @property
    def port(self) -> int | None:
        return self._receiver.port if self._receiver else None

    @property
    def receive_frame_bytes(self) -> int | None:
        """The frame payload this end's receiver announces (None: send only)."""
        return self._receiver.frames.preferred if self._receiver else None

    def send(self, peer: str, transfer_id: str, layer: int, group: int, block_start: int, num_blocks: int,
             payload: Bytes, on_sent: Callable[[], None] | None = None, coding: Coding | None = None,
             divisible: bool = False) -> None:
        """Queue blocks ``[block_start, block_start + num_blocks)`` of one layer for ``peer``. The
        payload is not copied: it must stay unchanged until ``on_sent`` is called (from the sending
        thread, once it is in the sockets or dropped with a failed transfer). ``coding``: attention
        KV that the codec agreed with the peer may code (``sender.Coding``); None: sent raw.
        ``divisible``: the payload is its blocks one after another, and its frames may be cut into
        smaller runs of blocks as they go out (a slow connection then holds less of the transfer)."""
        self._link(peer).send(transfer_id, layer, group, block_start, num_blocks, payload, on_sent, coding,
                              divisible)

    def frame_bytes(self, peer: str) -> int:
        """The most a frame to ``peer`` carries: this end's cap (``TransportSettings.frame_cap``), or
        the frame size ``peer`` announced at a handshake when smaller. A payload that is not whole
        blocks one after another is cut at the cap alone, never finer, so one made this size before
        the handshake arrives as it was made."""
        return self._link(peer).frame_bytes

    def send_layout(self, peer: str, transfer_id: str, layout: bytes) -> None:
        """Queue the producer's KV layout (a LAYOUT frame), which the consumer checks before writing blocks."""
        self._link(peer).send_layout(transfer_id, layout)

    def send_block(self, peer: str, transfer_id: str, index: int, group: int, payload: Bytes) -> None:
        """Queue one whole block, the ``index``-th of the transfer (``Frame.block_index`` at the receiver)."""
        self.send(peer, transfer_id, *block_frame_fields(index, group), payload)

    def finish(self, peer: str, transfer_id: str) -> None:
        """No more frames for this transfer; the receiver completes it once all have arrived."""
        self._link(peer).finish(transfer_id)

    def abort(self, peer: str, transfer_id: str, reason: str) -> None:
        """Give up on a transfer to ``peer``: its queued frames are dropped and the receiver is told why
        (an ABORT frame). Nothing happens for a transfer already complete."""
        self._link(peer).abort(transfer_id, reason)

    def poll(self, wait_s: float = 0.0) -> list[Event]:
        """Events received so far, in arrival order; waits up to ``wait_s`` for the first one."""
        if self._receiver is None:
            return []
        events: list[Event] = []
        source = self._receiver.events
        try:
            events.append(source.get(timeout=wait_s) if wait_s > 0 else source.get_nowait())
            while True:
                events.append(source.get_nowait())
        except queue.Empty:
            pass
        released = sum(len(e.payload) for e in events if isinstance(e, Frame))
        if released:
            self._receiver.staging.release(released)
        return events

    def receive_into(self, allocate: Callable[[int], memoryview]) -> None:
        """Read each received frame's payload into ``allocate(num_bytes)`` (pinned host memory, say),
        called on the receiving thread; the memory is the allocator's to reclaim once the frame's
        payload is no longer referenced."""
        if self._receiver is not None:
            self._receiver.allocate = allocate

    def forget(self, transfer_id: str) -> None:
        """The consumer no longer wants this transfer; later frames of it are discarded."""
        if self._receiver is not None:
            self._receiver.forget(transfer_id)

    def snapshot(self) -> TransportSnapshot:
        """Telemetry for metrics: per-peer sending figures and receiving counters."""
        with self._links_lock:
            links = list(self._links.values())
        peers = tuple(link.telemetry.snapshot() for link in links)
        pending = [transfer_id for link in links for transfer_id in link.pending_ids]
        sending = TransportSnapshot(peers, transfers_sending=len(pending), sends_pending=tuple(pending[:MAX_LISTED]),
                                    sends_failed=tuple(f for link in links for f in list(link.recent_failures)))
        if self._receiver is None:
            return sending
        return dataclasses.replace(sending, bytes_received=self._receiver.bytes_received,
                                   frames_rejected=self._receiver.frames_rejected,
                                   connections_refused=self._receiver.connections_refused,
                                   transfers_receiving=self._receiver.num_pending)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        with self._links_lock:
            for link in self._links.values():
                link.close()

    def _link(self, peer: str) -> PeerLink:
        with self._links_lock:
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = PeerLink(peer, self.settings, _client_tls(self.settings), self._encoder)
            return link


def _server_tls(settings: TransportSettings) -> ssl.SSLContext | None:
    if not settings.uses_tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=settings.tls_ca)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _client_tls(settings: TransportSettings) -> ssl.SSLContext | None:
    if not settings.uses_tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.tls_ca)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    context.check_hostname = False  # peers are addressed by IP; the private CA is the trust anchor
    return context
