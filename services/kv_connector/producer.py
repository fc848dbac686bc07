"""The producer half of the connector's worker: sends a request's KV to its consumer, layer by layer.

Every method runs on the engine thread and waits for no copy. ``save_kv_layer`` queues a layer's
blocks (or, for a consumer of another TP size, the head slices it gets: ``tp_routes``) on the saver
(``device.producer.LayerSaver``), which copies them into pinned host memory on a side stream and
hands each copy to the transport from its own thread; a transfer's LAYOUT frame goes before its
first block. ``wait_for_save`` queues the linear-attention state pages after a request's last chunk,
then the transfer's end, and fences the compute stream behind the copies issued so far, so vLLM
may reuse a finished request's blocks at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from services.kv_connector.codecs import coding_of
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.layouts.apply import attention_view, slice_attention, slice_state, state_page, \
    state_piece_bytes
from services.kv_connector.layouts.pages import NULL_BLOCK, KVLayout, LayerInfo, state_block
from services.kv_connector.layouts.spec import Layer, LayoutSpec
from services.kv_connector.layouts.reblock import announcement
from services.kv_connector.layouts.tp_routes import Route, plan_routes, rank_peer, wire_id
from services.kv_connector.metadata import PrfaasConnectorMetadata, SendAbort, SendSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SendSettings:
    """``layerwise``: stream each layer as it is computed (False: hold all to the prefill's end);
    ``code_sends``: let the transport code attention payloads."""
    layerwise: bool = True
    code_sends: bool = False


class Producer:
    def __init__(self, streams, layout: KVLayout, spec: LayoutSpec | None, saver: LayerSaver,
                 settings: SendSettings = SendSettings()) -> None:
        self.streams = streams
        self.layout = layout
        self.saver = saver
        self._spec = spec
        self._spec_layers: dict[str, Layer] = {item.name: item for item in spec.layers} if spec is not None else {}
        self._settings = settings
        self._announcement = announcement(layout.fingerprint, spec)  # this engine's LAYOUT frame payload
        self._deferred: dict[str, list[tuple]] = {}  # send-after-prefill mode: (peer, wire id, frame) held to the end
        self._routes: dict[int, list[Route]] = {}  # by the consumer's TP size
        self._destinations_of: dict[str, list[tuple[str, str, Route]]] = {}  # this step's sends, by transfer
        self._sends: list[SendSpec] = []
        self._unannounced: set[str] = set()  # transfers starting this step whose LAYOUT frame is not sent

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        for aborted in meta.aborted_sends:
            self._abort_send(aborted)
        self._sends = meta.sends
        self._destinations_of = {}
        self._unannounced = {send.transfer_id for send in meta.sends if send.start == 0}

    def save_kv_layer(self, layer_name: str) -> None:
        """After an attention layer was enqueued: queue its blocks of every send of this step."""
        if not self._sends:
            return
        layer = self.layout.layers.get(layer_name)
        if layer is None or self.layout.is_state_group[layer.group]:
            return
        for send in self._sends:
            self._announce(send)
            self._send_attention_blocks(send, layer)

    def wait_for_save(self) -> None:
        """Queues the state pages and the end of each transfer whose last chunk ran; waits for no copy."""
        for send in self._sends:
            self._announce(send)
            if send.is_last:
                for layer in self.layout.state_layers:
                    self._send_state_page(send, layer)
                self.saver.then(partial(self._end, send, self._destinations(send)))
        if self._sends:
            self.saver.fence()
        self._sends = []

    def flush(self) -> None:
        """Wait until every queued copy was handed to the transport (host wait; not on a step's path)."""
        self.saver.flush()

    def close(self) -> None:
        self.saver.close()

    def _abort_send(self, aborted: SendAbort) -> None:
        """Ends a transfer whose request was aborted before all its KV was sent: an ABORT frame tells
        the consumer (which drops its receive at once instead of at its idle timeout), and the sender
        forgets it. Ordered after the copies already queued for it, which the sender then drops."""
        self._deferred.pop(aborted.transfer_id, None)
        if not aborted.started:
            return  # nothing of it is on the wire
        destinations = self._plan_destinations(aborted)

        def abort() -> None:
            for peer, wire, _ in destinations:
                self.streams.abort(peer, wire, "the request ended before its KV was sent")
                self.streams.finish(peer, wire)  # a failed transfer's END only releases the sender's state
            logger.debug("request %s: KV send aborted", aborted.transfer_id)

        self.saver.then(abort)

    def _end(self, send: SendSpec, destinations: list[tuple[str, str, Route]]) -> None:
        """After the transfer's last copy was handed on (the sender's thread, in order)."""
        for peer, wire, frame, coding, divisible in self._deferred.pop(send.transfer_id, ()):
            self.streams.send(peer, wire, *frame, coding=coding, divisible=divisible)
        for peer, wire, _ in destinations:
            self.streams.finish(peer, wire)
        logger.debug("request %s: all KV handed to the transport", send.transfer_id)

    def _destinations(self, send: SendSpec) -> list[tuple[str, str, Route]]:
        """(address, wire id, route) of each consumer rank this rank sends ``send`` to (worked out once
        per step, not per layer)."""
        destinations = self._destinations_of.get(send.transfer_id)
        if destinations is None:
            destinations = self._destinations_of[send.transfer_id] = self._plan_destinations(send)
        return destinations

    def _plan_destinations(self, send: SendSpec | SendAbort) -> list[tuple[str, str, Route]]:
        routes = self._routes.get(send.peer_tp_size)
        if routes is None:
            routes, problem = plan_routes(self._spec, send.peer_tp_size)
            if problem:
                logger.error("KV cannot go to a consumer of TP %d (its ranks get only this engine's layout, which "
                             "they refuse): %s", send.peer_tp_size, problem)
            self._routes[send.peer_tp_size] = routes
        wire = wire_id(send.transfer_id, self._spec)
        return [(rank_peer(send.peer, route.dst_rank), wire, route) for route in routes]

    def _announce(self, send: SendSpec) -> None:
        if send.transfer_id in self._unannounced:
            self._unannounced.discard(send.transfer_id)
            for peer, wire, _ in self._destinations(send):
                self.streams.send_layout(peer, wire, self._announcement)

    def _send_attention_blocks(self, send: SendSpec, layer: LayerInfo) -> None:
        block_size = self.layout.block_size[layer.group]
        first = send.start // block_size
        last = -(-send.end // block_size) if send.is_last else send.end // block_size
        ids = list(send.block_ids[layer.group][first:last])
        if not ids:
            return
        for peer, wire, route in self._destinations(send):
            coding = self._coding(layer)
            if route.pieces is None:
                self.saver.save(self.layout.caches[layer.name], layer.block_dim, ids,
                                self._deliverer(send, peer, wire, layer, first, coding,
                                                divisible=layer.block_dim == 0))
                continue
            if not (pieces := route.pieces.get(layer.name)):
                continue
            view = attention_view(self.layout.caches[layer.name], self._spec_layers[layer.name],
                                  self.layout.block_size[layer.group], self._spec.cache_layout)
            block_bytes = sum(view[0, p.src_start:p.src_start + p.num_units].numel() for p in pieces) \
                * view.element_size()
            # runs of at most one frame of the consumer's (as far as a handshake told it): the transport
            # splits a payload by whole blocks at its own cap, which would cut across the pieces of a
            # payload that holds several
            self.saver.save_made(partial(_sliced_blocks, view, pieces), block_bytes, ids,
                                 self._deliverer(send, peer, wire, layer, first, coding),
                                 self.streams.frame_bytes(peer))

    def _coding(self, layer: LayerInfo):
        """How the transport may code this attention layer's payloads (None: raw): only on an engine
        that codes what it sends (``SendSettings.code_sends``), in rows of one (block, head, K or V)."""
        if not self._settings.code_sends or layer.block_dim != 0:
            return None
        return coding_of(self.layout.caches[layer.name])

    def _deliverer(self, send: SendSpec, peer: str, wire: str, layer: LayerInfo, first: int, coding=None,
                   divisible: bool = False):
        """The saver's ``deliver`` for one layer's blocks from block ``first`` of the request on;
        ``divisible``: its payloads are whole blocks one after another (the transport may cut them)."""
        def deliver(offset: int, count: int, payload: memoryview, release) -> None:
            if self._settings.layerwise:
                self.streams.send(peer, wire, layer.index, layer.group, first + offset, count, payload,
                                  on_sent=release, coding=coding, divisible=divisible)
                return
            frame = (layer.index, layer.group, first + offset, count, memoryview(bytes(payload)))
            release()  # held to the prefill's end: a copy, so the ring keeps moving
            self._deferred.setdefault(send.transfer_id, []).append((peer, wire, frame, coding, divisible))
        return deliver

    def _send_state_page(self, send: SendSpec, layer: LayerInfo) -> None:
        block = state_block(send.block_ids[layer.group])
        if block == NULL_BLOCK:
            return
        for peer, wire, route in self._destinations(send):
            if route.pieces is None:
                self.saver.save(self.layout.caches[layer.name], layer.block_dim, [block],
                                self._deliverer(send, peer, wire, layer, 0))
            elif pieces := route.pieces.get(layer.name):
                page = state_page(self.layout.caches[layer.name], block)
                spec_layer = self._spec_layers[layer.name]
                page_bytes = sum(state_piece_bytes(page, spec_layer, piece) for piece in pieces)
                self.saver.save_made(partial(_sliced_page, page, spec_layer, pieces), page_bytes, [block],
                                     self._deliverer(send, peer, wire, layer, 0))


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Contiguous piece copies back to back, as bytes (a single piece is sent as it is, not copied again)."""
    flat = [piece.reshape(-1).view(torch.uint8) for piece in pieces]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _sliced_blocks(view: torch.Tensor, pieces, block_ids) -> torch.Tensor:
    """The heads of ``block_ids`` a consumer rank of another TP size gets (``tp_routes`` pieces)."""
    return _joined([slice_attention(view, block_ids, piece) for piece in pieces])


def _sliced_page(page: torch.Tensor, layer: Layer, pieces, block_ids) -> torch.Tensor:
    """The shares of a state page (the one block of ``block_ids``) a consumer rank gets."""
    return _joined([slice_state(page, layer, piece) for piece in pieces])
